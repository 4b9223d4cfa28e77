"""Connection Transformer layer: tokens -> N fixed slots -> learned slot interaction -> tokens.

See docs/connection.md for the maths, the causal form, the TP layout and the cost.
The hyper-parameters import without torch (the config schema embeds them); the layer symbols
load torch on first access.
"""

from ascender_dist.config.connection_hparams import ConnectionHParams
from ascender_dist.models.counting import connection_param_count

_LAYER_SYMBOLS = ("TP_SHARD_DIM", "ConnectionLayer", "ReasoningStats", "make_fixed_slots", "shard_state_dict")

__all__ = ["ConnectionHParams", "connection_param_count", *_LAYER_SYMBOLS]


def __getattr__(name):
    if name in _LAYER_SYMBOLS:
        from ascender_dist.models.connection import layer

        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
