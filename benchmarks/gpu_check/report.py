"""Writing the results: ``<section>.{json,md}`` as each section ends; ``summary.{json,md}`` before the first
section and again before and after each (unfinished sections marked, so a run killed at its time limit leaves
a true summary); with ``--archive``, one ``.tar.gz`` of the results folder rewritten each time the summary is."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from ascender_dist.plotting import EXTRA_HINT
from benchmarks.gpu_check import attention_table, kernel_tests, training
from benchmarks.gpu_check.machine import header_lines
from benchmarks.gpu_check.packages import summary_line

TITLES = {"tests": "CUDA tests", "attention": "Attention layer: ASCender vs SDPA",
          "training": "One-GPU training throughput and MFU", "nccl": "2-rank data-parallel training run (NCCL on GPUs)"}
RENDER = {"tests": kernel_tests.markdown, "attention": attention_table.markdown, "training": training.markdown,
          "nccl": training.markdown}


def _title(mode: str, name: str) -> str:
    return f"# {TITLES[name]}" + (" (CPU dry run)" if mode == "cpu-dry-run" else "")


def section_lines(name: str, result: dict) -> list[str]:
    lines = [f"Status: **{result['status']}** ({result['seconds']:.0f} s, budget {result['budget_s']:.0f} s)."]
    body = RENDER[name](result)
    if body:
        lines += [""] + body
    if result.get("error_detail"):
        lines += ["", "```", *result["error_detail"], "```"]
    return lines


def write_section(out: Path, name: str, result: dict, machine: dict, mode: str) -> None:
    if name == "attention" and "points" in result:
        result["plot"] = "attention.png" if attention_table.plot(result, out / "attention.png") else \
            f"not drawn: matplotlib is not installed ({EXTRA_HINT})"
    _write(out / f"{name}.json", json.dumps({"mode": mode, "machine": machine, **result}, indent=1) + "\n")
    lines = [_title(mode, name), "", *header_lines(machine), "", *section_lines(name, result)]
    if result.get("plot") == "attention.png":
        lines += ["", "![time and memory vs n](attention.png)"]
    _write(out / f"{name}.md", "\n".join(lines) + "\n")


NOT_RUN = "not run: the check stopped before this section (killed at its time limit?)"
RUNNING = "not finished: the check stopped while this section ran (killed at its time limit?)"


def write_summary(out: Path, results: dict, machine: dict, mode: str, exit_code: int | None, seconds: float,
                  planned: dict | None = None, running: str | None = None) -> None:
    """``planned``: ``{section: budget_s}`` of every section the run will do, in order; those without a result
    yet are listed as ``running`` (the one under way) or not run, and ``exit_code`` None says the run had
    not ended when this was written."""
    planned = planned or {name: r["budget_s"] for name, r in results.items()}
    sections = {}
    for name, budget in planned.items():
        if name in results:
            sections[name] = {k: results[name][k] for k in ("status", "seconds", "budget_s")}
        else:
            sections[name] = {"status": RUNNING if name == running else NOT_RUN, "seconds": 0.0, "budget_s": budget}
    complete = exit_code is not None
    summary = {"mode": mode, "machine": machine, "complete": complete, "exit_code": exit_code, "seconds": seconds,
               "sections": sections}
    _write(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    title = "# GPU check" + (" (CPU dry run: tiny sizes, no GPU used)" if mode == "cpu-dry-run" else "")
    command = f"`python -m benchmarks.gpu_check{' --cpu-dry-run' if mode == 'cpu-dry-run' else ''}`: "
    ran = (f"{seconds:.0f} s in all, exit status {exit_code}." if complete else
           f"INCOMPLETE: written after {seconds:.0f} s with {len(results)} of {len(planned)} sections done; the "
           "check had not ended (no exit status).")
    lines = [title, "", *header_lines(machine), ""]
    if machine.get("packages"):
        lines += [f"Packages (imported at start-up): {summary_line(machine['packages'])}.", ""]
    lines += [command + ran, "", "| section | status | seconds | budget |", "|---|---|---:|---:|"]
    for name, s in sections.items():
        link = f"[{name}]({name}.md)" if name in results else name
        lines.append(f"| {link} | {s['status']} | {s['seconds']:.0f} | {s['budget_s']:.0f} |")
    for name, r in results.items():
        lines += ["", f"#{_title(mode, name)}", "", *section_lines(name, r)]
    _write(out / "summary.md", "\n".join(lines) + "\n")


def _write(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so a kill mid-write leaves the previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_archive(out: Path, archive: Path) -> int:
    """Rewrite ``archive`` (.tar.gz) with every file of ``out`` at the archive's top level (unpack it with
    ``tar -xzf ARCHIVE -C benchmarks/results/gpu/``); through a temporary file, so a kill mid-write keeps the
    previous archive. Returns the archive's size in bytes."""
    archive = archive.resolve()
    tmp = archive.with_name(archive.name + ".tmp")
    skip = {archive, tmp}
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            if path.is_file() and path.resolve() not in skip and not path.name.endswith(".tmp"):
                tar.add(path, arcname=path.relative_to(out).as_posix())
    os.replace(tmp, archive)
    return archive.stat().st_size
