"""Where every benchmark puts its results: ``benchmarks/results/<name>.md`` (the table a reader
opens), ``<name>.json`` (every measured number) and, written by the caller, ``<name>.png``."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def publish(name: str, lines: list[str], data, write: bool) -> bool:
    """Print the report; with ``write``, save ``<name>.md`` and ``<name>.json``. Returns ``write``
    (so the caller draws its figure only then)."""
    text = "\n".join(lines)
    print(text)
    if write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.md").write_text(text)
        (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
    return write
