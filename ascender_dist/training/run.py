"""Everything a run needs before its first step, built in order by :func:`build_run`.

Order (each a separate step): process group, tokenizer and derived sizes, megatron model-parallel
groups and seeds (:mod:`ascender_dist.parallel.setup`), data loaders (sharded by data-parallel
rank), checkpoint folder and the tag to resume from, engine (:mod:`ascender_dist.training.engine`),
callbacks (:mod:`ascender_dist.training.callbacks`). The :class:`~.trainer.Trainer` runs the loop
over a :class:`Run`; tools that need the engine without the loop can use the Run alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from ascender_dist.config.loader import dump_yaml, to_dict
from ascender_dist.config.resolve import Derived, derive
from ascender_dist.config.schema import RunConfig
from ascender_dist.models.ascender.common import set_aux_loss_scale
from ascender_dist.models.counting import count_model
from ascender_dist.parallel.setup import (ParallelState, init_model_parallel, init_process_group, local_world_size,
                                         usable_cpus)
from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.callbacks import Callback, default_callbacks
from ascender_dist.training.engine import build_engine
from ascender_dist.training.guard import LossGuard, on_every_rank
from ascender_dist.training.metrics import MetricLogger, peak_tflops_per_device, prepare_log_dir
from ascender_dist.training.preemption import stop_callbacks
from ascender_dist.training.watchdog import watchdog_callbacks
from ascender_dist.training.weights import pad_vocab, read_weights_file

log = logging.getLogger("ascender_dist")


def load_tokenizer(cfg: RunConfig):
    """The run's sentencepiece tokenizer, or None when the config names none (sizes from model.vocab_size)."""
    from data_pipeline.tokenizer import Tokenizer

    return Tokenizer.load(Path(cfg.data.tokenizer)) if cfg.data.tokenizer else None


def loader_source(cfg: RunConfig) -> tuple:
    """(what StreamingLoader reads, its url_template) for the run's ``data`` section: the manifest,
    or the mixture's (manifest, weight) pairs with a url_template per dataset. Every reader of a
    run's data takes it from here (the tools too), so a mixture run reads as it trained."""
    d = cfg.data
    if d.mixture:
        return [(m.manifest, m.weight) for m in d.mixture], [m.url_template or d.url_template for m in d.mixture]
    return d.manifest, d.url_template


def build_loader(cfg: RunConfig, tokenizer, pstate: ParallelState, split: str = "train"):
    """Sharded by DATA-parallel rank: tensor/pipeline peers of one replica read identical batches.

    Collective when ``pstate`` is the job's (world_size > 1, torch.distributed initialized): every
    rank calls it, and the ranks pool what the set-up shard checks found (all_gather_object over the
    default group), so every rank drops the same shards, or raises the same error, and shards,
    counts and orders agree. A stand-in ``pstate`` without a world_size (one process reading alone,
    such as the ablation's rank-0 document lookup) builds alone."""
    from data_pipeline.loader import StreamingLoader

    def all_gather(obj) -> list:
        """Every rank's ``obj``, in rank order."""
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    together = getattr(pstate, "world_size", 1) > 1 and dist.is_initialized() and dist.get_world_size() > 1
    d = cfg.data
    source, url_template = loader_source(cfg)
    return StreamingLoader(
        source,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=pstate.dp_rank,
        dp_size=pstate.dp_size,
        seed=cfg.train.seed,
        split=split,
        num_workers=d.num_workers,
        shuffle_buffer=d.shuffle_buffer,
        url_template=url_template,
        tokenizer_sha256=tokenizer.sha256 if tokenizer else None,
        vocab_size=tokenizer.vocab_size if tokenizer else cfg.model.vocab_size,
        on_corrupt=d.on_corrupt,
        partial_reads=False if d.verify_shard_sha256 else None,  # None: partial reads when dp_size > 1
        all_gather=all_gather if together else None,
        peers_share_rows=together and pstate.world_size > pstate.dp_size,  # tensor / pipeline peers
    )


def require_validation_batches(cfg: RunConfig, val_loader) -> None:
    """Raise a DataError if ``val_loader`` yields no batch (the same length on every rank, so every
    rank raises): its split has fewer samples than one micro-batch per data-parallel rank."""
    if len(val_loader) == 0:
        from data_pipeline.errors import DataError

        raise DataError(cfg.data.manifest or "data.mixture",
                        "the validation split has fewer samples than one micro-batch per data-parallel rank")


def validation_batches_per_rank(asked: int, dp_size: int, available: int) -> int:
    """Micro-batches each data-parallel rank validates for ``asked`` (``train.eval_iters``) in all.

    The validation loader deals the split's micro-batches to the ranks in turn, so the first
    ``ceil(asked / dp_size)`` of every rank are the split's first ``asked`` (rounded up to a multiple
    of ``dp_size``): one validation set for any DP size, as the parity of layouts needs. Clipped to
    the ``available`` batches per rank (a short split is used whole)."""
    return min(-(-asked // dp_size), available)


def log_validation_size(cfg: RunConfig, batches: int, dp_size: int, logging_rank: bool) -> None:
    """Say once, at build, how many sequences every validation scores (eval_iters micro-batches of
    micro_batch_size: a smaller micro-batch for memory is a smaller validation set, and another
    curve), and when ``train.eval_iters`` does not divide over the data-parallel ranks (rounded up)
    or asks for more micro-batches than the validation split gives (``batches`` per rank): every
    validation then uses the micro-batches validation_batches_per_rank gives."""
    asked = cfg.train.eval_iters
    used = validation_batches_per_rank(asked, dp_size, batches) * dp_size
    if not logging_rank:
        return
    log.info("validation: %d sequences per evaluation (%d micro-batches x train.micro_batch_size %d)",
             used * cfg.train.micro_batch_size, used, cfg.train.micro_batch_size)
    if used == asked:
        return
    if asked > batches * dp_size:
        log.warning("train.eval_iters: %d validation micro-batches asked, the validation split gives %d (%d per "
                    "data-parallel rank); each validation uses those %d", asked, batches * dp_size, batches, used)
    else:
        log.warning("train.eval_iters: %d validation micro-batches do not divide over %d data-parallel ranks; "
                    "each validation uses %d (%d per rank)", asked, dp_size, used, used // dp_size)


def log_loader_workers_above_cpus(cfg: RunConfig, cpus: int, local_ranks: int, logging_rank: bool) -> None:
    """Say when the loader processes of this node's ranks (``data.num_workers`` per rank, each
    reading and decoding shards) outnumber the CPUs the job may use here: they would only contend
    (a typo such as 200 for 2 starts 200 processes per rank). Not refused: the config may be checked
    elsewhere."""
    if logging_rank and cfg.data.num_workers * local_ranks > cpus:
        log.warning("data.num_workers: %d loader processes per rank x %d ranks on this node, over its %d "
                    "usable CPUs; they will contend for them", cfg.data.num_workers, local_ranks, cpus)


def aux_loss_gradient_scale(gradient_accumulation_steps: int, tensor_parallel: int) -> float:
    """Gradient of ASCender's auxiliary losses relative to a task loss of 1: DeepSpeed divides the
    task loss of every micro-batch by the accumulation steps, and each tensor-parallel rank's aux
    loss is a mean over its own heads only, so summed over TP ranks it would count tp times
    (tests/distributed/test_model_parity.py compares TP=2 with one process)."""
    return 1.0 / (gradient_accumulation_steps * tensor_parallel)


@dataclass
class Run:
    """A run ready to train: what :func:`build_run` made, in the order it made it."""

    cfg: RunConfig
    tokenizer: Any
    derived: Derived
    pstate: ParallelState
    loader: Any
    val_loader: Any  # None without train.eval_interval
    guard: LossGuard
    resume_tag: Optional[str]  # the tag to resume from (a universal copy after a data-parallel change)
    engine: Any
    metrics: MetricLogger
    callbacks: list[Callback] = field(default_factory=list)


def _check_saved_layout(tag_dir: Path, meta: dict, pstate: ParallelState, zero_stage: int,
                        precision: Optional[str]) -> None:
    """ConfigError naming the parallel setting that differs from the one ``tag_dir`` was saved with
    and cannot be bridged on load (the data-parallel size can: resume_tag_for_layout)."""
    from ascender_dist.config.errors import ConfigError

    saved = (meta.get("tensor_model_parallel_size", pstate.tp_size), meta.get("pipeline_model_parallel_size", pstate.pp_size))
    if saved != (pstate.tp_size, pstate.pp_size):
        size = "tensor_model_parallel_size" if saved[0] != pstate.tp_size else "pipeline_model_parallel_size"
        field = f"parallel.{size}"
        raise ConfigError(field, f"{tag_dir} was saved at tp x pp = {saved[0]} x {saved[1]}; resuming "
                          f"at {pstate.tp_size} x {pstate.pp_size} needs `ascender-dist consolidate` then `reshard`")
    saved_stage = meta.get("zero_stage", zero_stage)
    if saved_stage != zero_stage:  # DeepSpeed's optimizer state differs by stage
        raise ConfigError("parallel.zero_stage", f"{tag_dir} was saved with ZeRO stage {saved_stage}, this run uses "
                          f"{zero_stage}: resume with parallel.zero_stage: {saved_stage}, or start from its "
                          f"weights (`ascender-dist consolidate`, then checkpoint.init_from)")
    saved_precision = meta.get("precision", precision)
    # DeepSpeed's bf16 and fp32 optimizers write different state files
    if precision is not None and saved_precision != precision:
        raise ConfigError("train.precision", f"{tag_dir} was saved with {saved_precision}, this run uses {precision}: "
                          f"resume with train.precision: {saved_precision}, or start from its weights "
                          f"(`ascender-dist consolidate`, then checkpoint.init_from)")


def resume_tag_for_layout(directory: Path, pstate: ParallelState, zero_stage: int, tag: Optional[str] = None,
                          precision: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> str:
    """``tag`` (default: the latest), or its universal copy when the data-parallel size changed since
    it was saved; the tensor and pipeline sizes, the ZeRO stage and the precision (when given) must
    match (_check_saved_layout). ``progress``: told as a universal conversion advances (ensure_universal).
    Collective: every rank calls it (a rollback target goes through it too)."""
    tag = tag or ckpt.agreed_latest_tag(directory)

    def checked_meta() -> dict:
        meta = ckpt.read_meta(directory, tag)
        _check_saved_layout(directory / tag, meta, pstate, zero_stage, precision)
        return meta

    # every rank reads it (its own view of shared storage): a rank that cannot, or finds another layout,
    # must not leave the others waiting in the next collective (a rollback's tag comes from rank 0's listing)
    meta = on_every_rank(checked_meta)
    saved_dp = meta.get("data_parallel_size", pstate.dp_size)
    if saved_dp == pstate.dp_size or zero_stage == 0:  # ZeRO-0: every rank holds the whole optimizer state
        return tag
    from ascender_dist.config.errors import ConfigError

    start_over = (f"resume at data-parallel size {saved_dp}, or start from its weights (`ascender-dist "
                  f"consolidate`, then checkpoint.init_from)")
    if zero_stage == 3:
        raise ConfigError("parallel", f"{directory / tag} was saved at data-parallel size {saved_dp} with ZeRO-3; "
                          f"resuming at {pstate.dp_size} is not supported (DeepSpeed's ZeRO-3 universal load "
                          f"does not restore the optimizer exactly): {start_over}")
    if pstate.pp_size > 1:
        # the first and last stages each hold the tied embedding module under one name; DeepSpeed's
        # universal conversion keeps one stage's copy for both (a learned position table only the
        # first stage trains would come back untrained), and no test has run this path
        raise ConfigError("parallel", f"{directory / tag} was saved at data-parallel size {saved_dp} with pipeline "
                          f"parallelism; resuming at {pstate.dp_size} is not supported (DeepSpeed's universal "
                          f"conversion merges the stages' copies of the tied embeddings): {start_over}")
    if pstate.is_logging_rank:
        log.info("data-parallel size changed %d -> %d: reading %s through a universal checkpoint",
                 saved_dp, pstate.dp_size, tag)
    return ckpt.ensure_universal(directory, tag, progress)


def _refuse_fresh_start_over_checkpoints(cfg: RunConfig, directory: Path) -> None:
    """A run that does not resume must not write into a folder holding another run's checkpoints:
    `latest` would move back to the new run's steps, pruning would keep the old run's newer tags
    and delete the new run's own, and later saves would overwrite the old run's."""
    tags = [] if cfg.checkpoint.auto_resume else ckpt.from_rank0(lambda: ckpt.held_tags(directory))
    if tags:
        from ascender_dist.config.errors import ConfigError

        raise ConfigError("checkpoint.auto_resume", f"false, but {directory} holds checkpoints (newest {tags[-1]}): "
                          "use another checkpoint.dir, remove them, or resume (auto_resume: true)")


def check_same_config(cfg: RunConfig) -> None:
    """Collective: every rank loaded the same configuration. Each rank reads the YAML file (and its
    --set overrides) itself: a file edited while a multi-node job starts, or overrides that differ
    between nodes' launch lines, would give ranks different models or batch sizes (hangs, or
    silently wrong training)."""
    import hashlib

    from ascender_dist.config.errors import ConfigError

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    digest = hashlib.sha256(dump_yaml(to_dict(cfg)).encode()).hexdigest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError("config", f"ranks {differ} loaded another configuration than rank 0 (sha256 "
                                    f"{digests[differ[0]][:12]} vs {digests[0][:12]}): the file changed while the job "
                                    "started, or the --set overrides differ between nodes")


def build_run(cfg: RunConfig, init_state: Optional[dict] = None,
              callbacks: Sequence[Callback] = ()) -> Run:
    """Set up a run (collective: every rank calls it). ``init_state``: canonical full weights to
    start from (else ``checkpoint.init_from``, else random init); ignored when a checkpoint to resume
    from exists. ``callbacks`` run after the default ones (stall watchdog, layer statistics, throughput,
    logging, stop requests)."""
    init_process_group(cfg.parallel.distributed_timeout_minutes)
    check_same_config(cfg)
    tokenizer = on_every_rank(lambda: load_tokenizer(cfg))  # one node's missing file stops every rank
    derived = derive(cfg, dist.get_world_size(), tokenizer.vocab_size if tokenizer else None)
    p = cfg.parallel
    set_aux_loss_scale(aux_loss_gradient_scale(derived.gradient_accumulation_steps, p.tensor_model_parallel_size))
    pstate = init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, cfg.train.seed,
                                 p.distributed_timeout_minutes)
    loader = build_loader(cfg, tokenizer, pstate)
    val_loader = build_loader(cfg, tokenizer, pstate, split="val") if cfg.train.eval_interval else None
    if val_loader is not None:  # now, not at the first validation, eval_interval steps of training later
        require_validation_batches(cfg, val_loader)
        log_validation_size(cfg, len(val_loader), pstate.dp_size, pstate.is_logging_rank)
    log_loader_workers_above_cpus(cfg, usable_cpus(), local_world_size(), pstate.is_logging_rank)
    # every rank creates the directories; one node's failure (a read-only mount) stops all of them
    on_every_rank(lambda: ckpt.prepare_checkpoint_dir(derived.checkpoint_dir))
    ckpt.check_shared_dir(derived.checkpoint_dir)
    if cfg.logging.tensorboard:
        on_every_rank(lambda: prepare_log_dir(derived.tensorboard_dir))
    _refuse_fresh_start_over_checkpoints(cfg, derived.checkpoint_dir)
    resuming = cfg.checkpoint.auto_resume and ckpt.agreed_latest_tag(derived.checkpoint_dir) is not None
    if init_state is None and cfg.checkpoint.init_from and not resuming:
        init_state = read_weights_file(cfg.checkpoint.init_from)
    if init_state is not None:
        source = f"checkpoint.init_from ({cfg.checkpoint.init_from})" if cfg.checkpoint.init_from else "init_state"
        init_state = pad_vocab(init_state, derived.vocab_size, derived.padded_vocab_size, source)
    guard = LossGuard(spike_factor=cfg.train.loss_spike_factor, initial_loss=math.log(derived.vocab_size))
    resume_tag = resume_tag_for_layout(derived.checkpoint_dir, pstate, p.zero_stage,
                                       precision=cfg.train.precision) if resuming else None
    universal = resume_tag is not None and resume_tag.endswith(ckpt.UNIVERSAL)
    engine = build_engine(cfg, derived, init_state, guard, load_universal=universal)
    vocab = cfg.model.vocab_size or (tokenizer.vocab_size if tokenizer else derived.padded_vocab_size)
    # the sinks start on the logging rank only: a W&B failure there is raised on every rank
    metrics = on_every_rank(lambda: MetricLogger(derived.tensorboard_dir if cfg.logging.tensorboard else None,
                                                 enabled=pstate.is_logging_rank, wandb=cfg.logging.wandb,
                                                 run_dir=derived.output_dir, run_name=cfg.name,
                                                 run_config=to_dict(cfg)))
    flops_per_token = count_model(cfg.model, vocab, cfg.parallel.tensor_model_parallel_size).flops_per_token
    defaults = watchdog_callbacks(cfg) + default_callbacks(
        cfg, pstate.world_size, metrics, flops_per_token,
        peak_tflops_per_device(cfg.logging.peak_tflops_per_device)) + stop_callbacks(cfg)
    return Run(cfg=cfg, tokenizer=tokenizer, derived=derived, pstate=pstate, loader=loader, val_loader=val_loader,
               guard=guard, resume_tag=resume_tag, engine=engine, metrics=metrics,
               callbacks=defaults + list(callbacks))
