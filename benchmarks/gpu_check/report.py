"""Writing the results: ``<section>.{json,md}`` as each section ends, ``summary.{json,md}`` at the end."""

from __future__ import annotations

import json
from pathlib import Path

from ascender_dist.plotting import EXTRA_HINT
from benchmarks.gpu_check import attention_table, kernel_tests, training
from benchmarks.gpu_check.machine import header_lines

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
    (out / f"{name}.json").write_text(json.dumps({"mode": mode, "machine": machine, **result}, indent=1) + "\n")
    lines = [_title(mode, name), "", *header_lines(machine), "", *section_lines(name, result)]
    if result.get("plot") == "attention.png":
        lines += ["", "![time and memory vs n](attention.png)"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def write_summary(out: Path, results: dict, machine: dict, mode: str, exit_code: int, seconds: float) -> None:
    sections = {name: {k: r[k] for k in ("status", "seconds", "budget_s")} for name, r in results.items()}
    summary = {"mode": mode, "machine": machine, "exit_code": exit_code, "seconds": seconds, "sections": sections}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    title = "# GPU check" + (" (CPU dry run: tiny sizes, no GPU used)" if mode == "cpu-dry-run" else "")
    lines = [title, "", *header_lines(machine), "",
             f"`python -m benchmarks.gpu_check{' --cpu-dry-run' if mode == 'cpu-dry-run' else ''}`: "
             f"{seconds:.0f} s in all, exit status {exit_code}.", "",
             "| section | status | seconds | budget |", "|---|---|---:|---:|"]
    for name, s in sections.items():
        lines.append(f"| [{name}]({name}.md) | {s['status']} | {s['seconds']:.0f} | {s['budget_s']:.0f} |")
    for name, r in results.items():
        lines += ["", f"#{_title(mode, name)}", "", *section_lines(name, r)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
