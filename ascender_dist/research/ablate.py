"""Ablation grids: every variant x seed is a real training run; paired statistics against a baseline.

    ascender-dist ablate configs/ablations/bias.yaml [--set train.train_steps=50] [--seeds 1,2]
                         [--only gpt,ascender] [--jobs 2] [--threads 1] [--report-only] [--dry-run]
    python -m ascender_dist.research.ablate configs/ablations/bias.yaml      (the same)

A grid file (``configs/ablations/*.yaml``)::

    name: bias                        # names the default output directories
    base: ../demo.yaml                # run config: inline mapping, a run-config YAML (relative to this
                                      #   file), or another grid file (its base + set + dataset)
    set: {train.train_steps: 300}     # dotted overrides applied to ``base`` for every run
    dataset:                          # optional: build corpus + tokenizer + shards once, point data.* at them
      {root: runs/ablations/data, corpus_bytes: 3000000, vocab_size: 2048, seq_length: 128}
    seeds: [1, 2, 3]                  # train.seed of every run: init AND data order (see below)
    baseline: gpt                     # a variant name; every other variant is compared with it
    compare_to: [ascender]            # optional further references (e.g. bias removal vs all-on)
    variants:                         # a named axis: option name -> dotted overrides
      gpt: {model.architecture: gpt}
      ascender: {model.architecture: ascender}
    axes:                             # crossed with the variants, all combinations
      model.ascender.k: [4, 8]        #   list: a dotted path and its values (name "k=4")
      taus:                           #   mapping: a named axis, option -> dotted overrides
        tau0.5: {model.ascender.tau_sep: 0.5, model.ascender.tau_coh: 0.5}
    standalone:                       # extra variants NOT crossed with the axes (e.g. a GPT baseline
      gpt: {model.architecture: gpt}  #   next to a grid over ASCender options)
    eval_iters: 32                    # validation micro-batches of the final val loss ("all": whole split)
    runs_dir: runs/ablations/bias     # run directories (checkpoints, logs): large, not committed
    report_dir: runs/ablations/bias/report   # results.{json,md} and the figures

Variant names join the option names of every axis with ``,`` (``ascender,k=4,tau0.5``). Every
override path is checked against the run-config schema before anything runs, so a typo fails in one
line naming the grid file and the path.

**Pairing.** ``data_pipeline.StreamingLoader`` is seeded with ``train.seed`` (the trainer passes
``seed=cfg.train.seed``), so the training data order is a function of (seed, dataset, sequence length,
global batch size, data-parallel size). All variants of one seed therefore read the same batches in
the same order, which is what the paired tests assume; each run records a sha256 of every training
token it consumed (``data_sha256``) and the report checks that it agrees across the variants of a seed.
An axis that changes the data (``data.*``, ``model.seq_length``, ``train.global_batch_size``) breaks
the pairing: the report says so. The validation split is read unshuffled, so every run scores the
same validation sequences in the same order (the per-example comparison relies on it).

**Runs.** Each (variant, seed) is one ``python -m ascender_dist.research.ablate --run-one`` process on
one rank (RANK=0, WORLD_SIZE=1, gloo on CPU): ``Trainer(cfg).fit()``, then ``Trainer.validate()`` over
``eval_iters`` validation batches while a forward hook keeps each sequence's loss. A run whose
``result.json`` exists is skipped (resumable); a run directory without one is wiped and run again.
Recorded: final val loss (and per-sequence val losses), the train loss of every step, tokens/s (median
step time after the first two steps), parameter count, analytic FLOPs/token, peak RSS, the learned
ASCender ``omega`` per layer and head, and the data hash.

**Report.** ``results.md`` / ``results.json``: the metric per variant as mean +- std with the paired
bootstrap CI, approximate-randomisation p and Cohen's d_z against the baseline
(:func:`ascender_dist.research.tables.results_table`), the same against every ``compare_to`` reference,
a per-example comparison (validation sequences as the resampling unit, losses averaged over seeds), the
final train loss, and cost columns. Figures: ``pareto.png`` (Fig. 2: val loss vs training FLOPs and vs
measured throughput, Pareto front), ``ablation.png`` (Fig. 3: differences with CIs) and ``curves.png``
(unsmoothed train loss per step, mean over seeds).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union, get_args, get_origin, get_type_hints

import numpy as np
import yaml

from ascender_dist.config.errors import ConfigError, UserError
from ascender_dist.logs import setup_cli_logging

log = logging.getLogger("ascender_dist")

GRID_KEYS = ("name", "description", "base", "set", "dataset", "seeds", "baseline", "compare_to", "metric",
             "variants", "axes", "standalone", "eval_iters", "runs_dir", "report_dir", "keep_checkpoints", "jobs", "threads")
DATASET_KEYS = ("root", "corpus_bytes", "vocab_size", "seq_length", "val_fraction", "samples_per_shard")
# override paths that change what data a seed reads: variants differing here are not paired on data
DATA_ORDER_PATHS = ("data.", "model.seq_length", "train.global_batch_size")
RESULT = "result.json"


class AblationError(UserError, RuntimeError):
    """A run failed; ``str(e)`` is one line naming the run and its log."""


# ============================================================================ grid

@dataclass
class Variant:
    name: str
    overrides: dict  # dotted path -> value
    labels: tuple = ()


@dataclass
class Grid:
    name: str
    path: str
    base: dict  # raw run config (before presets), with ``set`` and the dataset paths merged in
    seeds: list
    baseline: str
    variants: list
    compare_to: list = field(default_factory=list)
    metric: str = "val_loss"
    dataset: Optional[dict] = None
    eval_iters: Union[int, str, None] = None
    runs_dir: Path = Path("runs/ablations")
    report_dir: Path = Path("runs/ablations/report")
    keep_checkpoints: bool = True
    jobs: int = 1
    threads: int = 1
    description: str = ""
    data_order_axes: list = field(default_factory=list)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)


def _unwrap_optional(tp):
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def check_config_path(dotted: str, where: str) -> None:
    """Raise ConfigError(``where``) unless ``dotted`` names a field of the run-config schema."""
    from ascender_dist.config.schema import RunConfig

    cls = RunConfig
    parts = dotted.split(".")
    if not dotted or any(not p for p in parts):
        raise ConfigError(where, f"{dotted!r} is not a dotted config path (e.g. model.ascender.k)")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(where, f"{'.'.join(parts[:i])} is a value, not a section: cannot set {dotted!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            close = [n for n in names if n.lower().replace("_", "") == part.lower().replace("_", "")]
            import difflib

            close = close or difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            section = ".".join(parts[:i]) or "the run config"
            raise ConfigError(where, f"unknown config field {part!r} in {section}{hint}")
        cls = _unwrap_optional(get_type_hints(cls)[part])


def dotted_to_tree(overrides: dict) -> dict:
    """``{"a.b": 1, "a.c": 2}`` -> ``{"a": {"b": 1, "c": 2}}`` (later paths win)."""
    from ascender_dist.config.loader import deep_merge

    tree: dict = {}
    for dotted, value in overrides.items():
        node: dict = {}
        leaf = node
        keys = dotted.split(".")
        for key in keys[:-1]:
            leaf = leaf.setdefault(key, {})
        leaf[keys[-1]] = value
        tree = deep_merge(tree, node)
    return tree


def _label_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _axis_options(key: str, value, where: str, short: str = "") -> list[tuple[str, dict]]:
    """One axis -> [(option label, dotted overrides)]. ``where``: "grid.yaml: axes.<key>"."""
    if isinstance(value, list):  # a dotted path and its values
        if not value:
            raise ConfigError(where, "an axis needs at least one value")
        return [(f"{short}={_label_value(v)}", {key: v}) for v in value]
    if isinstance(value, dict):  # a named axis: option -> overrides
        if not value:
            raise ConfigError(where, "an axis needs at least one option")
        options = []
        for label, overrides in value.items():
            overrides = _mapping(overrides if overrides is not None else {}, f"{where}.{label}")
            for dotted in overrides:
                check_config_path(str(dotted), f"{where}.{label}.{dotted}")
            options.append((str(label), {str(k): v for k, v in overrides.items()}))
        return options
    raise ConfigError(where, "expected a list of values (a dotted path) or a mapping option -> overrides "
                             f"(a named axis), got {type(value).__name__} {value!r}")


def _short_names(paths: list[str]) -> dict:
    """Last path component, or the full path where two axes share it."""
    last = [p.rsplit(".", 1)[-1] for p in paths]
    return {p: (s if last.count(s) == 1 else p) for p, s in zip(paths, last)}


def expand_variants(variants: Optional[dict], axes: Optional[dict], source: str = "grid") -> list[Variant]:
    """All combinations of the named ``variants`` and every axis, in order (the first axis varies slowest).

    ``variants``: {name: {dotted: value}}; ``axes``: {dotted path: [values]} or {axis name: {option:
    {dotted: value}}}. Every dotted path must exist in the run-config schema (ConfigError naming it)."""
    dims: list[list[tuple[str, dict]]] = []
    if variants is not None:
        if not isinstance(variants, dict):
            raise ConfigError(f"{source}: variants", "expected a mapping variant name -> dotted overrides")
        if variants:
            dims.append(_axis_options("variants", variants, f"{source}: variants"))
    axes = _mapping(axes, f"{source}: axes") if axes is not None else {}
    list_axes = [str(k) for k, v in axes.items() if isinstance(v, list)]
    for key in list_axes:
        check_config_path(key, f"{source}: axes.{key}")
    short = _short_names(list_axes)
    for key, value in axes.items():
        dims.append(_axis_options(str(key), value, f"{source}: axes.{key}", short.get(str(key), "")))
    if not dims:
        return [Variant(name="base", overrides={}, labels=("base",))]
    out, seen = [], set()
    for combo in itertools.product(*dims):
        labels = tuple(label for label, _ in combo)
        overrides: dict = {}
        for _, o in combo:
            overrides.update(o)
        name = ",".join(labels)
        if name in seen:
            raise ConfigError(source, f"two variants are both named {name!r}: rename an option")
        seen.add(name)
        out.append(Variant(name=name, overrides=overrides, labels=labels))
    return out


_GRID_ONLY = ("base", "set", "seeds", "variants", "axes", "standalone", "baseline", "dataset")


def _read_base(base, grid_path: Path, depth: int = 0) -> dict:
    """``base``: inline run config, a run-config YAML, or another grid file (its base + set + dataset)."""
    from ascender_dist.config.loader import deep_merge, read_yaml_file

    if base is None:
        return {}
    if not isinstance(base, str):
        return _mapping(base, f"{grid_path}: base")
    path = Path(base)
    if not path.is_absolute():
        candidate = grid_path.parent / path
        path = candidate if candidate.exists() else path
    data = read_yaml_file(path)
    if not any(key in data for key in _GRID_ONLY):
        return data
    if depth > 4:
        raise ConfigError(f"{grid_path}: base", "grid files refer to each other in a loop")
    inner = _read_base(data.get("base"), path, depth + 1)
    inner = deep_merge(inner, dotted_to_tree(_mapping(data.get("set") or {}, f"{path}: set")))
    if isinstance(data.get("dataset"), dict) and "root" in data["dataset"]:
        root = Path(data["dataset"]["root"])
        inner = deep_merge(inner, {"data": {"manifest": str(root / "shards" / "manifest.json"),
                                            "tokenizer": str(root / "tokenizer.model")}})
    return inner


def _parse_seeds(value, where: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool)
                                                          for s in value):
        raise ConfigError(where, f"expected a non-empty list of integer seeds, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(where, f"duplicate seeds in {value}")
    return list(value)


def load_grid(path, overrides: Sequence[str] = (), seeds: Optional[Sequence[int]] = None,
              only: Optional[Sequence[str]] = None) -> Grid:
    """Read and check a grid file: every override path and every variant's config (ConfigError, one line)."""
    from ascender_dist.config.loader import deep_merge, parse_override, read_yaml_file

    path = Path(path)
    raw = read_yaml_file(path)
    src = str(path)
    unknown = sorted(set(raw) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"{src}: {unknown[0]}", f"unknown grid key; allowed: {', '.join(GRID_KEYS)}")
    name = str(raw.get("name") or path.stem)
    base = _read_base(raw.get("base"), path)
    set_section = _mapping(raw.get("set") or {}, f"{src}: set")
    for dotted in set_section:
        check_config_path(str(dotted), f"{src}: set.{dotted}")
    base = deep_merge(base, dotted_to_tree(set_section))
    for text in overrides:  # command-line --set, applied to every run
        tree = parse_override(text)
        check_config_path(text.split("=", 1)[0].strip(), f"--set {text.split('=', 1)[0].strip()}")
        base = deep_merge(base, tree)
    dataset = raw.get("dataset")
    if dataset is not None:
        dataset = _mapping(dataset, f"{src}: dataset")
        bad = sorted(set(dataset) - set(DATASET_KEYS))
        if bad:
            raise ConfigError(f"{src}: dataset.{bad[0]}", f"unknown key; allowed: {', '.join(DATASET_KEYS)}")
        if "root" not in dataset:
            raise ConfigError(f"{src}: dataset.root", "required (directory of corpus, tokenizer and shards)")
        root = Path(dataset["root"])
        base = deep_merge(base, {"data": {"manifest": str(root / "shards" / "manifest.json"),
                                          "tokenizer": str(root / "tokenizer.model")}})
    variants = expand_variants(raw.get("variants"), raw.get("axes"), src)
    if raw.get("variants") is None and raw.get("axes") is None and raw.get("standalone"):
        variants = []  # only standalone variants
    standalone = _mapping(raw.get("standalone") or {}, f"{src}: standalone")
    for label, overrides in standalone.items():  # not crossed with the axes
        overrides = _mapping(overrides if overrides is not None else {}, f"{src}: standalone.{label}")
        for dotted in overrides:
            check_config_path(str(dotted), f"{src}: standalone.{label}.{dotted}")
        if str(label) in {v.name for v in variants}:
            raise ConfigError(f"{src}: standalone.{label}", "a variant of the grid already has this name")
        variants.append(Variant(name=str(label), overrides={str(k): v for k, v in overrides.items()},
                                labels=(str(label),)))
    if only:
        names = {v.name for v in variants}
        missing = [o for o in only if o not in names]
        if missing:
            raise ConfigError(f"--only {missing[0]}", f"no such variant; variants: {', '.join(sorted(names))}")
        variants = [v for v in variants if v.name in only]
    seed_list = list(seeds) if seeds else _parse_seeds(raw.get("seeds", [1]), f"{src}: seeds")
    baseline = raw.get("baseline", variants[0].name)
    names = [v.name for v in variants]
    if str(baseline) not in names:
        raise ConfigError(f"{src}: baseline", f"{baseline!r} is not a variant; variants: {', '.join(names)}")
    compare_to = raw.get("compare_to") or []
    if isinstance(compare_to, str):
        compare_to = [compare_to]
    for ref in compare_to:
        if str(ref) not in names:
            raise ConfigError(f"{src}: compare_to", f"{ref!r} is not a variant; variants: {', '.join(names)}")
    eval_iters = raw.get("eval_iters")
    if eval_iters is not None and eval_iters != "all" and not (isinstance(eval_iters, int) and eval_iters > 0):
        raise ConfigError(f"{src}: eval_iters", f"expected a positive integer or 'all', got {eval_iters!r}")
    grid = Grid(
        name=name, path=src, base=base, seeds=seed_list, baseline=str(baseline), variants=variants,
        compare_to=[str(c) for c in compare_to if str(c) != str(baseline)], metric=str(raw.get("metric", "val_loss")),
        dataset=dataset, eval_iters=eval_iters,
        runs_dir=Path(raw.get("runs_dir") or f"runs/ablations/{name}"),
        report_dir=Path(raw.get("report_dir") or f"runs/ablations/{name}/report"),
        keep_checkpoints=bool(raw.get("keep_checkpoints", True)), jobs=int(raw.get("jobs", 1)),
        threads=int(raw.get("threads", 1)), description=str(raw.get("description") or "").strip(),
    )
    grid.data_order_axes = sorted({p for v in variants for p in v.overrides
                                   if any(p == d or p.startswith(d) for d in DATA_ORDER_PATHS)})
    for v in variants:  # every variant must be a valid run config (types, ranges, architecture checks)
        run_config(grid, v, seed_list[0])
    return grid


def run_dir(grid: Grid, variant: Variant, seed: int) -> Path:
    return grid.runs_dir / _safe(variant.name) / f"seed{seed}"


def run_config_raw(grid: Grid, variant: Variant, seed: int) -> dict:
    from ascender_dist.config.loader import deep_merge

    raw = deep_merge(grid.base, dotted_to_tree(variant.overrides))
    out = run_dir(grid, variant, seed)
    return deep_merge(raw, {"name": f"{grid.name}-{_safe(variant.name)}-seed{seed}", "output_dir": str(out),
                            "train": {"seed": seed}, "checkpoint": {"dir": None, "auto_resume": True}})


def run_config(grid: Grid, variant: Variant, seed: int):
    from ascender_dist.config.resolve import config_from_dict

    try:
        return config_from_dict(run_config_raw(grid, variant, seed))
    except ConfigError as exc:
        raise ConfigError(f"{grid.path}: variant {variant.name}: {exc.path}", exc.message) from None


# ============================================================================ dataset

def ensure_dataset(spec: dict) -> dict:
    """Build (once) the default corpus -> sentencepiece tokenizer -> webdataset shards under ``spec['root']``."""
    from data_pipeline.corpus import build_default_corpus
    from data_pipeline.shards import write_shards
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    root = Path(spec["root"])
    manifest, model = root / "shards" / "manifest.json", root / "tokenizer.model"
    if not manifest.exists():
        root.mkdir(parents=True, exist_ok=True)
        log.info("building the dataset in %s", root)
        corpus = build_default_corpus(root / "corpus.jsonl", max_bytes=int(spec.get("corpus_bytes", 3_000_000)))
        if not model.exists():
            train_tokenizer([corpus], root / "tokenizer", vocab_size=int(spec.get("vocab_size", 2048)))
        write_shards([corpus], Tokenizer.load(model), root / "shards", seq_length=int(spec.get("seq_length", 128)),
                     samples_per_shard=int(spec.get("samples_per_shard", 256)),
                     val_fraction=float(spec.get("val_fraction", 0.05)))
    return {"manifest": str(manifest), "tokenizer": str(model)}


# ============================================================================ one run (child process)

def _status_kib(name: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
        return True
    except OSError:
        return False


def _ascender_omegas(model) -> dict:
    """{layer number: [[omega_align, omega_sep, omega_coh] per head]} of every ASCender layer."""
    out = {}
    for module in model.modules():
        if type(module).__name__ == "AscenderCoreAttention":
            out[str(int(module.layer_number))] = module.params.omega.detach().float().cpu().tolist()
    return out


def run_one(config_path: Path, result_path: Path, eval_iters: Union[int, str, None] = None) -> dict:
    """Train one run (this process is rank 0 of 1) and write its result JSON atomically."""
    import resource

    import torch

    from ascender_dist.config import load_config
    from ascender_dist.models.counting import count_model
    from ascender_dist.training.callbacks import DataDigest, PerSequenceValidationLosses, Throughput
    from ascender_dist.training.trainer import Trainer

    cfg = load_config(config_path)
    t_start = time.perf_counter()
    digest, per_sequence = DataDigest(), PerSequenceValidationLosses()
    trainer = Trainer(cfg, callbacks=[digest, per_sequence])
    setup_s = time.perf_counter() - t_start
    if trainer.step:
        raise AblationError(f"{cfg.output_dir}: resumed at step {trainer.step}; an ablation run must start fresh")
    step_times = next(cb for cb in trainer.callbacks if isinstance(cb, Throughput)).step_times
    rss_before = _status_kib("VmRSS")
    peak_resettable = _reset_peak_rss()
    t_fit = time.perf_counter()
    losses = trainer.fit()
    fit_s = time.perf_counter() - t_fit
    train_peak = _status_kib("VmHWM")

    # final validation: Trainer.validate over eval_iters batches, per-sequence losses from a callback
    t_val = time.perf_counter()
    if eval_iters == "all":
        eval_iters = 1 << 62  # validate clips it to the batches there are
    val_loss = trainer.validate(int(eval_iters or cfg.train.eval_iters))
    val_s = time.perf_counter() - t_val
    iters = min(int(eval_iters or cfg.train.eval_iters), len(trainer.val_loader))
    per_example = per_sequence.losses

    vocab = cfg.model.vocab_size or trainer.tokenizer.vocab_size
    counts = count_model(cfg, vocab)
    params = sum(p.numel() for p in {id(p): p for p in trainer.engine.module.parameters()}.values())
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    steady = step_times[2:] if len(step_times) > 3 else step_times
    median_step = float(np.median(steady)) if steady else float("nan")
    tail = max(1, len(losses) // 10)
    from ascender_dist.config.architectures import expand_layer_pattern

    result = {
        "config": None, "seed": cfg.train.seed,  # filled by the parent (variant name)
        "name": cfg.name, "architecture": cfg.model.architecture, "layer_pattern": expand_layer_pattern(cfg),
        "val_loss": float(val_loss), "val_batches": iters, "val_sequences": len(per_example),
        "val_example_losses": per_example,
        "final_train_loss": float(np.mean(losses[-tail:])) if losses else None,
        "train_losses": [float(x) for x in losses],
        "steps": len(losses), "tokens": len(losses) * tokens_per_step,
        "step_time_s": step_times, "median_step_time_s": median_step,
        "tokens_per_s": tokens_per_step / median_step if steady else None,
        "tokens_per_s_mean": len(losses) * tokens_per_step / fit_s if fit_s > 0 else None,
        "params": int(params), "params_analytic": int(counts.total_params),
        "non_embedding_params": int(counts.non_embedding_params),
        "flops_per_token": float(counts.flops_per_token),
        "training_flops": float(counts.flops_per_token) * len(losses) * tokens_per_step,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_peak_rss_delta_mib": ((train_peak - rss_before) / 1024
                                     if peak_resettable and train_peak and rss_before else None),
        "omega": _ascender_omegas(trainer.engine.module),
        "data_sha256": digest.hexdigest(),
        "setup_s": setup_s, "fit_s": fit_s, "val_s": val_s,
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir": str(trainer.derived.checkpoint_dir),
    }
    result_path = Path(result_path)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(result_path)
    return result


# ============================================================================ running the grid (parent)

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env(threads: int) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": str(threads)}
    env.setdefault("DS_ACCELERATOR", "cpu")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _last_error_line(log_file: Path) -> str:
    if not log_file.exists():
        return "(no log)"
    lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^(\w+\.)*\w*(Error|Exception)\b|^error:", line):
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


def launch_run(grid: Grid, variant: Variant, seed: int, threads: int, timeout: Optional[float] = None) -> dict:
    """Run one (variant, seed) in a fresh process unless its result exists; return its record."""
    directory = run_dir(grid, variant, seed)
    result_file = directory / RESULT
    if result_file.exists():
        return _load_record(result_file, variant.name)
    if directory.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    cfg = run_config(grid, variant, seed)
    from ascender_dist.config.loader import to_dict

    (directory / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    cmd = [sys.executable, "-m", "ascender_dist.research.ablate", "--run-one", str(directory / "config.yaml"),
           "--result", str(result_file)]
    if grid.eval_iters is not None:
        cmd += ["--eval-iters", str(grid.eval_iters)]
    log_file = directory / "run.log"
    with open(log_file, "w") as out:
        proc = subprocess.run(cmd, env=_child_env(threads), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not result_file.exists():
        raise AblationError(f"{log_file}: run {variant.name} seed {seed} failed (exit {proc.returncode}): "
                            f"{_last_error_line(log_file)}")
    record = _load_record(result_file, variant.name)
    if not grid.keep_checkpoints:
        shutil.rmtree(record.get("checkpoint_dir") or directory / "checkpoints", ignore_errors=True)
    return record


def _load_record(result_file: Path, variant_name: str) -> dict:
    record = json.loads(Path(result_file).read_text())
    record["config"] = variant_name
    return record


def run_grid(grid: Grid, jobs: Optional[int] = None, threads: Optional[int] = None, progress: bool = True) -> list[dict]:
    """Every (variant, seed) not yet done, ``jobs`` at a time, with a progress bar. Returns all records."""
    from tqdm import tqdm

    jobs = max(1, jobs or grid.jobs)
    threads = max(1, threads or grid.threads)
    todo = [(v, s) for s in grid.seeds for v in grid.variants]  # seed-major: early seeds complete first
    done = [(v, s) for v, s in todo if (run_dir(grid, v, s) / RESULT).exists()]
    pending = [t for t in todo if t not in done]
    bar = tqdm(total=len(todo), initial=len(done), unit="run", desc=f"ablate {grid.name}", disable=not progress)
    records = []
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(launch_run, grid, v, s, threads): (v, s) for v, s in pending}
            for future in concurrent.futures.as_completed(futures):
                v, s = futures[future]
                record = future.result()  # AblationError propagates (other runs finish first)
                bar.update(1)
                bar.set_postfix_str(f"{v.name} seed {s}: {grid.metric} {record.get(grid.metric, float('nan')):.4f}")
    finally:
        bar.close()
    for v, s in todo:
        records.append(_load_record(run_dir(grid, v, s) / RESULT, v.name))
    return records


def collect_records(grid: Grid) -> list[dict]:
    """Records of every finished run of the grid (missing runs are left out)."""
    out = []
    for s in grid.seeds:
        for v in grid.variants:
            f = run_dir(grid, v, s) / RESULT
            if f.exists():
                out.append(_load_record(f, v.name))
    return out


# ============================================================================ aggregation

def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def _num(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.0f}"


def per_example_table(records: Sequence[dict], reference: str, *, n_resamples: int = 10_000,
                      n_permutations: int = 10_000, seed: int = 0, digits: int = 4) -> tuple[str, dict]:
    """Each config vs ``reference`` with validation sequences as the unit (losses averaged over shared seeds)."""
    from .stats import compare_per_example

    by_cfg: dict[str, dict] = {}
    for r in records:
        if r.get("val_example_losses"):
            by_cfg.setdefault(r["config"], {})[r["seed"]] = np.asarray(r["val_example_losses"], dtype=np.float64)
    lines = [f"| config | seeds | sequences | Δ val loss vs {reference} [95% CI] | p |", "|---|---:|---:|---:|---:|"]
    entries = []
    if reference not in by_cfg:
        return "\n".join(lines) + f"\n\n- no per-example losses for {reference!r}\n", {"reference": reference,
                                                                                       "configs": []}
    base = by_cfg[reference]
    for cfg, runs in by_cfg.items():
        if cfg == reference:
            continue
        shared = [s for s in runs if s in base and runs[s].shape == base[s].shape]
        if not shared:
            entries.append({"config": cfg, "comparison": None, "note": "no shared seed with equal validation sets"})
            lines.append(f"| {cfg} | 0 | 0 | n/a | n/a |")
            continue
        b = np.stack([base[s] for s in shared])
        t = np.stack([runs[s] for s in shared])
        cmp = compare_per_example(b, t, n_resamples=n_resamples, n_permutations=n_permutations, seed=seed)
        d = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in cmp.to_dict().items()}
        entries.append({"config": cfg, "paired_seeds": shared, "n_sequences": int(b.shape[1]), "comparison": d,
                        "note": None})
        lines.append(f"| {cfg} | {len(shared)} | {b.shape[1]} | {_fmt(cmp.mean_diff, digits)} "
                     f"[{_fmt(cmp.ci_low, digits)}, {_fmt(cmp.ci_high, digits)}] | {_fmt(cmp.p_value, 3)} |")
    obj = {"reference": reference, "unit": "validation sequence (loss averaged over paired seeds)",
           "difference": "config - reference", "n_resamples": n_resamples, "n_permutations": n_permutations,
           "configs": entries}
    return "\n".join(lines) + "\n", obj


def cost_table(records: Sequence[dict], order: Sequence[str]) -> tuple[str, dict]:
    """Parameters, FLOPs and measured cost per config (mean +- std over seeds where they vary)."""
    by_cfg: dict[str, list] = {}
    for r in records:
        by_cfg.setdefault(r["config"], []).append(r)
    lines = ["| config | params | FLOPs/token (train) | training FLOPs | tokens/s mean ± std | step time (s) "
             "| peak RSS (MiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    entries = []
    for cfg in [c for c in order if c in by_cfg]:
        rs = by_cfg[cfg]
        tps = np.array([r["tokens_per_s"] for r in rs if r.get("tokens_per_s")], dtype=np.float64)
        steps = np.array([r["median_step_time_s"] for r in rs if r.get("median_step_time_s")], dtype=np.float64)
        rss = np.array([r["peak_rss_mib"] for r in rs], dtype=np.float64)
        e = {"config": cfg, "n": len(rs), "params": rs[0]["params"], "flops_per_token": rs[0]["flops_per_token"],
             "training_flops": float(np.mean([r["training_flops"] for r in rs])),
             "tokens_per_s_mean": float(tps.mean()) if tps.size else None,
             "tokens_per_s_std": float(tps.std(ddof=1)) if tps.size > 1 else None,
             "median_step_time_s": float(np.median(steps)) if steps.size else None,
             "peak_rss_mib_mean": float(rss.mean())}
        entries.append(e)
        lines.append(f"| {cfg} | {e['params']:,} | {e['flops_per_token']:.4g} | {e['training_flops']:.3g} | "
                     f"{_num(e['tokens_per_s_mean'])} ± {_num(e['tokens_per_s_std'])} | "
                     f"{_fmt(e['median_step_time_s'], 3)} | {e['peak_rss_mib_mean']:.0f} |")
    return "\n".join(lines) + "\n", {"configs": entries}


def omega_table(records: Sequence[dict], order: Sequence[str]) -> tuple[str, dict]:
    """Mean learned omega per bias (over layers, heads and seeds) for the ASCender configs."""
    lines = ["| config | ω_align | ω_sep | ω_coh |", "|---|---:|---:|---:|"]
    entries = []
    by_cfg: dict[str, list] = {}
    for r in records:
        if r.get("omega"):
            by_cfg.setdefault(r["config"], []).append(np.array([h for layer in r["omega"].values() for h in layer]))
    for cfg in [c for c in order if c in by_cfg]:
        arr = np.concatenate(by_cfg[cfg])  # [runs*layers*heads, 3]
        mean, std = arr.mean(0), arr.std(0)
        entries.append({"config": cfg, "mean": mean.tolist(), "std_over_heads": std.tolist(), "n_heads": len(arr)})
        lines.append(f"| {cfg} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(mean, std)) + " |")
    return "\n".join(lines) + "\n", {"configs": entries}


def data_pairing(records: Sequence[dict]) -> dict:
    """Per seed: do all configs share the training-data hash?"""
    by_seed: dict = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["config"]] = r.get("data_sha256")
    return {str(s): {"identical": len(set(h.values())) == 1, "configs": sorted(h)} for s, h in by_seed.items()}


def aggregate(records: Sequence[dict], baseline: str, compare_to: Sequence[str] = (), metric: str = "val_loss",
              *, n_resamples: int = 10_000, n_permutations: int = 10_000, seed: int = 0) -> tuple[str, dict]:
    """All tables of an ablation from run records (``{"config", "seed", metric, ...}``). Returns (markdown, json)."""
    from .tables import results_table

    if not records:
        raise ValueError("no run records to aggregate")
    order = list(dict.fromkeys(r["config"] for r in records))
    kw = dict(n_resamples=n_resamples, n_permutations=n_permutations, seed=seed)
    seeds = sorted({r["seed"] for r in records})
    md, obj = [], {"metric": metric, "baseline": baseline, "compare_to": list(compare_to), "seeds": seeds,
                   "exact_p_floor": 2.0 / 2 ** len(seeds) if seeds else None}
    main_md, obj["main"] = results_table(records, baseline, metric, **kw)
    md += [f"### {metric} vs {baseline} (paired by seed)", "", main_md]
    obj["vs"] = {}
    for ref in compare_to:
        ref_md, obj["vs"][ref] = results_table(records, ref, metric, **kw)
        md += [f"### {metric} vs {ref} (paired by seed)", "", ref_md]
    if any(r.get("val_example_losses") for r in records) and metric == "val_loss":
        obj["per_example"] = {}
        for ref in [baseline, *compare_to]:
            pe_md, obj["per_example"][ref] = per_example_table(records, ref, **kw)
            md += [f"### val loss vs {ref}, per validation sequence (sequences resampled, seeds averaged)", "", pe_md]
    if all(r.get("final_train_loss") is not None for r in records):
        tr_md, obj["final_train_loss"] = results_table(records, baseline, "final_train_loss", **kw)
        md += [f"### final train loss (mean of the last 10% of steps) vs {baseline}", "", tr_md]
    if all("params" in r and "flops_per_token" in r for r in records):
        c_md, obj["cost"] = cost_table(records, order)
        md += ["### cost", "", c_md]
    if any(r.get("omega") for r in records):
        o_md, obj["omega"] = omega_table(records, order)
        md += ["### learned ω (mean ± std over layers × heads × seeds)", "", o_md]
    obj["data_pairing"] = data_pairing(records)
    return "\n".join(md), obj


# ============================================================================ figures

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(records: Sequence[dict], out: Path, metric: str = "val_loss") -> list[dict]:
    """Fig. 2: quality (metric, lower better) vs cost: training FLOPs and seconds per 1k tokens."""
    from .tables import pareto_front

    plt = _plt()
    order = list(dict.fromkeys(r["config"] for r in records))
    by_cfg = {c: [r for r in records if r["config"] == c] for c in order}
    panels = [("training_flops", "training FLOPs (analytic, 6N + attention)", lambda r: r["training_flops"]),
              ("s_per_1k_tokens", "seconds per 1k training tokens (measured, lower is better)",
               lambda r: 1000.0 / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    fronts = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, xlabel, cost_of) in zip(axes, panels):
        points = []
        for i, cfg in enumerate(order):
            rs = by_cfg[cfg]
            q = np.array([r[metric] for r in rs], dtype=np.float64)
            c = np.array([cost_of(r) for r in rs], dtype=np.float64)
            color = colors[i % len(colors)]
            ax.scatter(c, q, s=12, alpha=0.35, color=color)
            ax.errorbar(np.nanmean(c), q.mean(), yerr=q.std(ddof=1) if q.size > 1 else None,
                        xerr=np.nanstd(c, ddof=1) if c.size > 1 else None, fmt="o", color=color, capsize=3,
                        label=cfg)
            points.append((q.mean(), np.nanmean(c)))
            if math.isfinite(points[-1][1]):
                ax.annotate(cfg, (points[-1][1], points[-1][0]), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")
        finite = [i for i, p in enumerate(points) if all(math.isfinite(v) for v in p)]
        front = [finite[j] for j in pareto_front([points[i] for i in finite])] if finite else []
        if front:
            ax.plot([points[i][1] for i in front], [points[i][0] for i in front], "k--", lw=1, label="Pareto front")
        fronts.append({"cost": key, "front": [order[i] for i in front],
                       "points": {order[i]: {"quality": points[i][0], "cost": points[i][1]} for i in range(len(order))}})
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{metric} (mean ± std over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Quality vs cost (Fig. 2); faint dots: single seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return fronts


def plot_ablation(obj: dict, records: Sequence[dict], out: Path) -> None:
    """Fig. 3: differences vs each reference with the bootstrap CI, and relative throughput."""
    plt = _plt()
    tables = [(obj["baseline"], obj["main"])] + list(obj.get("vs", {}).items())
    fig, axes = plt.subplots(1, len(tables) + 1, figsize=(4.2 * (len(tables) + 1), 3.6), squeeze=False)
    for ax, (ref, table) in zip(axes[0], tables):
        names, mids, los, his = [], [], [], []
        for e in table["configs"]:
            c = e.get("comparison")
            if e["config"] == ref or not c or c.get("mean_diff") is None:
                continue
            names.append(e["config"])
            mids.append(c["mean_diff"])
            los.append(c["mean_diff"] - (c["ci_low"] if c["ci_low"] is not None else c["mean_diff"]))
            his.append((c["ci_high"] if c["ci_high"] is not None else c["mean_diff"]) - c["mean_diff"])
        y = np.arange(len(names))
        ax.errorbar(mids, y, xerr=[los, his], fmt="o", capsize=3)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel(f"Δ {obj['metric']} vs {ref} (95% CI)")
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    order = list(dict.fromkeys(r["config"] for r in records))
    base = [r["tokens_per_s"] for r in records if r["config"] == obj["baseline"] and r.get("tokens_per_s")]
    if base:
        ref_tps = float(np.mean(base))
        vals = [np.mean([r["tokens_per_s"] for r in records if r["config"] == c and r.get("tokens_per_s")] or [np.nan])
                / ref_tps for c in order]
        ax.barh(np.arange(len(order)), vals)
        ax.set_yticks(np.arange(len(order)))
        ax.set_yticklabels(order, fontsize=8)
        ax.axvline(1, color="k", lw=0.8)
        ax.set_xlabel(f"tokens/s relative to {obj['baseline']}")
    fig.suptitle("Ablation (Fig. 3): negative Δ loss = better than the reference")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_curves(records: Sequence[dict], out: Path, baseline: Optional[str] = None) -> None:
    """Unsmoothed training loss per step, mean over seeds (the checklist's learning curves), and each
    config's per-step difference to ``baseline`` paired by seed (the curves themselves overlap)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if baseline else 1, figsize=(13 if baseline else 7, 4), squeeze=False)
    ax = axes[0][0]
    configs = list(dict.fromkeys(r["config"] for r in records))
    for cfg in configs:
        curves = [r["train_losses"] for r in records if r["config"] == cfg and r.get("train_losses")]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        mean = np.mean([c[:n] for c in curves], axis=0)
        ax.plot(np.arange(1, n + 1), mean, lw=0.9, label=f"{cfg} (n={len(curves)})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over seeds, unsmoothed)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if baseline:
        ax = axes[0][1]
        base = {r["seed"]: r["train_losses"] for r in records if r["config"] == baseline and r.get("train_losses")}
        for cfg in configs:
            if cfg == baseline:
                continue
            diffs = [np.asarray(r["train_losses"][:len(base[r["seed"]])]) -
                     np.asarray(base[r["seed"]][:len(r["train_losses"])])
                     for r in records if r["config"] == cfg and r["seed"] in base and r.get("train_losses")]
            if not diffs:
                continue
            n = min(len(d) for d in diffs)
            ax.plot(np.arange(1, n + 1), np.mean([d[:n] for d in diffs], axis=0), lw=0.8,
                    label=f"{cfg} (n={len(diffs)})")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss − {baseline} (same seed, mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


# ============================================================================ report

def _environment() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_at_report": list(load) if load else None}


def write_report(grid: Grid, records: Sequence[dict], *, n_resamples: int = 10_000,
                 n_permutations: int = 10_000) -> dict:
    """results.md, results.json, pareto.png, ablation.png and curves.png in ``grid.report_dir``."""
    out = Path(grid.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    present = {r["config"] for r in records}
    refs = [c for c in grid.compare_to if c in present]
    md, obj = aggregate(records, grid.baseline, refs, grid.metric, n_resamples=n_resamples,
                        n_permutations=n_permutations)
    fronts = plot_pareto(records, out / "pareto.png", grid.metric)
    plot_ablation(obj, records, out / "ablation.png")
    plot_curves(records, out / "curves.png", grid.baseline)
    missing = [f"{v.name} seed {s}" for s in grid.seeds for v in grid.variants
               if not any(r["config"] == v.name and r["seed"] == s for r in records)]
    pairing = obj["data_pairing"]
    unpaired = [s for s, p in pairing.items() if not p["identical"]]
    r0 = records[0]
    header = [
        f"# Ablation `{grid.name}`", "",
        grid.description, "",
        f"Generated by `ascender-dist ablate {grid.path}` (`ascender_dist/research/ablate.py`). "
        f"{len(records)} runs: {len(present)} variants × seeds {grid.seeds}; every run trained "
        f"{r0['steps']} steps ({r0['tokens']:,} tokens) on 1 CPU rank and was scored on "
        f"{r0['val_sequences']} validation sequences. Differences are config − reference (negative = lower loss).",
        "",
        f"With {len(obj['seeds'])} seeds the exact randomisation test cannot give p below "
        f"2/2^{len(obj['seeds'])} = {obj['exact_p_floor']:.3g}; the percentile bootstrap CI over so few seeds is "
        "too narrow (docs/research.md). The per-sequence table resamples validation sequences instead: it says "
        "whether a difference of these trained models would hold on another validation set like this one, "
        "not whether it would hold for another training seed.",
        "",
        "Training-data pairing: " + ("every variant of a seed read identical training tokens (sha256 of all "
                                     "consumed tokens)." if not unpaired else
                                     f"seeds {unpaired} did NOT see identical data across variants "
                                     f"(axes {grid.data_order_axes}): seed-paired tests are not data-paired there."),
        "",
    ]
    if missing:
        header += [f"Missing runs (not in the tables): {', '.join(missing)}", ""]
    figures = ["", "Figures: `pareto.png` (Fig. 2, quality vs cost), `ablation.png` (Fig. 3, differences with CIs), "
               "`curves.png` (train loss per step, and its per-step difference to the baseline).", ""]
    (out / "results.md").write_text("\n".join(header) + "\n" + md + "\n".join(figures))
    grid_info = {"name": grid.name, "path": grid.path, "seeds": grid.seeds, "baseline": grid.baseline,
                 "compare_to": grid.compare_to, "metric": grid.metric,
                 "variants": [{"name": v.name, "overrides": v.overrides} for v in grid.variants],
                 "base": grid.base, "eval_iters": grid.eval_iters}
    slim = [{k: v for k, v in r.items() if k not in ("val_example_losses", "step_time_s")} for r in records]
    full = {"grid": grid_info, "environment": _environment(), "tables": obj, "pareto": fronts,
            "missing_runs": missing, "records": slim}
    (out / "results.json").write_text(json.dumps(_json_safe(full), indent=1))
    return full


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


# ============================================================================ CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascender-dist ablate", description=__doc__.split("\n\n")[0])
    p.add_argument("grid", nargs="?", help="grid YAML (configs/ablations/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config field for every run, e.g. --set train.train_steps=20")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (replaces the grid's)")
    p.add_argument("--only", default=None, help="comma-separated variant names to run/report")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: grid 'jobs', else 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: grid 'threads', else 1)")
    p.add_argument("--runs-dir", default=None, help="override the grid's runs_dir")
    p.add_argument("--report-dir", default=None, help="override the grid's report_dir")
    p.add_argument("--report-only", action="store_true", help="write the report from the finished runs only")
    p.add_argument("--dry-run", action="store_true", help="check the grid and list the runs, train nothing")
    p.add_argument("--n-resamples", type=int, default=10_000)
    p.add_argument("--no-progress", action="store_true")
    # child mode
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-iters", default=None, help=argparse.SUPPRESS)
    return p


def _child_main(args) -> int:
    from ascender_dist.logs import quiet_library_warnings

    quiet_library_warnings()
    setup_cli_logging()
    eval_iters = args.eval_iters
    if eval_iters is not None and eval_iters != "all":
        eval_iters = int(eval_iters)
    run_one(Path(args.run_one), Path(args.result), eval_iters)
    return 0


def ablate_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist ablate``: run (or resume) a grid, then write its report. Exit 2 on a user error."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.run_one:
        return _child_main(args)
    if not args.grid:
        print("error: a grid file is required (configs/ablations/*.yaml)", file=sys.stderr)
        return 2
    setup_cli_logging()
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        print(f"error: --seeds: expected comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    try:
        grid = load_grid(args.grid, args.overrides, seeds, only)
        if args.runs_dir:
            grid.runs_dir = Path(args.runs_dir)
        if args.report_dir:
            grid.report_dir = Path(args.report_dir)
        if args.dry_run:
            for s in grid.seeds:
                for v in grid.variants:
                    done = (run_dir(grid, v, s) / RESULT).exists()
                    print(f"{v.name}\tseed {s}\t{run_dir(grid, v, s)}\t{'done' if done else 'pending'}\t"
                          f"{json.dumps(v.overrides)}")
            return 0
        if not args.report_only:
            if grid.dataset is not None:
                ensure_dataset(grid.dataset)
            run_grid(grid, args.jobs, args.threads, progress=not args.no_progress)
        records = collect_records(grid)
        if not records:
            print(f"error: {grid.runs_dir}: no finished runs to report", file=sys.stderr)
            return 2
        write_report(grid, records, n_resamples=args.n_resamples, n_permutations=args.n_resamples)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {grid.report_dir}/results.md, results.json, pareto.png, ablation.png, curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(ablate_main())
