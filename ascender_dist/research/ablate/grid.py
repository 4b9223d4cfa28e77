"""Grid files: parse, expand the variants, check every variant's run config, build the dataset once."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union, get_args, get_origin, get_type_hints


from ascender_dist.config.errors import ConfigError, UserError


log = logging.getLogger("ascender_dist")


# the per-run numbers of result.json (launch.run_one) a grid may compare its variants on
METRICS = ("val_loss", "final_train_loss", "median_step_time_s", "tokens_per_s", "peak_rss_mib", "params",
           "training_flops")
GRID_KEYS = ("name", "description", "base", "set", "dataset", "seeds", "baseline", "compare_to", "metric",
             "variants", "axes", "standalone", "eval_iters", "runs_dir", "report_dir", "keep_checkpoints", "jobs", "threads",
             "ranks", "equal_flops_of")
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
    ranks: int = 1  # ranks per run (per node with a hostfile / SLURM)
    budget: str = "equal training tokens"  # how the variants' training budgets compare (report label)
    description: str = ""
    data_order_axes: list = field(default_factory=list)
    # settings the grid computes per variant from the base config (equal_flops_of: train.train_steps);
    # a --set of one changes what they are computed from
    derived: tuple = ()

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


def check_config_path(dotted: str, where: str, allow_index: bool = False) -> None:
    """Raise ConfigError(``where``) unless ``dotted`` names a field of the run-config schema: ``a.b``,
    and with ``allow_index`` (a command-line --set) a list item ``a.b[1].c``."""
    from ascender_dist.config.loader import closest_name, dotted_path, override_path
    from ascender_dist.config.schema import RunConfig

    try:
        parts = override_path(dotted) if dotted else []
    except ConfigError:
        parts = []
    if not parts:
        raise ConfigError(where, f"{dotted!r} is not a dotted config path (e.g. model.ascender.k)")
    if not allow_index and any(isinstance(p, int) for p in parts):
        raise ConfigError(where, f"{dotted!r}: a list item by index is for the command line's --set; a grid "
                                 "file sets the whole list")
    cls = RunConfig
    for i, part in enumerate(parts):
        here = dotted_path(parts[:i]) or "the run config"
        if isinstance(part, int):
            if get_origin(cls) is not list:
                raise ConfigError(where, f"{here} is not a list: cannot set {dotted!r}")
            cls = _unwrap_optional(get_args(cls)[0])
            continue
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(where, f"{here} is a value, not a section: cannot set {dotted!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            close = closest_name(part, names)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(where, f"unknown config field {part!r} in {here}{hint}")
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
    """``name`` as one directory name: other characters become _, and a name of dots only (``..``
    would leave runs_dir) or an empty one becomes underscores."""
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)
    return "_" * max(1, len(safe)) if set(safe) <= {"."} else safe


def _grid_bool(raw: dict, key: str, default: bool, src: str) -> bool:
    """A true/false grid key, strictly (``no`` or ``'false'`` is not false: an error, like the run config's)."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{src}: {key}", f"expected true or false, got {value!r}")
    return value


def _grid_count(raw: dict, key: str, default: int, src: str) -> int:
    """A positive integer grid key (2.9 or '3' is an error, not 2 or a traceback)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{src}: {key}", f"expected a positive integer, got {value!r}")
    return value


# value checks of the dataset keys other than root: (type, test, what it must be)
DATASET_VALUES = {
    # no shell expands a YAML value: ~/data would be a directory named '~' in the working directory
    "root": (str, lambda v: bool(v.strip()) and not v.startswith("~"),
             "a directory path, without a leading '~' (not expanded here: write the full path)"),
    "corpus_bytes": (int, lambda v: v > 0, "a positive integer"),
    "vocab_size": (int, lambda v: v > 0, "a positive integer"),
    "seq_length": (int, lambda v: v > 0, "a positive integer"),
    "samples_per_shard": (int, lambda v: v > 0, "a positive integer"),
    "val_fraction": ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
}


def _grid_dir(raw: dict, key: str, default: str, src: str) -> Path:
    value = raw.get(key)
    value = default if value is None else value
    if not isinstance(value, str) or not value or value.startswith("~"):
        raise ConfigError(f"{src}: {key}", f"expected a directory path without a leading '~' (not expanded here: "
                                           f"write the full path), got {value!r}")
    return Path(value)


def _check_dataset_values(dataset: dict, src: str) -> None:
    for key, (types_, test, meaning) in DATASET_VALUES.items():
        if key in dataset:
            value = dataset[key]
            if isinstance(value, bool) or not isinstance(value, types_) or not test(value):
                raise ConfigError(f"{src}: dataset.{key}", f"expected {meaning}, got {value!r}")


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
    out = []
    for combo in itertools.product(*dims):
        labels = tuple(label for label, _ in combo)
        overrides: dict = {}
        for (label, o), (other_label, other) in itertools.combinations(combo, 2):
            both = sorted(set(o) & set(other))
            if both:  # the later dimension would win silently: a label naming a setting the run does not have
                raise ConfigError(source, f"{label!r} and {other_label!r} both set {both[0]}: one dimension "
                                          "of the grid must own each setting")
        for _, o in combo:
            overrides.update(o)
        out.append(Variant(name=",".join(labels), overrides=overrides, labels=labels))
    return out


def check_variant_names(variants: list[Variant], source: str) -> None:
    """Every variant (crossed or standalone) needs a name and a run directory (``_safe(name)``) of its
    own: a second variant there would resume, report or overwrite the first one's runs."""
    names: set = set()
    dirs: dict = {}
    for v in variants:
        if v.name in names:
            raise ConfigError(source, f"two variants are both named {v.name!r}: rename one")
        if _safe(v.name) in dirs:
            raise ConfigError(source, f"variants {dirs[_safe(v.name)]!r} and {v.name!r} share the run directory "
                                      f"name {_safe(v.name)!r}: rename one")
        names.add(v.name)
        dirs[_safe(v.name)] = v.name


def match_only(parts: Sequence[str], names: Sequence[str]) -> list[str]:
    """--only's names, given split at commas: an axes grid's own comma-holding names
    (``use_align=false,...``) are matched whole, longest first; a part that names nothing is kept
    (load_grid names it in its error)."""
    parts, out, i = list(parts), [], 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            candidate = ",".join(parts[i:j]).strip()
            if candidate in names:
                out.append(candidate)
                i = j
                break
        else:
            out.append(parts[i].strip())
            i += 1
    return out


_GRID_ONLY = ("base", "set", "seeds", "variants", "axes", "standalone", "baseline", "dataset")


def _read_base(base, grid_path: Path, seen: tuple = ()) -> dict:
    """``base``: inline run config, a run-config YAML, or another grid file (its base + set + dataset).
    ``seen``: the grid files already on this chain of bases (a loop is one of them named again)."""
    from ascender_dist.config.loader import deep_merge, iter_leaf_paths, read_yaml_file

    if base is None:
        return {}
    if not isinstance(base, str):
        return _mapping(base, f"{grid_path}: base")
    path = Path(base)
    if not path.is_absolute():
        candidate = grid_path.parent / path
        path = candidate if os.path.exists(candidate) else path  # False on any OSError: read_yaml_file names it
    try:
        data = read_yaml_file(path)
    except ConfigError as exc:  # the file named, and where the grid names it
        raise ConfigError(f"{grid_path}: base: {exc.path}", exc.message) from None
    if not any(key in data for key in _GRID_ONLY):
        for dotted in iter_leaf_paths(data):  # a typo in the base file is named there, not in every variant
            check_config_path(dotted, f"{grid_path}: base {path}: {dotted}")
        return data
    here = os.path.realpath(path)
    chain = seen or (os.path.realpath(grid_path),)
    if here in chain:
        raise ConfigError(f"{grid_path}: base", f"grid files refer to each other in a loop ({path} again)")
    inner = _read_base(data.get("base"), path, chain + (here,))
    inner = deep_merge(inner, dotted_to_tree(_mapping(data.get("set") or {}, f"{path}: set")))
    if isinstance(data.get("dataset"), dict) and "root" in data["dataset"]:
        inner = deep_merge(inner, {"data": dataset_paths(Path(data["dataset"]["root"]))})
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
    """Read and check a grid file: every override path and every variant's config (ConfigError, one line).

    ``only``: the variants to run (with the baseline and ``compare_to``), as --only's text split at
    commas (names holding commas are matched whole)."""
    from ascender_dist.config.loader import apply_override, deep_merge, override_key, read_yaml_file

    path = Path(path)
    raw = read_yaml_file(path)
    src = str(path)
    unknown = sorted(set(raw) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"{src}: {unknown[0]}", f"unknown grid key; allowed: {', '.join(GRID_KEYS)}")
    name = raw.get("name")
    name = path.stem if name is None else name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: name", f"expected a non-empty string (the runs' folder name), got {name!r}")
    base = _read_base(raw.get("base"), path)
    set_section = _mapping(raw.get("set") or {}, f"{src}: set")
    for dotted in set_section:
        check_config_path(str(dotted), f"{src}: set.{dotted}")
    base = deep_merge(base, dotted_to_tree(set_section))
    for text in overrides:  # command-line --set, applied to every run
        check_config_path(override_key(text), f"--set {override_key(text)}", allow_index=True)
        base = apply_override(base, text)
    dataset = raw.get("dataset")
    if dataset is not None:
        dataset = _mapping(dataset, f"{src}: dataset")
        bad = sorted(set(dataset) - set(DATASET_KEYS))
        if bad:
            raise ConfigError(f"{src}: dataset.{bad[0]}", f"unknown key; allowed: {', '.join(DATASET_KEYS)}")
        if "root" not in dataset:
            raise ConfigError(f"{src}: dataset.root", "required (directory of corpus, tokenizer and shards)")
        _check_dataset_values(dataset, src)
        base = deep_merge(base, {"data": dataset_paths(Path(dataset["root"]))})
    variants = expand_variants(raw.get("variants"), raw.get("axes"), src)
    if raw.get("variants") is None and raw.get("axes") is None and raw.get("standalone"):
        variants = []  # only standalone variants
    standalone = _mapping(raw.get("standalone") or {}, f"{src}: standalone")
    for label, overrides in standalone.items():  # not crossed with the axes
        overrides = _mapping(overrides if overrides is not None else {}, f"{src}: standalone.{label}")
        for dotted in overrides:
            check_config_path(str(dotted), f"{src}: standalone.{label}.{dotted}")
        variants.append(Variant(name=str(label), overrides={str(k): v for k, v in overrides.items()},
                                labels=(str(label),)))
    check_variant_names(variants, src)
    if only:
        only = match_only(only, [v.name for v in variants])
        names = {v.name for v in variants}
        missing = [o for o in only if o not in names]
        if missing:
            raise ConfigError(f"--only {missing[0]}", f"no such variant; variants: {', '.join(sorted(names))}")
        refs = raw.get("compare_to") or []  # what the chosen variants are reported against runs too
        keep = set(only) | {str(raw.get("baseline", variants[0].name))} | {str(r) for r in
                                                                            ([refs] if isinstance(refs, str) else refs)}
        variants = [v for v in variants if v.name in keep]
    seed_list = _parse_seeds(list(seeds), "--seeds") if seeds is not None else _parse_seeds(raw.get("seeds", [1]),
                                                                                           f"{src}: seeds")
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
    metric = str(raw.get("metric", "val_loss"))
    if metric not in METRICS:
        raise ConfigError(f"{src}: metric", f"{metric!r} is not a number each run records; one of {', '.join(METRICS)}")
    eval_iters = raw.get("eval_iters")
    if eval_iters is not None and eval_iters != "all" and not (isinstance(eval_iters, int)
                                                               and not isinstance(eval_iters, bool) and eval_iters > 0):
        raise ConfigError(f"{src}: eval_iters", f"expected a positive integer or 'all', got {eval_iters!r}")
    grid = Grid(
        name=name, path=src, base=base, seeds=seed_list, baseline=str(baseline), variants=variants,
        compare_to=[str(c) for c in compare_to if str(c) != str(baseline)], metric=metric,
        dataset=dataset, eval_iters=eval_iters,
        runs_dir=_grid_dir(raw, "runs_dir", f"runs/ablations/{name}", src),
        report_dir=_grid_dir(raw, "report_dir", f"runs/ablations/{name}/report", src),
        keep_checkpoints=_grid_bool(raw, "keep_checkpoints", True, src), jobs=_grid_count(raw, "jobs", 1, src),
        threads=_grid_count(raw, "threads", 1, src), ranks=_grid_count(raw, "ranks", 1, src),
        description=str(raw.get("description") or "").strip(),
    )
    grid.data_order_axes = sorted({p for v in variants for p in v.overrides
                                   if any(p == d or p.startswith(d) for d in DATA_ORDER_PATHS)})
    configs = {v.name: run_config(grid, v, seed_list[0]) for v in variants}  # each valid (types, ranges, checks)
    for v in variants:
        _check_reads_dataset(grid, v, configs[v.name])
    _refuse_identical_variants(grid, configs)
    if raw.get("equal_flops_of") is not None:
        equalise_flops(grid, str(raw["equal_flops_of"]), f"{src}: equal_flops_of")
    return grid


def _refuse_identical_variants(grid: Grid, configs: dict) -> None:
    """Two variants whose varied settings differ only where their models never read them (an
    ASCender setting of a pattern without 'S', Connection's rank under the linear connection) train
    the same runs: the report would compare one model with itself and show seed noise as an effect.
    Refused in one line naming both variants and the settings."""
    from ascender_dist.config.architectures import is_unread

    paths = sorted({p for v in grid.variants for p in v.overrides})
    seen: dict = {}
    for v in grid.variants:
        cfg = configs[v.name]
        key = tuple((p, repr(_value_at(cfg, p))) for p in paths if not is_unread(cfg.model, p))
        if key in seen:
            other = seen[key]
            differ = [p for p in paths if _value_at(cfg, p) != _value_at(configs[other], p)]
            why = (f"they differ only in {', '.join(differ)}, which these models never read (a layer kind the "
                   "pattern lacks, or rank under the linear connection; a variant the axes do not apply to "
                   "belongs in standalone)" if differ else "they have the same settings")
            raise ConfigError(f"{grid.path}: variant {v.name}", f"trains the same runs as variant {other}: {why}")
        seen[key] = v.name


def _value_at(cfg, dotted: str):
    """The run config's value at ``dotted`` (``model.ascender.k``); None where the path is not one."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def _check_reads_dataset(grid: Grid, variant: Variant, cfg) -> None:
    """A variant that reads the grid's dataset must train at the sequence length its shards are written
    at (the loader refuses other shards) with a vocabulary that holds the tokenizer asked for (training
    refuses a smaller model.vocab_size): refused here, before the dataset is built or any run trains.
    A variant that names its own data is not checked against it."""
    if grid.dataset is None:
        return
    paths = dataset_paths(Path(grid.dataset["root"]))
    if cfg.data.manifest != paths["manifest"] or cfg.data.mixture:
        return
    where = f"{grid.path}: variant {variant.name}"
    settings = dataset_settings(grid.dataset)
    if cfg.model.seq_length != settings["seq_length"]:
        raise ConfigError(f"{where}: model.seq_length",
                          f"{cfg.model.seq_length}, but the grid's dataset is written at dataset.seq_length "
                          f"{settings['seq_length']}: set them equal, or give the variant data of its own")
    if cfg.data.tokenizer == paths["tokenizer"] and cfg.model.vocab_size and cfg.model.vocab_size < settings["vocab_size"]:
        raise ConfigError(f"{where}: model.vocab_size",
                          f"{cfg.model.vocab_size} is smaller than the grid dataset's tokenizer "
                          f"(dataset.vocab_size {settings['vocab_size']}): raise it or leave it unset")


def equalise_flops(grid: Grid, reference: str, where: str) -> None:
    """Give every variant the number of steps that makes its training FLOPs (analytic, 6N-style, from
    ``models/counting.py``) equal to ``reference``'s at the base number of steps; same batch, so a
    cheaper architecture reads more tokens. Labels the grid's budget accordingly."""
    from ascender_dist.models.counting import count_model
    from ascender_dist.tools.plan import DEFAULT_VOCAB_SIZE

    names = [v.name for v in grid.variants]
    if reference not in names:
        raise ConfigError(where, f"{reference!r} is not a variant; variants: {', '.join(names)}")
    vocab = int((grid.dataset or {}).get("vocab_size") or DEFAULT_VOCAB_SIZE)

    def flops_per_step(v: Variant) -> tuple[float, int]:
        cfg = run_config(grid, v, grid.seeds[0])
        counts = count_model(cfg.model, cfg.model.vocab_size or vocab, cfg.parallel.tensor_model_parallel_size)
        return counts.flops_per_token * cfg.train.global_batch_size * cfg.model.seq_length, cfg.train.train_steps

    ref_per_step, ref_steps = flops_per_step(grid.variant(reference))
    budget = ref_per_step * ref_steps
    for v in grid.variants:
        per_step, _ = flops_per_step(v)
        v.overrides = {**v.overrides, "train.train_steps": max(1, round(budget / per_step))}
        run_config(grid, v, grid.seeds[0])
    grid.derived = ("train.train_steps",)
    grid.budget = (f"equal training FLOPs ({budget:.3g}, those of {reference} at {ref_steps} steps; analytic "
                   "counts of models/counting.py): steps per variant " +
                   ", ".join(f"{v.name} {v.overrides['train.train_steps']}" for v in grid.variants))


def run_dir(grid: Grid, variant: Variant, seed: int) -> Path:
    return grid.runs_dir / _safe(variant.name) / f"seed{seed}"


def run_config_raw(grid: Grid, variant: Variant, seed: int) -> dict:
    from ascender_dist.config.loader import deep_merge

    raw = deep_merge(grid.base, dotted_to_tree(variant.overrides))
    out = run_dir(grid, variant, seed)
    return deep_merge(raw, {"name": f"{grid.name}-{_safe(variant.name)}-seed{seed}", "output_dir": str(out),
                            "train": {"seed": seed}, "checkpoint": {"dir": None, "auto_resume": True}})


def run_config(grid: Grid, variant: Variant, seed: int):
    """The validated run config of one run, with the checks its launch would make (``load_config``'s
    home shorthand, ablate's single pipeline stage), so that ``--dry-run`` finds what every run would."""
    from ascender_dist.config.checks import check_no_home_shorthand
    from ascender_dist.config.resolve import check_preset_takes_effect, config_from_dict

    try:
        raw = run_config_raw(grid, variant, seed)
        if "model.preset" in variant.overrides:
            check_preset_takes_effect(raw)
        cfg = config_from_dict(raw)
        check_no_home_shorthand(cfg)
        if cfg.parallel.pipeline_model_parallel_size > 1:
            raise ConfigError("parallel.pipeline_model_parallel_size", "must be 1: ablate collects per-sequence "
                                                                       "losses from the model's output")
        return cfg
    except ConfigError as exc:
        raise ConfigError(f"{grid.path}: variant {variant.name}: {exc.path}", exc.message) from None


# ============================================================================ dataset

DATASET_DEFAULTS = {"corpus_bytes": 3_000_000, "vocab_size": 2048, "seq_length": 128, "samples_per_shard": 256,
                    "val_fraction": 0.05}
DATASET_RECORD = "dataset.json"  # the settings a grid dataset was built with, beside its shards


def dataset_paths(root: Path) -> dict:
    """The run-config ``data`` paths of the grid dataset under ``root`` (as :func:`ensure_dataset` builds it)."""
    from data_pipeline.tokenizer import tokenizer_files

    return {"manifest": str(root / "shards" / "manifest.json"),
            "tokenizer": str(tokenizer_files(root / "tokenizer")["model"])}


def dataset_settings(spec: dict) -> dict:
    """The build settings of a grid's ``dataset`` section, defaults filled in, numbers as numbers."""
    return {key: type(default)(spec.get(key, default)) for key, default in DATASET_DEFAULTS.items()}


def check_dataset_matches(root: Path, wanted: dict) -> None:
    """A dataset already under ``root`` must have been built with the settings asked for now: grids
    share one root, and shards of another sequence length or vocabulary (or, when recorded, corpus
    size and split) would be reused silently. Datasets built before the record existed are checked on
    what their manifest states (sequence length, vocabulary size)."""
    import json

    record = root / DATASET_RECORD
    if record.is_file():
        built = json.loads(record.read_text())
    else:
        manifest = json.loads((root / "shards" / "manifest.json").read_text())
        built = {key: manifest[key] for key in ("seq_length", "vocab_size") if key in manifest}
    for key, value in built.items():
        if key in wanted and wanted[key] != value:
            raise AblationError(f"{root}: dataset built with {key} {value}, the grid asks for {wanted[key]}: point "
                                f"dataset.root elsewhere or remove {root}")


def ensure_dataset(spec: dict) -> dict:
    """Build (once) the default corpus -> sentencepiece tokenizer -> webdataset shards under
    ``spec['root']``, recording the settings; a dataset already there must match them. Under a lock
    in the root: grids sharing it that start together build it once (the others wait, then check it)."""
    from ascender_dist.locks import exclusive_lock

    root, settings = Path(spec["root"]), dataset_settings(spec)
    paths = dataset_paths(root)
    if not Path(paths["manifest"]).exists():  # only a build takes the lock (a built root may be read-only)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AblationError(f"{root}: cannot create the dataset directory ({exc.strerror or exc})") from None
        with exclusive_lock(root / ".build.lock", AblationError, "the dataset build lock"):
            _build_dataset_locked(root, settings)  # unless the grid that held the lock built it
    check_dataset_matches(root, settings)
    return paths


def _build_dataset_locked(root: Path, settings: dict) -> None:
    import json

    from data_pipeline.corpus import build_default_corpus
    from data_pipeline.shards import write_shards
    from data_pipeline.tokenizer import Tokenizer, tokenizer_files, train_tokenizer

    prefix, paths = root / "tokenizer", dataset_paths(root)
    manifest, model = Path(paths["manifest"]), Path(paths["tokenizer"])
    if not manifest.exists():
        log.info("building the dataset in %s", root)
        corpus = root / "corpus.jsonl"
        # a build cut short before the manifest: made again with these settings, the tokenizer too (one
        # kept from a cut-short build may have another vocabulary than the grid asks for now)
        for stale in (corpus, *tokenizer_files(prefix).values()):
            stale.unlink(missing_ok=True)
        build_default_corpus(corpus, max_bytes=settings["corpus_bytes"])
        train_tokenizer([corpus], prefix, vocab_size=settings["vocab_size"])
        write_shards([corpus], Tokenizer.load(model), root / "shards", seq_length=settings["seq_length"],
                     samples_per_shard=settings["samples_per_shard"], val_fraction=settings["val_fraction"])
        (root / DATASET_RECORD).write_text(json.dumps(settings, indent=1) + "\n")
