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


def commit_text(state: dict | None) -> str:
    """``Commit <12 hex>`` (``(dirty)`` when tracked files differed or untracked files existed) from a
    ``git_state()`` dict (ascender_dist/versions.py), or that it was not recorded."""
    if not state or not state.get("git_commit"):
        return "Commit not recorded"
    return f"Commit {state['git_commit'][:12]}{' (dirty)' if state.get('git_dirty') else ''}"


def cpus_text(result: dict) -> str:
    """``; 2 logical CPUs, shared`` from the ``machine_record`` (ascender_dist/machine.py) a result recorded;
    nothing for records made before it was kept (their machine line names the count)."""
    cpus = (result.get("machine_record") or {}).get("logical_cpus")
    return f"; {cpus} logical CPUs, shared" if cpus else ""


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Median and minimum of the same-round ratios num[i] / den[i], and the ratios themselves."""
    import statistics

    ratios = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(ratios), "min": min(ratios), "ratios": ratios}


def ratio_summary(num: list[float], den: list[float]) -> dict:
    """:func:`ratio_stats` without the ratios themselves: the median and minimum a table shows."""
    return {k: v for k, v in ratio_stats(num, den).items() if k != "ratios"}

