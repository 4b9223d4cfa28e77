"""Imports run one way: config -> (data_pipeline, compat) -> parallel -> models -> (hf, training)
-> tools -> (cli, research, benchmarks). Read from the sources with ``ast`` (every import, also
the ones inside functions), so a lazy import cannot hide an upward edge or a cycle. Model code
(``models/``, ``parallel/megatron_config.py``) is also read for any use of the run config."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ascender_dist", "data_pipeline", "benchmarks")

# the layer of each group (a top-level package, or a sub-package of ascender_dist); a module may
# import its own group and groups of a lower or equal layer, never one above it
LAYERS = {
    "ascender_dist.config": 0, "ascender_dist.logs": 0, "ascender_dist.versions": 0, "ascender_dist.machine": 0, "ascender_dist.ports": 0, "ascender_dist.launcher": 0, "ascender_dist.plotting": 0,
    "ascender_dist.extras": 0, "ascender_dist.locks": 0,
    "data_pipeline": 1, "ascender_dist.compat": 1,
    "ascender_dist.parallel": 2,
    "ascender_dist.models": 3,
    "ascender_dist.hf": 4, "ascender_dist.training": 4,
    "ascender_dist.tools": 5,
    "ascender_dist.research": 6, "ascender_dist.cli": 6, "ascender_dist.launch_entry": 6, "ascender_dist": 6,
    "benchmarks": 6, "tests": 6,
}
# data_pipeline stands alone (no megatron, no deepspeed, no model code): config is all it may use
ONLY = {"data_pipeline": {"data_pipeline", "ascender_dist.config"}}

# Edges that break the rule today (this list may only shrink; the test fails when one disappears)
KNOWN_UPWARD: set = set()


def group(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "ascender_dist" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str):
    """(imported module, line) for every import of ours in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]  # a module, or a name in module base
        else:
            continue
        for name in names:
            if name.split(".")[0] in (*PACKAGES, "tests"):
                yield name, node.lineno


def graph():
    edges = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            edges[module] = {(target, line, path) for target, line in imports(path, module)}
    return edges


def resolve(target: str, modules) -> str:
    """``a.b.c`` names a module, or a name in module ``a.b``."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def upward_edges():
    found = set()
    edges = graph()
    for module, targets in edges.items():
        here = group(module)
        for target, line, path in targets:
            target = resolve(target, edges) or target
            there = group(target)
            if there == here:
                continue
            allowed = ONLY.get(here)
            wrong = there not in allowed if allowed else LAYERS[there] > LAYERS[here]
            if wrong:
                found.add((module, target, f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_every_group_has_a_layer():
    missing = {group(m) for m in graph()} - set(LAYERS)
    assert not missing, f"add {sorted(missing)} to LAYERS"


def test_no_upward_import():
    found = upward_edges()
    new = sorted(f"{where}: {module} imports {target}" for module, target, where in found
                 if (module, target) not in KNOWN_UPWARD)
    assert not new, "imports must run config -> models -> training -> tools:\n" + "\n".join(new)


def test_known_upward_imports_are_still_there():
    gone = KNOWN_UPWARD - {(module, target) for module, target, _ in upward_edges()}
    assert not gone, f"remove {sorted(gone)} from KNOWN_UPWARD"


def _cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_rule_catches_an_upward_import(monkeypatch):
    real = graph()
    here = ROOT / "ascender_dist" / "config" / "schema.py"
    fake = {**real, "ascender_dist.config.schema": real["ascender_dist.config.schema"]
            | {("ascender_dist.models.registry.layer_spec", 1, here)}}
    monkeypatch.setitem(globals(), "graph", lambda: fake)
    assert ("ascender_dist.config.schema", "ascender_dist.models.registry") in {(m, t) for m, t, _ in upward_edges()}


# Module cycles today (none; each would be a registration by import side effect or a package
# __init__ importing modules that import it back)
KNOWN_CYCLES: list = []


def test_no_import_cycle_between_modules():
    edges = graph()
    modules = set(edges)
    resolved = {m: {resolve(t, modules) for t, _, _ in targets} - {m, ""} for m, targets in edges.items()}
    # a package's own __init__ importing its modules (re-exports) is not a cycle of ideas
    for module in resolved:
        resolved[module] = {t for t in resolved[module] if not module.startswith(t + ".")}
    cycles = [c for c in _cycles(resolved) if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


# Model code is told the model section and a ModelLayout (ascender_dist/config/layout.py), never the
# run: no name of the run config or its derived values, and no run-level section read off a config
# (``x.train.seed``, ``x.parallel.sequence_parallel``, ...). ``data`` is left out: ``tensor.data.x``.
MODEL_CODE = [*sorted((ROOT / "ascender_dist" / "models").rglob("*.py")),
              ROOT / "ascender_dist" / "parallel" / "megatron_config.py"]
RUN_NAMES = {"RunConfig", "Derived"}
RUN_SECTIONS = {"train", "parallel", "optimizer", "checkpoint", "logging"}


def run_config_uses(source: str):
    """(line, what) for each reference to the run config in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in RUN_NAMES:
            yield node.lineno, node.id
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] in RUN_NAMES:
            yield node.lineno, f"import {node.name}"
        elif isinstance(node, ast.Attribute) and node.attr in RUN_NAMES:
            yield node.lineno, node.attr
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in RUN_SECTIONS:
            yield node.lineno, f"{node.value.attr}.{node.attr}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in RUN_NAMES:
            yield node.lineno, repr(node.value)  # a string annotation


@pytest.mark.parametrize("source", [
    "from ascender_dist.config.schema import RunConfig", "def f(cfg: RunConfig): pass",
    "def f(cfg: 'RunConfig'): pass", "from ascender_dist.config.resolve import Derived",
    "seed = cfg.train.seed", "sp = cfg.parallel.sequence_parallel", "import ascender_dist.config.schema as s; s.RunConfig"])
def test_the_model_code_rule_catches_a_run_config(source):
    assert list(run_config_uses(source))


@pytest.mark.parametrize("source", [
    "def f(model: ModelConfig, layout: ModelLayout): pass", "w = param.data.float()", "model.train()",
    "config.sequence_parallel", "from ascender_dist.parallel.mappings import copy_to_tp"])
def test_the_model_code_rule_allows_model_sections(source):
    assert not list(run_config_uses(source))


def test_model_code_never_sees_the_run_config():
    found = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in MODEL_CODE
             for line, what in run_config_uses(path.read_text(encoding="utf-8"))]
    assert not found, "model code takes (ModelConfig, ModelLayout, precision, seed), not the run config:\n" \
        + "\n".join(found)
