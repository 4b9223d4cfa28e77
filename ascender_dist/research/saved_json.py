"""Reading back the JSON a research command wrote (a report's results.json, Table 2's table2.json,
coverage.json, figures.json) for a redraw: one line naming the file when it is unreadable or was
written by something else, never a JSONDecodeError or KeyError from the drawing code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ascender_dist.config.errors import UserError


def read_saved_json(path: Path, keys: Sequence[str], writer: str) -> dict:
    """The JSON object at ``path`` holding every one of ``keys`` (top level); ``writer``: the command
    that writes such a file, for the error line."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or not UTF-8
        raise UserError(f"{path}: cannot read it ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not written by `{writer}` (a JSON {type(data).__name__}, not an object)")
    missing = [key for key in keys if key not in data]
    if missing:
        raise UserError(f"{path}: not written by `{writer}` (no {', '.join(missing)})")
    return data


# what drawing code raises on a JSON of the right keys but another shape (a list for a mapping, ...)
FOREIGN_SHAPE = (KeyError, TypeError, AttributeError, IndexError, ValueError)


def foreign_shape(path: Path, writer: str, exc: Exception) -> UserError:
    """The one-line error for a saved JSON whose values do not have the shapes ``writer`` writes."""
    return UserError(f"{path}: not written by `{writer}` ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})")


def draw_saved(path: Path, keys: Sequence[str], writer: str, draw):
    """``draw(data)`` on the JSON object at ``path`` (read_saved_json), its result; a shape ``draw``
    cannot take is the one-line foreign_shape error, not the drawing code's exception."""
    data = read_saved_json(path, keys, writer)
    try:
        return draw(data)
    except FOREIGN_SHAPE as exc:
        raise foreign_shape(path, writer, exc) from None
