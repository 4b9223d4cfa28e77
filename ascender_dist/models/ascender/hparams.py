"""``AscenderHParams`` under the name the ASCender modules import it by (``from .hparams import``);
the dataclass is defined with the rest of the config, in :mod:`ascender_dist.config.ascender_hparams`."""

from ascender_dist.config.ascender_hparams import AscenderHParams

__all__ = ["AscenderHParams"]
