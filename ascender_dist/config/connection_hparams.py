"""Hyper-parameters of the Connection Transformer layer (``model.connection`` in the YAML config).

Only int/float/bool/str fields, so the dataclass round-trips through the strict YAML loader.
``validate`` raises :class:`ConfigError` with the dotted field path, so a bad config fails in one
readable line before any tensor is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ascender_dist.config.errors import ConfigError, non_finite_field

CONNECTION_TYPES = ("linear", "bilinear")
STOP_GRANULARITIES = ("sample", "slot")
SLOT_INITS = ("orthogonal",)


@dataclass
class ConnectionHParams:
    """Shape and behaviour of one Connection Transformer layer.

    The layer compresses tokens onto ``num_slots`` fixed slots, lets the slots interact for at
    most ``max_steps`` steps through a learned connection, and expands the slots back to tokens.
    """

    num_slots: int = 32
    """N: number of fixed semantic slots (slot state is [N, hidden])."""
    connection: str = "bilinear"
    """'linear': one [N, N] matrix over the slot axis; 'bilinear': a rank-r map per slot pair."""
    rank: int = 32
    """r: rank of each bilinear slot-pair map (ignored by 'linear'); sharded across TP ranks."""
    max_steps: int = 4
    """Upper bound on reasoning steps; every sample stops here even if it has not converged."""
    threshold: float = 0.01
    """A slot has converged when the L2 norm (over hidden) of its last update is <= threshold."""
    stop_granularity: str = "sample"
    """'sample': a sample freezes once all its slots converged; 'slot': each slot freezes alone."""
    stop_check_every: int = 1
    """Host sync 'all converged?' every k steps (1: every step; 0: never, always max_steps).
    Results are identical for every k, because converged samples are frozen by masks."""
    causal: bool = True
    """Decoder mode: the output at position t depends only on tokens <= t."""
    causal_chunk_size: int = 128
    """c: tokens of chunk k read the reasoned slot state of chunks < k plus their own chunk's
    prefix (raw, not reasoned). Reasoning runs on seq_len / c prefix states per sample; c must be
    below the sequence length, or no token ever reads a reasoned state."""
    normalize_compression: bool = True
    """Divide each slot's accumulated values by the slot's accumulated attention load (a weighted
    mean over tokens) so slot activations do not grow with sequence length."""
    compression_eps: float = 1e-6
    """Floor on the slot load used by the normalisation (guards empty prefixes and underflow)."""
    slot_init: str = "orthogonal"
    """How the fixed (non-trained) slots are made: orthogonal rows scaled to per-element RMS 1
    (N <= D; see make_fixed_slots for N > D)."""
    slot_seed: int = 1234
    """Seed of the fixed slots, so every TP rank and every restart builds identical slots."""
    init_std: float = 0.02
    """Std of the normal init of the six token/slot projections."""
    connection_init_scale: float = 0.1
    """Initial size of one reasoning step's influence relative to the slot state (keeps the
    ReLU-accumulating steps from exploding at init)."""

    def validate(self, prefix: str, hidden_size: int, tensor_parallel_size: int = 1) -> None:
        """Raise ConfigError naming ``{prefix}.field`` for the first inconsistent value."""

        def fail(field: str, message: str) -> None:
            raise ConfigError(f"{prefix}.{field}" if prefix else field, message)

        bad = non_finite_field(self)
        if bad is not None:
            fail(bad[0], f"must be a finite number (got {bad[1]})")
        if self.num_slots < 1:
            fail("num_slots", f"must be >= 1 (got {self.num_slots})")
        if self.connection not in CONNECTION_TYPES:
            fail("connection", f"must be one of {list(CONNECTION_TYPES)} (got {self.connection!r})")
        if self.connection == "bilinear":  # rank is unused by the linear connection
            if self.num_slots < 2:  # its maps act on slot pairs i != j only: one slot has none
                fail("num_slots", f"must be >= 2 for the bilinear connection, which only connects slot pairs i != j "
                                  f"(got {self.num_slots})")
            if self.rank < 1:
                fail("rank", f"must be >= 1 (got {self.rank})")
            if self.rank > hidden_size:
                fail("rank", f"must be <= hidden size (got {self.rank} > {hidden_size})")
        if self.max_steps < 1:
            fail("max_steps", f"must be >= 1 (got {self.max_steps})")
        if self.threshold < 0:
            fail("threshold", f"must be >= 0 (got {self.threshold})")
        if self.stop_granularity not in STOP_GRANULARITIES:
            fail("stop_granularity",
                 f"must be one of {list(STOP_GRANULARITIES)} (got {self.stop_granularity!r})")
        if self.stop_check_every < 0:
            fail("stop_check_every", f"must be >= 0 (got {self.stop_check_every})")
        if self.causal_chunk_size < 1:
            fail("causal_chunk_size", f"must be >= 1 (got {self.causal_chunk_size})")
        if self.compression_eps <= 0:
            fail("compression_eps", f"must be > 0 (got {self.compression_eps})")
        if self.slot_init not in SLOT_INITS:
            fail("slot_init", f"must be one of {list(SLOT_INITS)} (got {self.slot_init!r})")
        if self.init_std <= 0:
            fail("init_std", f"must be > 0 (got {self.init_std})")
        if self.connection_init_scale <= 0:  # 0: the influence and every connection gradient stay 0 forever
            fail("connection_init_scale", f"must be > 0 (got {self.connection_init_scale})")
        if not -(2**63) <= self.slot_seed < 2**64:  # what torch.Generator.manual_seed takes
            fail("slot_seed", f"must be in [-2**63, 2**64) (got {self.slot_seed})")
        tp = tensor_parallel_size
        if hidden_size % tp:
            raise ConfigError(prefix, f"hidden size {hidden_size} must be divisible by tensor "
                                      f"parallel size {tp}")
        if self.connection == "bilinear" and self.rank % tp:
            fail("rank", f"must be divisible by tensor parallel size {tp} (got {self.rank})")
