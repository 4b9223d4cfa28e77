"""Typed run configuration: schema, strict YAML loading, presets, checks, derived values."""

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import from_dict, to_dict
from ascender_dist.config.resolve import Derived, derive, load_config, validate
from ascender_dist.config.schema import RunConfig

__all__ = ["ConfigError", "Derived", "RunConfig", "derive", "from_dict", "load_config", "to_dict", "validate"]
