"""The typed configuration tree of a training run.

Every field has a type and a default; YAML files in ``configs/`` only state what differs.
``model.preset`` pulls a size from the registry in :mod:`ascender_dist.config.presets`; fields given
next to it override the preset. Values that follow from others (data-parallel size, gradient
accumulation, padded vocabulary) are computed once in :mod:`ascender_dist.config.resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ascender_dist.config.ascender_hparams import AscenderHParams
from ascender_dist.config.connection_hparams import ConnectionHParams

Architecture = Literal["gpt", "ascender", "connection"]


@dataclass
class ModelConfig:
    architecture: Architecture = "gpt"
    preset: Optional[str] = None
    # One letter per layer kind (A attention, S ASCender, C Connection), repeated to num_layers;
    # None: the architecture's default (gpt "A", ascender "S", connection "AC").
    layer_pattern: Optional[str] = None
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: one KV head per query head (MHA)
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    seq_length: int = 128
    # None: taken from the tokenizer and padded so that every TP size of the run divides it
    vocab_size: Optional[int] = None  # 0 acts like None
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    rotary_base: int = 10000
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    # architecture-specific hyperparameters (read only by that architecture)
    ascender: AscenderHParams = field(default_factory=AscenderHParams)
    connection: ConnectionHParams = field(default_factory=ConnectionHParams)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 1
    activation_checkpointing: bool = False
    # a collective that waits longer ends the job, naming the collective and the missing rank
    distributed_timeout_minutes: int = 10


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 10  # step s <= warmup_steps runs at lr * s / warmup_steps; 0: step 1 runs at lr
    # after warmup: cosine / linear decay to min_lr at train.train_steps, constant lr, or wsd
    # (warmup-stable-decay): lr until the last wsd_decay_steps steps, which decay to min_lr
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    wsd_decay_steps: int = 0  # wsd only (>= 1): the final decay's length in steps
    # wsd only: the final decay's shape over its progress p in (0, 1]: linear 1 - p, cosine
    # (1 + cos(pi p)) / 2, sqrt 1 - sqrt(p) (Haegele et al. 2024), scaling lr - min_lr
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_steps: int = 100
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    # bf16 only: the dtype data-parallel gradient reductions communicate in. fp32 (Megatron-LM's and
    # torchtitan's default) sums every rank's gradient unrounded; bf16 (DeepSpeed's default) halves
    # the traffic but rounds each micro-batch's reduced gradient to 8 significant bits
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    eval_interval: int = 0  # 0: no periodic validation
    eval_iters: int = 4  # validation micro-batches in all, rounded up to a multiple of DP (>= 1)
    # skip a step whose loss exceeds this factor x the running mean (0: only non-finite losses skip)
    loss_spike_factor: float = 0.0
    # after this many consecutive skipped steps, roll back to the last checkpoint (0: never)
    max_consecutive_bad_steps: int = 0
    # stop the job (one line: step, loss, last good checkpoint) instead of a rollback beyond this many
    # in a row; a row ends when a checkpoint is saved past the step that triggered its last rollback
    max_rollbacks: int = 3
    # save a checkpoint and stop (exit status 75) once training has run this long in this job (0: off):
    # a few minutes (a step and a save) under the scheduler's time limit, as Megatron's --exit-duration-in-mins
    exit_duration_minutes: float = 0.0
    # signals on which every rank saves a checkpoint at the next step boundary and stops (exit status 75):
    # a scheduler's warning (Slurm --signal=USR1@600) or a preemption's SIGTERM; []: their default action (death);
    # some of SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGXCPU
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # end a rank (stacks in the log, one error line, exit status 3) when no step, validation, save or log
    # has happened for this long while it is not waiting in a collective (0: off): a hanging pipe: URL or
    # filesystem outside any collective; above the longest save and parallel.distributed_timeout_minutes
    stall_timeout_minutes: float = 0.0


@dataclass
class DatasetSource:
    manifest: str
    weight: float = 1.0
    url_template: Optional[str] = None  # this dataset's shard URLs (default: data.url_template)


@dataclass
class DataConfig:
    manifest: str = ""  # path to a data_pipeline manifest.json (train/val shards)
    # weighted mixture of several datasets; when set, ``manifest`` must be empty
    mixture: list[DatasetSource] = field(default_factory=list)
    tokenizer: str = ""  # path to the sentencepiece .model the shards were written with
    num_workers: int = 0
    shuffle_buffer: int = 8192  # samples; the within-buffer shuffle is a pure function of the seed
    # read shards through a URL template, e.g. "pipe:aws s3 cp s3://bucket/{name} -"
    url_template: Optional[str] = None
    on_corrupt: Literal["error", "skip"] = "error"
    # true: every rank reads whole shards and checks each one's sha256 (every rank then decodes every
    # shard); false: with data parallelism a rank reads only its own samples, checking sizes, headers
    # and token ids but not the shard's sha256 (docs/data.md)
    verify_shard_sha256: bool = False
    # resume on data whose manifest content differs from the checkpoint's (else refused)
    allow_change_on_resume: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <output_dir>/checkpoints
    save_interval: int = 0  # 0: only at the end of training
    keep_last: int = 3  # >= 1 (the newest checkpoint is always kept)
    auto_resume: bool = True
    # start from a consolidated weights file (safetensors, canonical names) instead of random init;
    # ignored when a checkpoint to resume from exists
    init_from: Optional[str] = None


@dataclass
class WandbConfig:
    project: str = ""  # "": no Weights & Biases logging
    entity: Optional[str] = None  # team or user; None: the account's default
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: no network, `wandb sync` later


@dataclass
class LoggingConfig:
    log_interval: int = 1
    tensorboard: bool = True
    # Weights & Biases beside TensorBoard (same scalars and steps), off unless wandb.project is set
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # dense bf16 peak of one device for MFU; None: looked up from the GPU name (no MFU on CPU)
    peak_tflops_per_device: Optional[float] = None


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: Optional[str] = None  # None: runs/<name>
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
