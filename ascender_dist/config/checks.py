"""Small named consistency checks. Each raises ConfigError naming the field it is about.

``STATIC_CHECKS`` need only the config; ``world_size`` checks need the launch's world size too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import string

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.schema import RunConfig


def check_positive_sizes(cfg: RunConfig) -> None:
    m, t = cfg.model, cfg.train
    for path, value in [
        ("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads), ("model.seq_length", m.seq_length),
        ("train.micro_batch_size", t.micro_batch_size), ("train.global_batch_size", t.global_batch_size),
        ("train.train_steps", t.train_steps), ("parallel.tensor_model_parallel_size", cfg.parallel.tensor_model_parallel_size),
        ("parallel.pipeline_model_parallel_size", cfg.parallel.pipeline_model_parallel_size),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ("logging.log_interval", cfg.logging.log_interval),
        ("parallel.distributed_timeout_minutes", cfg.parallel.distributed_timeout_minutes),
    ]:
        if value < 1:
            raise ConfigError(path, f"must be >= 1 (got {value})")


SEED_LIMIT = 2**63  # torch.manual_seed takes a signed 64-bit seed; megatron adds small offsets to it
TIMEOUT_LIMIT_MINUTES = 10**6  # ~2 years: datetime.timedelta (the process group's timeout) overflows far above
# megatron's RotaryEmbedding computes rotary_base ** (arange(0, dim, 2) / dim) with the Python int as a
# torch scalar: one beyond 64 bits is an OverflowError at model build. Below 2**63 every inv_freq stays
# finite and nonzero in float32 (the smallest is about base**-1 >= 1e-19, far above float32's 1e-38).
ROTARY_BASE_LIMIT = 2**63
# sizes and counts a library puts into a C int (tensor shapes, index types, megatron's layer loops, the
# loader's shuffle state, the schedule's float steps); layers far
# below that: print-config and the layer pattern spell out one character per layer
SIZE_LIMIT = 2**31
SIZE_FIELDS = ("model.hidden_size", "model.num_attention_heads", "model.num_query_groups", "model.ffn_hidden_size",
               "model.seq_length", "model.vocab_size", "model.make_vocab_size_divisible_by",
               "train.micro_batch_size", "train.global_batch_size", "train.train_steps", "train.eval_iters",
               "train.eval_interval", "optimizer.warmup_steps", "optimizer.wsd_decay_steps", "data.num_workers",
               "data.shuffle_buffer", "checkpoint.save_interval", "checkpoint.keep_last")
LAYER_LIMIT = 2**16
# the signals a scheduler, a container runtime or a user sends to ask a job to stop; others (SIGCHLD,
# SIGWINCH, SIGCONT, ...) arrive in normal operation and would stop the run at once
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")


HPARAM_SEEDS = frozenset({"slot_seed"})  # integer layer settings that are seeds, not sizes


def check_upper_bounds(cfg: RunConfig) -> None:
    """Integers that a library converts into a bounded type at startup (a traceback there)."""
    seed = cfg.train.seed
    if not 0 <= seed < SEED_LIMIT - 2**20:
        raise ConfigError("train.seed", f"must be in [0, 2**63 - 2**20) (got {seed})")
    minutes = cfg.parallel.distributed_timeout_minutes
    if minutes > TIMEOUT_LIMIT_MINUTES:
        raise ConfigError("parallel.distributed_timeout_minutes", f"must be <= {TIMEOUT_LIMIT_MINUTES} (got {minutes})")
    rotary_base = cfg.model.rotary_base
    if rotary_base >= ROTARY_BASE_LIMIT:
        raise ConfigError("model.rotary_base", f"must be < 2**63 (got {rotary_base})")
    if cfg.model.num_layers > LAYER_LIMIT:
        raise ConfigError("model.num_layers", f"must be <= 2**16 (got {cfg.model.num_layers})")
    for dotted in SIZE_FIELDS:
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and value >= SIZE_LIMIT:
            raise ConfigError(dotted, f"must be < 2**31 (got {value})")
    for section in ("ascender", "connection"):  # every integer of the layers' settings but a seed is a size or a step
        hparams = getattr(cfg.model, section)
        for f in dataclasses.fields(hparams):
            value = getattr(hparams, f.name)
            if f.name in HPARAM_SEEDS:  # range checked by the layer's own validation (a torch.Generator seed)
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= SIZE_LIMIT:
                raise ConfigError(f"model.{section}.{f.name}", f"must be < 2**31 (got {value})")


def check_run_name(cfg: RunConfig) -> None:
    """``name`` is one directory under the runs root (runs/<name>, its checkpoints beneath): an empty
    name, '.' or '..' would make the shared root (or its parent) the run's directory, and a separator
    would place it elsewhere; either way an auto-resuming run could pick up another run's checkpoint."""
    name = cfg.name
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if name in ("", ".", ".."):
        raise ConfigError("name", f"must name one directory under runs/ (got {name!r})")
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        raise ConfigError("name", f"must not contain control characters (got {name!r})")
    if any(sep in name for sep in separators):
        raise ConfigError("name", f"must not contain a path separator (got {name!r}); "
                                  "set output_dir to put the run elsewhere")


def check_optional_paths(cfg: RunConfig) -> None:
    """A path field whose default is null refuses "": an unset shell variable in ``--set
    checkpoint.init_from=$W`` trained from random weights, and ``output_dir=`` / ``checkpoint.dir=``
    fell back to the default folder, where an auto-resuming run may pick up another run's checkpoint."""
    for dotted, value in (("output_dir", cfg.output_dir), ("checkpoint.dir", cfg.checkpoint.dir),
                          ("checkpoint.init_from", cfg.checkpoint.init_from)):
        if value is not None and not value.strip():
            raise ConfigError(dotted, f"is empty ({value!r}): give a path, or null (or no key) for the default")


def check_no_home_shorthand(cfg: RunConfig) -> None:
    """A path starting with '~' is not expanded (no shell reads a YAML file or the text after
    ``--set key=``): output_dir=~/run made a directory named '~' in the working directory, which a
    later ``rm -rf ~`` to clean it up would confuse with the home directory. Checked on the configs
    a user writes (resolve.load_config), not in STATIC_CHECKS: the config.yaml an older run saved
    with such a path must still read (consolidate, evaluate, reshard)."""
    for dotted, value in _path_fields(cfg):
        if value and value.startswith("~"):
            raise ConfigError(dotted, f"{value!r} starts with '~', which is not expanded here: write the full path")


def _path_fields(cfg: RunConfig) -> list[tuple[str, str | None]]:
    """(dotted field, value) of every file or directory path of a run config."""
    paths = [("output_dir", cfg.output_dir), ("checkpoint.dir", cfg.checkpoint.dir),
             ("checkpoint.init_from", cfg.checkpoint.init_from), ("data.manifest", cfg.data.manifest),
             ("data.tokenizer", cfg.data.tokenizer)]
    return paths + [(f"data.mixture[{i}].manifest", m.manifest) for i, m in enumerate(cfg.data.mixture)]


NAME_MAX_BYTES = 255  # the longest file or directory name Linux file systems take (ext4, xfs, NFS)


def check_path_part_lengths(cfg: RunConfig) -> None:
    """No part of a path (nor ``name``, a directory) longer than a file system allows: the run would
    otherwise stop at its first file operation with an OSError traceback (Python's Path.exists raises
    'File name too long' instead of answering False)."""
    for dotted, value in [("name", cfg.name), *_path_fields(cfg)]:
        for part in (value or "").split("/"):
            if len(os.fsencode(part)) > NAME_MAX_BYTES:
                raise ConfigError(dotted, f"has a file or directory name of {len(os.fsencode(part))} bytes, over "
                                          f"the {NAME_MAX_BYTES} a file system allows ({part[:40]!r}...)")


def _require_finite(path: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number (got {value})")


def check_model_numbers(cfg: RunConfig) -> None:
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < 0:
        raise ConfigError("model.vocab_size", f"must be >= 1, or null/0 to take it from the tokenizer (got {m.vocab_size})")
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        raise ConfigError("model.ffn_hidden_size", f"must be >= 1, or null for 4 x hidden_size (got {m.ffn_hidden_size})")
    if m.rotary_base < 1:
        raise ConfigError("model.rotary_base", f"must be >= 1 (got {m.rotary_base})")
    for name in ("init_method_std", "layernorm_epsilon"):
        value = getattr(m, name)
        _require_finite(f"model.{name}", value)
        if value <= 0:
            raise ConfigError(f"model.{name}", f"must be > 0 (got {value})")


def check_intervals(cfg: RunConfig) -> None:
    """0 turns periodic validation / saving off; how much to validate and keep must be positive."""
    t, c = cfg.train, cfg.checkpoint
    for path, value in (("train.eval_interval", t.eval_interval), ("checkpoint.save_interval", c.save_interval)):
        if value < 0:
            raise ConfigError(path, f"must be >= 0 (0: off) (got {value})")
    if t.eval_iters < 1:
        raise ConfigError("train.eval_iters",
                          f"must be >= 1 (got {t.eval_iters}); to turn validation off set train.eval_interval: 0")
    if c.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", f"must be >= 1 (got {c.keep_last})")
    peak = cfg.logging.peak_tflops_per_device
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise ConfigError("logging.peak_tflops_per_device", f"must be > 0, or null to look it up (got {peak})")


def check_heads_divide_hidden(cfg: RunConfig) -> None:
    m = cfg.model
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError("model.num_attention_heads",
                          f"must divide hidden_size (got {m.num_attention_heads} heads, hidden {m.hidden_size})")
    head_dim = m.hidden_size // m.num_attention_heads
    if m.position_embedding_type == "rope" and head_dim % 2:
        raise ConfigError("model.num_attention_heads",
                          f"hidden_size / num_attention_heads must be even for rope (got {m.hidden_size} / "
                          f"{m.num_attention_heads} = {head_dim}): rotary embeddings rotate pairs of channels")
    groups = m.num_query_groups
    if groups is not None and (groups < 1 or m.num_attention_heads % groups):
        raise ConfigError("model.num_query_groups",
                          f"must divide num_attention_heads (got {groups} for {m.num_attention_heads} heads)")


def check_tensor_parallel_divides_heads(cfg: RunConfig) -> None:
    tp = cfg.parallel.tensor_model_parallel_size
    m = cfg.model
    if m.num_attention_heads % tp:
        raise ConfigError("parallel.tensor_model_parallel_size",
                          f"{tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    groups = m.num_query_groups or m.num_attention_heads
    if groups % tp:
        raise ConfigError("parallel.tensor_model_parallel_size",
                          f"{tp} does not divide model.num_query_groups={groups}")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        raise ConfigError("parallel.tensor_model_parallel_size", f"{tp} does not divide model.ffn_hidden_size={ffn}")


def check_pipeline_divides_layers(cfg: RunConfig) -> None:
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.model.num_layers % pp:
        raise ConfigError("parallel.pipeline_model_parallel_size",
                          f"{pp} does not divide model.num_layers={cfg.model.num_layers}")


def check_zero_stage(cfg: RunConfig) -> None:
    stage = cfg.parallel.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", f"must be 0, 1, 2 or 3 (got {stage})")
    if stage >= 2 and cfg.parallel.pipeline_model_parallel_size > 1:
        raise ConfigError("parallel.zero_stage",
                          f"ZeRO-{stage} cannot shard gradients across pipeline stages (DeepSpeed refuses it); "
                          "use zero_stage 0 or 1 with pipeline_model_parallel_size > 1")
    if stage == 0 and cfg.train.precision == "bf16":
        raise ConfigError("parallel.zero_stage",
                          "0 with train.precision bf16: DeepSpeed's ZeRO-0 has no fp32 gradient accumulation "
                          "for bf16 (it would train on bf16 weights and sums); use zero_stage 1")


def check_grad_reduce_dtype(cfg: RunConfig) -> None:
    if cfg.train.grad_reduce_dtype == "bf16" and cfg.train.precision != "bf16":
        raise ConfigError("train.grad_reduce_dtype",
                          "bf16 needs train.precision bf16 (an fp32 run reduces its fp32 gradients in fp32)")


def check_sequence_parallel(cfg: RunConfig) -> None:
    tp = cfg.parallel.tensor_model_parallel_size
    if cfg.parallel.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel", "needs tensor_model_parallel_size > 1")
    if cfg.parallel.sequence_parallel and cfg.model.seq_length % tp:
        raise ConfigError("parallel.sequence_parallel",
                          f"needs model.seq_length ({cfg.model.seq_length}) divisible by "
                          f"tensor_model_parallel_size ({tp}): each TP rank holds an equal slice of the sequence")


def check_batch_divisibility(cfg: RunConfig) -> None:
    t = cfg.train
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("train.global_batch_size",
                          f"{t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}")


def check_optimizer(cfg: RunConfig) -> None:
    o = cfg.optimizer
    for name in ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "beta1", "beta2"):
        _require_finite(f"optimizer.{name}", getattr(o, name))
    if o.lr <= 0:
        raise ConfigError("optimizer.lr", f"must be > 0 (got {o.lr})")
    for name, meaning in (("weight_decay", ""), ("grad_clip", " (0: no clipping)")):
        if getattr(o, name) < 0:
            raise ConfigError(f"optimizer.{name}", f"must be >= 0{meaning} (got {getattr(o, name)})")
    if o.eps <= 0:  # AdamW divides by sqrt(v) + eps: a parameter with an exactly zero gradient becomes 0/0
        raise ConfigError("optimizer.eps", f"must be > 0 (got {o.eps})")
    if o.lr_schedule == "constant":  # no floor: min_lr is where the other schedules decay to
        if o.min_lr < 0:
            raise ConfigError("optimizer.min_lr", f"must be >= 0 (got {o.min_lr})")
    elif not 0 <= o.min_lr <= o.lr:
        raise ConfigError("optimizer.min_lr", f"must be in [0, optimizer.lr={o.lr}] (got {o.min_lr})")
    if o.warmup_steps < 0:  # one longer than the run is legal (a short run of a long config): logged
        raise ConfigError("optimizer.warmup_steps", f"must be >= 0 (0: no warmup) (got {o.warmup_steps})")
    if o.lr_schedule == "wsd" and o.wsd_decay_steps < 1:  # one longer than the run is legal: logged
        raise ConfigError("optimizer.wsd_decay_steps", f"must be >= 1 with lr_schedule: wsd (got {o.wsd_decay_steps})")
    for name, unset in (("wsd_decay_steps", 0), ("wsd_decay_shape", "linear")):
        if o.lr_schedule != "wsd" and getattr(o, name) != unset:  # it would be accepted and do nothing
            raise ConfigError(f"optimizer.{name}", f"applies to lr_schedule: wsd only (the schedule is "
                                                   f"{o.lr_schedule}; got {getattr(o, name)})")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optimizer.{name}", f"must be in [0, 1) (got {getattr(o, name)})")


def check_dropout(cfg: RunConfig) -> None:
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(cfg.model, name)
        if not 0 <= value < 1:
            raise ConfigError(f"model.{name}", f"must be in [0, 1) (got {value})")


def check_world_size_layout(cfg: RunConfig, world_size: int) -> None:
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        path = ("parallel" if tp > 1 and pp > 1 else
                "parallel.tensor_model_parallel_size" if tp > 1 else "parallel.pipeline_model_parallel_size")
        raise ConfigError(path, f"world size {world_size} is not a multiple of tensor x pipeline = {tp} x {pp}")
    model_parallel = tp * pp
    dp = world_size // model_parallel
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError("train.global_batch_size",
                          f"{t.global_batch_size} is not a multiple of micro_batch_size x data-parallel size "
                          f"= {t.micro_batch_size} x {dp}")


def check_bad_step_policy(cfg: RunConfig) -> None:
    t = cfg.train
    _require_finite("train.loss_spike_factor", t.loss_spike_factor)
    if t.loss_spike_factor != 0 and t.loss_spike_factor <= 1:
        raise ConfigError("train.loss_spike_factor", f"must be 0 (off) or > 1 (got {t.loss_spike_factor})")
    if t.max_consecutive_bad_steps < 0:
        raise ConfigError("train.max_consecutive_bad_steps", f"must be >= 0 (got {t.max_consecutive_bad_steps})")
    if t.max_rollbacks < 0:
        raise ConfigError("train.max_rollbacks", f"must be >= 0 (got {t.max_rollbacks})")


def check_data_sources(cfg: RunConfig) -> None:
    d = cfg.data
    if d.mixture and d.manifest:
        raise ConfigError("data.mixture", "set either data.manifest or data.mixture, not both")
    for i, source in enumerate(d.mixture):
        if not source.manifest:
            raise ConfigError(f"data.mixture[{i}].manifest", "must name a manifest.json")
        _require_finite(f"data.mixture[{i}].weight", source.weight)
        if not source.weight > 0:
            raise ConfigError(f"data.mixture[{i}].weight", f"must be > 0 (got {source.weight})")
        if source.url_template is not None and url_template_problem(source.url_template):
            raise ConfigError(f"data.mixture[{i}].url_template", url_template_problem(source.url_template))
    if d.num_workers < 0:
        raise ConfigError("data.num_workers", f"must be >= 0 (got {d.num_workers})")
    if d.shuffle_buffer < 1:
        raise ConfigError("data.shuffle_buffer", f"must be >= 1 (got {d.shuffle_buffer})")
    if d.url_template is not None:
        problem = url_template_problem(d.url_template)
        if problem:
            raise ConfigError("data.url_template", problem)


def check_exit_settings(cfg: RunConfig) -> None:
    """A time budget and a stall timeout that are numbers >= 0; signals Python can catch, by name."""
    import signal

    t = cfg.train
    _require_finite("train.exit_duration_minutes", t.exit_duration_minutes)
    if t.exit_duration_minutes < 0:
        raise ConfigError("train.exit_duration_minutes", f"must be >= 0 (0: off) (got {t.exit_duration_minutes})")
    _require_finite("train.stall_timeout_minutes", t.stall_timeout_minutes)
    if t.stall_timeout_minutes < 0:
        raise ConfigError("train.stall_timeout_minutes", f"must be >= 0 (0: off) (got {t.stall_timeout_minutes})")
    for name in t.exit_signals:
        if name not in EXIT_SIGNALS or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ConfigError("train.exit_signals", f"{name!r} is not a stop signal; use some of "
                                                    f"{', '.join(EXIT_SIGNALS)}")


def check_wandb(cfg: RunConfig) -> None:
    w = cfg.logging.wandb
    if w.entity and not w.project:
        raise ConfigError("logging.wandb.project", f"must be set when logging.wandb.entity is ({w.entity!r})")
    if w.mode == "offline" and not w.project:  # no project: no Weights & Biases logging at all
        raise ConfigError("logging.wandb.project", "must be set when logging.wandb.mode is 'offline' (without a "
                                                   "project nothing is logged to Weights & Biases)")


STATIC_CHECKS = [
    check_run_name,
    check_optional_paths,
    check_path_part_lengths,
    check_positive_sizes,
    check_upper_bounds,
    check_model_numbers,
    check_intervals,
    check_heads_divide_hidden,
    check_tensor_parallel_divides_heads,
    check_pipeline_divides_layers,
    check_zero_stage,
    check_grad_reduce_dtype,
    check_sequence_parallel,
    check_batch_divisibility,
    check_optimizer,
    check_dropout,
    check_data_sources,
    check_bad_step_policy,
    check_exit_settings,
    check_wandb,
]


def url_template_problem(template: str) -> str | None:
    """What is wrong with a shard URL template (a ``str.format`` template whose only field is
    ``{name}``, the shard file name), or None. Shared by the config checks and the data loader."""
    try:
        parts = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"{e} in {template!r} (write literal braces as {{{{ }}}})"
    fields = [f for f, _, _ in parts]
    if "name" not in fields or any(f != "name" for f in fields):
        return f"must contain {{name}} (the shard file name) and no other field (got {template!r})"
    if any(spec or conv for _, spec, conv in parts):  # {name:d} fails, {name!r} quotes, {name:;<60} pads
        return f"{{name}} takes no format spec or conversion (got {template!r})"
    return None
