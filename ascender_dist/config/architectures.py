"""The architectures and layer kinds a config may name, as data, and the checks that go with them.

A *layer kind* (one letter) is a transformer layer variant: ``A`` megatron's own attention layer,
``S`` ASCender attention, ``C`` the Connection layer in place of attention. An *architecture* is
a default ``model.layer_pattern`` over those letters; its presets are in :mod:`.presets`. How a
letter becomes a megatron layer is :mod:`ascender_dist.models.registry`; what it costs in
parameters and FLOPs is :mod:`ascender_dist.models.counting`. Adding a layer type means one
entry in each of those tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from ascender_dist.config.errors import ConfigError

LAYER_KINDS = {"A": "softmax attention", "S": "ASCender attention", "C": "Connection layer"}


@dataclass(frozen=True)
class Architecture:
    name: str
    default_pattern: str
    required_letter: str  # the pattern must use this architecture's own layer at least once


ARCHITECTURES = {
    "gpt": Architecture("gpt", default_pattern="A", required_letter="A"),
    "ascender": Architecture("ascender", default_pattern="S", required_letter="S"),
    # attention and Connection layers alternate
    "connection": Architecture("connection", default_pattern="AC", required_letter="C"),
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ConfigError("model.architecture", f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def expand_layer_pattern(model) -> str:
    """The pattern of the model section ``model`` repeated to one letter per layer: 'AC' with 4
    layers -> 'ACAC'."""
    pattern = model.layer_pattern or get_architecture(model.architecture).default_pattern
    return (pattern * (model.num_layers // len(pattern) + 1))[: model.num_layers]


def check_layer_pattern(cfg) -> None:
    m = cfg.model
    arch = get_architecture(m.architecture)
    if m.layer_pattern is not None and not m.layer_pattern.strip():  # an unset shell variable in a --set
        raise ConfigError("model.layer_pattern", f"is empty; leave it out (or null) for the architecture's default "
                                                 f"{arch.default_pattern!r}")
    pattern = m.layer_pattern or arch.default_pattern
    unknown = sorted(set(pattern) - set(LAYER_KINDS))
    if not pattern or unknown:
        legend = ", ".join(f"{letter}={description}" for letter, description in LAYER_KINDS.items())
        raise ConfigError("model.layer_pattern", f"letters must be from {legend} (got {pattern!r})")
    if m.num_layers % len(pattern):
        raise ConfigError("model.layer_pattern",
                          f"length {len(pattern)} of {pattern!r} must divide model.num_layers={m.num_layers}")
    if arch.required_letter not in pattern:
        raise ConfigError("model.layer_pattern",
                          f"architecture {m.architecture!r} needs at least one {arch.required_letter!r} layer "
                          f"(got {pattern!r})")


BARE_SIZES = ("hidden_size", "num_attention_heads", "num_layers", "seq_length")  # what a preset would set


def schema_default(section, name: str):
    """The schema's default of field ``name`` of dataclass instance ``section``."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@contextlib.contextmanager
def _preset_hint(m):
    """A model without a preset gets the schema's bare defaults (hidden 64, 4 heads, 128 tokens), which
    the ASCender / Connection defaults do not fit: a refusal of a field the user never wrote says so."""
    try:
        yield
    except ConfigError as exc:
        if m.preset is not None or any(getattr(m, name) != schema_default(m, name) for name in BARE_SIZES):
            raise
        raise ConfigError(exc.path, f"{exc.message} (no model.preset is set: the model sizes are the schema's "
                                    "defaults; choose a preset, e.g. model.preset: debug, or set the sizes)") from None


def check_ascender_hparams(cfg) -> None:
    m = cfg.model
    if "S" not in expand_layer_pattern(cfg.model):
        return
    with _preset_hint(m):
        m.ascender.validate("model.ascender", m.hidden_size // m.num_attention_heads)
    if not m.ascender.causal:
        raise ConfigError("model.ascender.causal", "must be true: the model is a causal decoder (a bidirectional "
                          "ASCender would let every position read the tokens it must predict)")


def check_neighbour_count(cfg) -> None:
    """ASCender's k below seq_length: a row has at most seq_length - 1 other keys to choose from, and the
    neighbour indices are [b, np, s, k] (k = 10**6 loaded and ran out of memory at the first step). Checked
    on the configs a user writes (resolve.load_config), not on saved ones: a run saved with a larger k
    must still consolidate, export and resume (resume_check compares k as min(k, seq_length - 1))."""
    m = cfg.model
    if "S" in expand_layer_pattern(m) and m.ascender.k >= m.seq_length:
        raise ConfigError("model.ascender.k", f"must be < model.seq_length ({m.seq_length}): a row has at most "
                                              f"seq_length - 1 other keys to choose from (got {m.ascender.k}; "
                                              f"{m.seq_length - 1} selects the same neighbours)")


def unread_settings(m) -> dict[str, str]:
    """The model settings this model's layers never read, dotted (``model.ascender`` for a whole
    section), each with why: an architecture's section without its layer kind in the pattern,
    Connection's rank under the linear connection. A run varying only these trains one model."""
    pattern = expand_layer_pattern(m)
    unread = {}
    if "S" not in pattern:
        unread["model.ascender"] = f"no ASCender layer ('S') in the layer pattern {pattern}"
    if "C" not in pattern:
        unread["model.connection"] = f"no Connection layer ('C') in the layer pattern {pattern}"
    elif m.connection.connection == "linear":
        unread["model.connection.rank"] = "the linear connection has no rank"
    return unread


def is_unread(m, dotted: str) -> bool:
    """Whether the model setting ``dotted`` (``model.x.y``) is one of :func:`unread_settings`."""
    return any(dotted == path or dotted.startswith(path + ".") for path in unread_settings(m))


def _changed_unread(m) -> list[str]:
    """Lines for the unread sections (:func:`unread_settings`) given other values than the schema's
    (a field of a read section, such as rank under linear, may come from the preset: not logged)."""
    lines = []
    for path, why in unread_settings(m).items():
        section_name, _, field_name = path.removeprefix("model.").partition(".")
        if field_name:
            continue
        section = getattr(m, section_name)
        changed = [f"{path}.{f.name} = {getattr(section, f.name)!r}" for f in dataclasses.fields(section)
                   if getattr(section, f.name) != schema_default(section, f.name)]
        if changed:
            lines.append(f"{', '.join(changed)}: no effect, {why}")
    return lines


def unreached_warmups(cfg) -> list[str]:
    """One line per warm-up that this run never finishes (the learning rate's longer than the run; an
    ASCender start step >= train.train_steps while the feature is on), validation it never reaches
    (an eval_interval longer than the run), or a setting that does nothing here (min_lr under a constant
    schedule, rotary_base with learned positions, the settings of a layer kind the pattern lacks; often
    inherited from a base config): legal, e.g. a short smoke run
    of a long config, but then the run never trains what it names. The trainer logs them; an error
    would break such short runs."""
    m, steps = cfg.model, cfg.train.train_steps
    lines = []
    o = cfg.optimizer
    if o.warmup_steps > steps:
        lines.append(f"optimizer.warmup_steps = {o.warmup_steps} > train.train_steps = {steps}: the "
                     f"learning rate never reaches optimizer.lr = {o.lr:g} in this run")
    elif o.lr_schedule == "wsd" and steps <= max(o.warmup_steps, 1):
        lines.append(f"optimizer.lr_schedule = wsd: no step of train.train_steps = {steps} is left after the "
                     f"warmup to decay: the run ends at optimizer.lr = {o.lr:g}")
    elif o.lr_schedule == "wsd" and o.wsd_decay_steps > steps - max(o.warmup_steps, 1):
        lines.append(f"optimizer.wsd_decay_steps = {o.wsd_decay_steps} > the {steps - max(o.warmup_steps, 1)} "
                     f"steps after the warmup: the decay starts right after it, without a stable phase")
    if cfg.train.eval_interval > steps:
        lines.append(f"train.eval_interval = {cfg.train.eval_interval} > train.train_steps = {steps}: no periodic "
                     "validation in this run (no val/loss curve)")
    if o.lr_schedule == "constant" and o.min_lr != schema_default(o, "min_lr"):
        lines.append(f"optimizer.min_lr = {o.min_lr:g} has no effect: lr_schedule constant stays at optimizer.lr")
    if m.position_embedding_type != "rope" and m.rotary_base != schema_default(m, "rotary_base"):
        lines.append(f"model.rotary_base = {m.rotary_base} has no effect: the positions are "
                     f"{m.position_embedding_type}")
    lines += _changed_unread(m)
    if "S" not in expand_layer_pattern(m):
        return lines
    a = m.ascender
    starts = {"separation_start_step": (a.use_sep, a.separation_start_step, "Separation"),
              "aux_start_step": (a.aux_active(a.aux_start_step), a.aux_start_step, "the auxiliary losses")}
    return lines + [f"model.ascender.{name} = {start} >= train.train_steps = {steps}: {what} never turn on in "
                    f"this run" for name, (on, start, what) in starts.items() if on and start >= steps]


def check_connection_hparams(cfg) -> None:
    m = cfg.model
    if "C" not in expand_layer_pattern(cfg.model):
        return
    with _preset_hint(m):
        _check_connection_fits(cfg)
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", "not supported with Connection layers ('C' in the pattern)")


def _check_connection_fits(cfg) -> None:
    """The Connection hyper-parameters against the model's sizes."""
    m = cfg.model
    m.connection.validate("model.connection", m.hidden_size, cfg.parallel.tensor_model_parallel_size)
    if not m.connection.causal:
        raise ConfigError("model.connection.causal", "must be true: the model is a causal decoder")
    if m.connection.causal_chunk_size >= m.seq_length:  # one chunk: its prefix state is the bare slots
        raise ConfigError("model.connection.causal_chunk_size",
                          f"must be < model.seq_length ({m.seq_length}; got {m.connection.causal_chunk_size}): with "
                          "a single chunk no token ever reads a reasoned slot state")


# Pattern check, then every layer kind's checks: each validates its own hyperparameters whenever
# the pattern uses its letter (so a connection model with ASCender layers checks both)
def check_attention_dropout(cfg) -> None:
    """Attention dropout is applied by 'A' layers only (ASCender and Connection layers have none): a
    value with no 'A' layer in the pattern would be recorded and used by no layer."""
    m = cfg.model
    pattern = expand_layer_pattern(m)
    if not m.attention_dropout or "A" in pattern:
        return
    kinds = {("S",): "ASCender attention has", ("C",): "Connection layers have"}
    present = tuple(c for c in "SC" if c in pattern)
    raise ConfigError("model.attention_dropout", f"{kinds.get(present, 'ASCender and Connection layers have')} no "
                                                 "attention dropout (it applies to 'A' layers only, and the pattern "
                                                 "has none); set 0.0")


ARCHITECTURE_CHECKS = (check_layer_pattern, check_ascender_hparams, check_connection_hparams, check_attention_dropout)
