"""The pure-torch layer math the Hugging Face model calls (no megatron, no deepspeed).

Inside the installed package this file re-exports ``ascender_dist.models.{ascender,connection}``.
``ascender-dist export-hf`` does NOT copy this file: it writes a generated one of the same name that
imports vendored copies of those modules (``asd_ascender_*.py``, ``asd_connection_*.py``, copied
into the export directory next to the modeling code), so an exported directory loads with
``trust_remote_code=True`` on a machine without ascender-dist installed.
"""

from ascender_dist.models.ascender.attention import ascender_attention
from ascender_dist.config.ascender_hparams import AscenderHParams
from ascender_dist.models.ascender.params import AscenderHeadParams, alibi_slopes
from ascender_dist.config.connection_hparams import ConnectionHParams
from ascender_dist.models.connection.layer import ConnectionLayer, make_fixed_slots

__all__ = ["AscenderHParams", "AscenderHeadParams", "ConnectionHParams", "ConnectionLayer", "alibi_slopes",
           "ascender_attention", "make_fixed_slots"]
