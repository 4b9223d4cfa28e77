"""Section ``tests``: pytest on the Triton kernel tests and on every test marked ``cuda``, counts recorded.

On a GPU the kernels are compiled for real (TRITON_INTERPRET is removed from the environment); in the
dry run they run under the Triton interpreter (TRITON_INTERPRET=1, no GPU visible) restricted to a quick
``-k`` subset. Counts come from pytest's JUnit XML; skipped tests are counted as skipped, never as passed,
and a kernel test file that does not exist yet is one skip line.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check.plan import Budget, Plan

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = "tests/unit/test_ascender_triton.py"
log = logging.getLogger("gpu_check")


def _env(plan: Plan) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if plan.dry_run:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def junit_counts(xml_path: Path) -> dict:
    """Totals of a pytest JUnit XML file and the ids (+ first message line) of failed / errored tests."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200] if message else ''}")
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
            "failed_tests": failed}


def run_pytest(name: str, args: list[str], plan: Plan, work: Path, timeout: float, empty_ok: bool) -> dict:
    """One pytest run; ``empty_ok``: collecting no test is not a failure (a marker nobody uses yet)."""
    xml = work / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    log.info("[tests] %s: pytest %s (timeout %.0f s)", name, shlex.join(args), timeout)
    run = {"command": "python -m pytest " + shlex.join(args),
           "triton_interpret": "1" if plan.dry_run else "unset (compiled kernels)"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(plan), capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {**run, "status": f"failed: pytest timed out after {timeout:.0f} s (section budget)"}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    run.update(returncode=proc.returncode, output_tail=lines[-30:])
    if proc.returncode == 5:  # pytest: no tests collected
        zero = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": []}
        return {**run, **zero, "status": "ok: no test selected" if empty_ok else "failed: no test selected"}
    if not xml.exists():
        return {**run, "status": f"failed: pytest exit {proc.returncode}: {(lines or ['no output'])[-1][:200]}"}
    run.update(junit_counts(xml))
    if proc.returncode == 0 and name == "kernels" and run["passed"] == 0:
        run["status"] = f"failed: no kernel test passed ({run['skipped']} skipped)"  # a skip is not a pass
    elif proc.returncode == 0:
        run["status"] = "ok"
    elif proc.returncode == 1:
        run["status"] = f"failed: {run['failed']} failed, {run['errors']} errors"
    else:
        run["status"] = f"failed: pytest exit {proc.returncode}: {(lines or ['no output'])[-1][:200]}"
    return run


# seconds of the section kept for the ``-m cuda`` run: collecting the whole test tree takes 10-20 s, so a kernel
# run that used the whole budget (139 s of 150 on an H200) left it too little to even collect
MARKED_RESERVE_S = 40.0


def run(plan: Plan, work: Path, budget: Budget) -> dict:
    runs = {}
    if (ROOT / KERNEL_TESTS).exists():
        args = [KERNEL_TESTS] + (["-k", plan.kernel_tests_k] if plan.kernel_tests_k else [])
        runs["kernels"] = run_pytest("kernels", args, plan, work, budget.left() - MARKED_RESERVE_S, empty_ok=False)
    else:
        runs["kernels"] = {"status": f"skipped: {KERNEL_TESTS} does not exist (no Triton kernels in this checkout)"}
        log.warning("[tests] %s", runs["kernels"]["status"])
    runs["cuda_marked"] = run_pytest("cuda_marked", ["-m", "cuda", "tests", "--ignore", KERNEL_TESTS], plan, work,
                                     budget.left(), empty_ok=True)
    for name, r in runs.items():
        if "passed" in r:
            log.info("[tests] %s: %s (passed %d, failed %d, errors %d, skipped %d)", name, r["status"], r["passed"],
                     r["failed"], r["errors"], r["skipped"])
    bad = [f"{name}: {r['status'][len('failed: '):]}" for name, r in runs.items() if r["status"].startswith("failed")]
    status = ("failed: " + "; ".join(bad)) if bad else "ok"
    return {"status": status, "runs": runs}


def markdown(result: dict) -> list[str]:
    lines = ["| run | command | status | passed | failed | errors | skipped |", "|---|---|---|---:|---:|---:|---:|"]
    for name, r in result.get("runs", {}).items():
        counts = " | ".join(str(r.get(k, "")) for k in ("passed", "failed", "errors", "skipped"))
        command = f"`{r['command']}`" if "command" in r else "not run"
        lines.append(f"| {name} | {command} | {r['status']} | {counts} |")
    failed = [t for r in result.get("runs", {}).values() for t in r.get("failed_tests", [])]
    if failed:
        lines += ["", "Failed tests:", ""] + [f"- `{t}`" for t in failed[:40]]
    return lines
