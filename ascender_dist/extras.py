"""The optional dependencies (pyproject's extras) and the one line a command ends with when one of
them is not installed: ``<package> is not installed: pip install 'ascender-dist[<extra>]'``, instead
of an ImportError's traceback from inside the command."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

from ascender_dist.config.errors import UserError

# top-level import name -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRA_OF = {
    "transformers": "hf", "lm_eval": "hf", "accelerate": "hf", "google.protobuf": "hf", "google": "hf",
    "pyarrow": "data", "zstandard": "data", "datasets": "data",
    "wandb": "wandb",
    "matplotlib": "research", "scipy": "research", "sklearn": "research",
}
INSTALL_HINT = "pip install 'ascender-dist["


def missing_extra(exc: BaseException) -> Optional[str]:
    """The one-line message for an ImportError of a package an extra installs (None for any other
    error, e.g. a broken install of a core dependency, which keeps its traceback)."""
    if not isinstance(exc, ImportError):
        return None
    if INSTALL_HINT in str(exc):  # raised with the hint already (ascender_dist.research)
        return str(exc)
    name = exc.name or ""
    top = name.split(".")[0]
    extra = EXTRA_OF.get(name) or EXTRA_OF.get(top)
    if extra is None or _installed(top):  # installed but failing (a version without a name): its own message
        return None
    return f"{top} is not installed: {INSTALL_HINT}{extra}]'"


def _installed(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules (None), or a broken parent
        return False


class MissingExtra(UserError):
    """An optional dependency a command needs is not installed (``str(e)``: missing_extra's line)."""


def require_extra(*modules: str) -> None:
    """Import ``modules`` now, before a command does any work: a missing one (of an extra) ends it
    with one line naming the extra, not with a traceback after the work that came before its import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            message = missing_extra(exc)
            if message is None:
                raise
            raise MissingExtra(message) from None
