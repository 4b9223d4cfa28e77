"""Copy the pure-torch layer math into an export directory, so it loads without ascender-dist.

``transformers`` loads remote code from flat files in the model directory and follows their
relative imports (``from .x import y``) transitively. The ASCender and Connection math lives in
two sub-packages here (``ascender_dist.models.ascender`` / ``.connection``, no megatron, no
deepspeed); this module copies the modules the Hugging Face model needs, renamed flat
(``asd_ascender_fast.py``, ``asd_connection_layer.py``, ...), with their imports rewritten to
those names, and writes ``ascender_dist_kernels.py`` importing from them. The copies are taken
from the installed package at export time, so an export always carries the math it was made with.

The hyper-parameter dataclasses live in ``ascender_dist.config`` (``ascender_hparams``,
``connection_hparams``, and the ``errors`` their ``validate`` methods raise); those config modules
import nothing but each other and are copied the same way (``asd_config_*.py``). A module that
imports anything else from ``ascender_dist`` makes the export fail, naming the import: the
exported directory must not need the package.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from ascender_dist.config.errors import UserError

# what the Hugging Face model imports: (sub-package, module) -> names
KERNEL_IMPORTS = {
    ("ascender", "attention"): ["ascender_attention"],
    ("config", "ascender_hparams"): ["AscenderHParams"],
    ("ascender", "params"): ["AscenderHeadParams", "alibi_slopes"],
    ("config", "connection_hparams"): ["ConnectionHParams"],
    ("connection", "layer"): ["ConnectionLayer", "make_fixed_slots"],
}
PACKAGES = {"ascender": "ascender_dist.models.ascender", "connection": "ascender_dist.models.connection",
            "ascender_kernels": "ascender_dist.models.ascender.kernels",  # Triton kernels (loaded lazily)
            "config": "ascender_dist.config"}  # hyper-parameter dataclasses and their errors only
# the config modules an export may carry (the rest of the config package needs the whole project)
VENDORED_CONFIG = {"ascender_hparams", "connection_hparams", "errors"}


class VendorError(UserError, ValueError):
    """A module cannot be copied into an export on its own; ``str(e)`` names the import."""


def flat_name(package: str, module: str) -> str:
    """asd_<package>_<module>; a package's own __init__ is asd_<package>."""
    return f"asd_{package}" if module == "__init__" else f"asd_{package}_{module}"


def _source_path(package: str, module: str) -> Path:
    dotted = PACKAGES[package] if module == "__init__" else f"{PACKAGES[package]}.{module}"
    spec = importlib.util.find_spec(dotted)
    if spec is None or not spec.origin:
        raise VendorError(f"{PACKAGES[package]}.{module}: module not found")
    return Path(spec.origin)


def _names(node: ast.ImportFrom) -> str:
    return ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    """The dotted module an import names (relative ones resolved inside ``package``)."""
    if node.level == 0:
        return node.module
    if not node.module:
        return None  # "from . import x": not vendorable (rejected by the caller)
    parts = PACKAGES[package].split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + [node.module])


def _target(node: ast.ImportFrom, package: str) -> tuple[str, str] | None:
    """(sub-package, module) that an import refers to, or None when it is not ours. The
    innermost registered package wins (``.kernels.launch`` is ascender_kernels, not ascender)."""
    name = _absolute(node, package)
    best = None
    for key, dotted in PACKAGES.items():
        if name == dotted:
            found = (key, "__init__")
        elif name and name.startswith(dotted + "."):
            found = (key, name[len(dotted) + 1 :].split(".")[0])
        else:
            continue
        if best is None or len(dotted) > len(PACKAGES[best[0]]):
            best = found
    return best


def rewrite_module(source: str, package: str, where: str) -> tuple[str, list[tuple[str, str]]]:
    """Source with package imports made flat-relative; returns it and the modules it needs."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line) 1-based inclusive -> replacement
    needs: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ascender_dist":
                    raise VendorError(f"{where}:{node.lineno}: 'import {alias.name}' cannot be vendored")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        indent = lines[node.lineno - 1][: node.col_offset]
        target = _target(node, package)
        if target is not None and target[0] == "config" and target[1] not in VENDORED_CONFIG:
            target = None  # the rest of the config package is not vendorable: rejected below
        if target is not None:
            needs.append(target)
            text = f"{indent}from .{flat_name(*target)} import {_names(node)}\n"
        elif node.level > 0 or (node.module or "").split(".")[0] == "ascender_dist":
            raise VendorError(f"{where}:{node.lineno}: 'from {'.' * node.level}{node.module or ''} import "
                              f"{_names(node)}' cannot be vendored (the export must not need ascender_dist)")
        else:
            continue
        edits.append((node.lineno, node.end_lineno or node.lineno, text))
    for first, last, text in sorted(edits, reverse=True):
        lines[first - 1:last] = [text]
    header = f"# Vendored by ascender-dist export-hf from {PACKAGES[package]} ({where}); do not edit.\n"
    return header + "".join(lines), needs


def vendor_kernels(out_dir: Path) -> list[str]:
    """Write the vendored modules and ``ascender_dist_kernels.py`` into ``out_dir``; return file names."""
    out_dir = Path(out_dir)
    todo = list(KERNEL_IMPORTS)
    done: dict[tuple[str, str], str] = {}
    while todo:
        key = todo.pop()
        if key in done:
            continue
        path = _source_path(*key)
        text, needs = rewrite_module(path.read_text(), key[0], f"{PACKAGES[key[0]]}.{key[1]}")
        done[key] = text
        todo.extend(n for n in needs if n not in done)
    written = []
    for key, text in sorted(done.items()):
        name = flat_name(*key) + ".py"
        (out_dir / name).write_text(text)
        written.append(name)
    kernels = ['"""Generated by ascender-dist export-hf: the layer math from the vendored copies next to this file."""',
               ""]
    exported = []
    for key, names in KERNEL_IMPORTS.items():
        kernels.append(f"from .{flat_name(*key)} import {', '.join(names)}")
        exported += names
    kernels += ["", f"__all__ = {sorted(exported)!r}", ""]
    (out_dir / "ascender_dist_kernels.py").write_text("\n".join(kernels))
    return sorted(written) + ["ascender_dist_kernels.py"]
