"""What each mode measures (sizes, steps, budgets) and the per-section clock.

The GPU plan is sized for one H100 or H200 in about 8 minutes: the budgets below add up to 450 s, leaving
~30 s for start-up (the package check imports deepspeed and megatron-core in a child) and writing (the
kernel tests took 112 s on an H200, most of it Triton compilation). Budgets are enforced: pytest gets SIGINT
at its section's budget (SIGKILL ``kernel_tests.INTERRUPT_GRACE_S`` later), the training launches are
killed at it, the attention table stops before a length whose estimated time would overrun.
The dry-run plan runs every code path on CPU at tiny sizes (fp32, gloo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

SECTIONS = ("tests", "attention", "training", "nccl")


@dataclass(frozen=True)
class Plan:
    dry_run: bool
    device: str  # "cuda" or "cpu"
    dtype: str  # torch dtype name of the attention table
    precision: str  # train.precision of the training runs ("bf16" / "fp32")
    budgets: dict  # section -> seconds
    # tests
    kernel_tests_k: Optional[str]  # pytest -k for the kernel tests (None: all of them)
    # attention
    lengths: tuple
    warmup: int
    repeats: int
    # training (one rank)
    train_preset: str
    train_seq: int
    train_steps: int
    train_warmup: int  # steps discarded before the median
    micro_batch: int
    global_batch: int
    vocab_size: Optional[int]  # model.vocab_size (None: the tiny tokenizer's 512 tokens)
    corpus_bytes: int
    # nccl (two ranks, data parallel)
    nccl_preset: str
    nccl_seq: int
    nccl_steps: int


GPU = Plan(
    dry_run=False, device="cuda", dtype="bfloat16", precision="bf16",
    budgets={"tests": 190.0, "attention": 80.0, "training": 170.0, "nccl": 10.0},
    kernel_tests_k=None,
    lengths=(1024, 2048, 4096, 8192, 16384), warmup=3, repeats=10,
    # the scaling configs' model (small preset, here at seq 1024, 32000-token vocabulary): 16 sequences per step
    train_preset="small", train_seq=1024, train_steps=15, train_warmup=3, micro_batch=8, global_batch=16,
    vocab_size=32000, corpus_bytes=1_500_000,
    nccl_preset="debug", nccl_seq=1024, nccl_steps=10,  # seq 1024: the training section's dataset again
)  # fmt: skip

DRY_RUN = Plan(
    dry_run=True, device="cpu", dtype="float32", precision="fp32",
    budgets={"tests": 300.0, "attention": 120.0, "training": 400.0, "nccl": 300.0},
    # a quick subset under the interpreter (~10 s; the whole file ~1 min on 2 cores): the interpreter guard,
    # n = 5 causal and bidirectional in fp64, fp32 and bf16 inputs, the impl="triton" / "auto" entry points
    kernel_tests_k="interpreter_is_active or causal-5 or bidir-5 or float32_within_1e5 or bfloat16 or impl_triton "
                   "or auto_resolves",
    lengths=(24, 40), warmup=1, repeats=5,
    train_preset="debug", train_seq=32, train_steps=3, train_warmup=1, micro_batch=2, global_batch=4,
    vocab_size=1024, corpus_bytes=400_000,  # a model vocabulary above the tokenizer's 512, as on GPU
    nccl_preset="debug", nccl_seq=32, nccl_steps=3,
)  # fmt: skip


@dataclass
class Budget:
    """Seconds a section may take, counted from its start."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def used(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.used()
