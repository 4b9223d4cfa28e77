"""Connection Transformer layer: tokens -> N fixed slots -> learned slot interaction -> tokens.

See docs/connection.md for the maths, the causal form, the TP layout and the cost.
"""

from ascender_dist.models.connection.hparams import ConnectionHParams, connection_param_count
from ascender_dist.models.connection.layer import (
    TP_SHARD_DIM,
    ConnectionLayer,
    ReasoningStats,
    make_fixed_slots,
    shard_state_dict,
)

__all__ = [
    "TP_SHARD_DIM",
    "ConnectionHParams",
    "ConnectionLayer",
    "ReasoningStats",
    "connection_param_count",
    "make_fixed_slots",
    "shard_state_dict",
]
