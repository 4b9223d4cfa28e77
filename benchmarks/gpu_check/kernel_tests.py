"""Section ``tests``: pytest on the Triton kernel tests and on every test marked ``cuda``, counts recorded.

On a GPU the kernels are compiled for real (TRITON_INTERPRET is removed from the environment); in the
dry run they run under the Triton interpreter (TRITON_INTERPRET=1, no GPU visible) restricted to a quick
``-k`` subset. Counts come from pytest's JUnit XML; skipped tests are counted as skipped, never as passed,
and a kernel test file that does not exist yet is one skip line.

The ``-m cuda`` run collects the whole test tree with ``--continue-on-collection-errors``: a test module that
imports a package the machine lacks (a lent GPU machine has its own package set) is one line of
``collection_errors``, not a failed section, when every test collected passed. A pytest run that reaches
its timeout gets SIGINT first (pytest then stops, writes its JUnit XML and prints its summary), SIGKILL
only if it is still running ``INTERRUPT_GRACE_S`` later; the counts so far and the output tail are kept.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check.plan import Budget, Plan

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = "tests/unit/test_ascender_triton.py"
PYTEST = [sys.executable, "-m", "pytest"]  # the command prefix (the unit tests put a fake pytest here)
INTERRUPT_GRACE_S = 15.0  # after SIGINT at the timeout, seconds pytest gets to write its XML and summary
log = logging.getLogger("gpu_check")


def _env(plan: Plan) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if plan.dry_run:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def junit_counts(xml_path: Path) -> dict:
    """Totals of a pytest JUnit XML file and the ids (+ first message line) of failed / errored tests.

    A test module that could not be collected (``<error message="collection failure">``, no class name) is
    not a test: it goes to ``collection_errors`` (module + its last ``E`` line), not to ``errors``."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed, collection = [], []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is None:
            continue
        if bad.tag == "error" and bad.get("message") == "collection failure" and not case.get("classname"):
            e_lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
            collection.append(f"{case.get('name')}: {(e_lines or ['collection failure'])[-1][:200]}")
            continue
        message = (bad.get("message") or "").strip().splitlines()
        failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200] if message else ''}")
    errors = total["errors"] - len(collection)
    passed = total["tests"] - len(collection) - total["failures"] - errors - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": errors, "skipped": total["skipped"],
            "failed_tests": failed, "collection_errors": collection}


def run_interruptible(cmd: list[str], cwd: Path, env: dict, timeout: float, log_path: Path,
                      grace: float | None = None) -> dict:
    """Run ``cmd`` with its output (stdout and stderr) in ``log_path``; at ``timeout`` send SIGINT, and
    SIGKILL ``grace`` seconds later if it still runs. ``{"returncode", "output", "stopped"}``, where
    ``stopped`` is None (it ended by itself), "SIGINT" (it ended after the interrupt) or "SIGKILL"."""
    grace = INTERRUPT_GRACE_S if grace is None else grace
    stopped = None
    with open(log_path, "w") as sink:  # a file, not a pipe: children that outlive pytest cannot block the read
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stopped = "SIGINT"
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    stopped = "SIGKILL"
                    proc.kill()
                    proc.wait()
        finally:
            if proc.poll() is None:  # gpu_check itself interrupted: leave no pytest behind
                proc.kill()
                proc.wait()
    output = Path(log_path).read_text(encoding="utf-8", errors="replace")
    return {"returncode": proc.returncode, "output": output, "stopped": stopped}


def _counts_note(run: dict) -> str:
    return (f"{run['passed']} passed, {run['failed']} failed, {run['errors']} errors, {run['skipped']} skipped"
            if "passed" in run else "no JUnit XML written")


def run_pytest(name: str, args: list[str], plan: Plan, work: Path, timeout: float, empty_ok: bool) -> dict:
    """One pytest run; ``empty_ok``: collecting no test is not a failure (a marker nobody uses yet)."""
    xml = work / f"{name}.xml"
    xml.unlink(missing_ok=True)
    cmd = [*PYTEST, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    log.info("[tests] %s: pytest %s (timeout %.0f s)", name, shlex.join(args), timeout)
    run = {"command": "python -m pytest " + shlex.join(args),
           "triton_interpret": "1" if plan.dry_run else "unset (compiled kernels)"}
    proc = run_interruptible(cmd, ROOT, _env(plan), max(timeout, 1), work / f"{name}.log")
    lines = proc["output"].strip().splitlines()
    run.update(returncode=proc["returncode"], output_tail=lines[-30:])
    if xml.exists():
        try:
            run.update(junit_counts(xml))
        except ET.ParseError as exc:  # a kill while it was being written
            run["junit_error"] = f"unreadable JUnit XML: {exc}"
    if proc["stopped"]:
        run["stopped_by"] = proc["stopped"]
        run["status"] = (f"failed: pytest timed out after {max(timeout, 1):.0f} s (section budget), stopped by "
                         f"{proc['stopped']}; before it: {_counts_note(run)}")
        return run
    if proc["returncode"] == 5:  # pytest: no tests collected
        zero = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": [], "collection_errors": []}
        return {**run, **zero, "status": "ok: no test selected" if empty_ok else "failed: no test selected"}
    if "passed" not in run:
        return {**run, "status": f"failed: pytest exit {proc['returncode']}: {(lines or ['no output'])[-1][:200]}"}
    collection = run["collection_errors"]
    clean = run["failed"] == 0 and run["errors"] == 0
    # exit 1 with only collection errors (``--continue-on-collection-errors``): every collected test passed
    if proc["returncode"] == 0 or (proc["returncode"] == 1 and clean and collection):
        if name == "kernels" and run["passed"] == 0:
            run["status"] = f"failed: no kernel test passed ({run['skipped']} skipped)"  # a skip is not a pass
        else:
            run["status"] = "ok" + (f"; {len(collection)} test module(s) not collected (see collection_errors)"
                                    if collection else "")
    elif proc["returncode"] == 1:
        run["status"] = f"failed: {run['failed']} failed, {run['errors']} errors"
    else:
        run["status"] = f"failed: pytest exit {proc['returncode']}: {(lines or ['no output'])[-1][:200]}"
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
    # collection errors do not stop the run: a module importing a package this machine lacks is one line
    runs["cuda_marked"] = run_pytest("cuda_marked", ["-m", "cuda", "tests", "--ignore", KERNEL_TESTS,
                                                     "--continue-on-collection-errors"], plan, work,
                                     budget.left(), empty_ok=True)
    for name, r in runs.items():
        if "passed" in r:
            log.info("[tests] %s: %s (passed %d, failed %d, errors %d, skipped %d)", name, r["status"], r["passed"],
                     r["failed"], r["errors"], r["skipped"])
        if r.get("collection_errors"):
            log.warning("[tests] %s: %d test module(s) not collected: %s", name, len(r["collection_errors"]),
                        "; ".join(r["collection_errors"]))
    bad = [f"{name}: {r['status'][len('failed: '):]}" for name, r in runs.items() if r["status"].startswith("failed")]
    not_collected = sum(len(r.get("collection_errors", [])) for r in runs.values())
    status = ("failed: " + "; ".join(bad)) if bad else "ok"
    if not_collected:
        status += f" ({not_collected} test module(s) not collected: see tests.md)"
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
    collection = [t for r in result.get("runs", {}).values() for t in r.get("collection_errors", [])]
    if collection:
        lines += ["", "Test modules not collected (their tests did not run; usually a package this machine lacks):",
                  ""] + [f"- `{t}`" for t in collection[:40]]
    stopped = [(name, r) for name, r in result.get("runs", {}).items() if r.get("stopped_by")]
    for name, r in stopped:
        lines += ["", f"{name}: stopped by {r['stopped_by']} at its timeout; the end of its output:", "", "```",
                  *r.get("output_tail", []), "```"]
    return lines
