"""``python -m benchmarks.gpu_check [--cpu-dry-run] [--out DIR] [--archive FILE.tar.gz] [--sections ...]``: see the
package docstring."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu_check import attention_table, kernel_tests, training
from benchmarks.gpu_check.packages import check_packages, log_packages, missing_line
from benchmarks.gpu_check.plan import DRY_RUN, GPU, SECTIONS, Budget, Plan

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("gpu_check")
RUNNERS = {"tests": kernel_tests.run, "attention": attention_table.run, "training": training.run_training,
           "nccl": training.run_nccl}
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"


def run_section(name: str, plan: Plan, work: Path, packages: dict | None = None) -> dict:
    """Run one section under its budget; an exception becomes the section's one-line status, and a section
    whose packages did not import (``packages``: ``check_packages``'s record) is skipped with one line."""
    budget = Budget(plan.budgets[name])
    log.info("[%s] start (budget %.0f s)", name, budget.seconds)
    missing = missing_line(name, packages or {})
    try:
        if missing:
            result = {"status": f"skipped: {missing} (carry them as wheels: "
                                f"python -m benchmarks.gpu_check.prepare_wheels)"}
        else:
            result = RUNNERS[name](plan, work, budget)
    except Exception as exc:
        text = str(exc).strip().splitlines() or [""]
        result = {"status": f"failed: {type(exc).__name__}: {text[0][:300]}",
                  "error_detail": (text[1:] or traceback.format_exc().splitlines())[-25:]}
    result.update(seconds=budget.used(), budget_s=budget.seconds)
    over = f", OVER its budget of {budget.seconds:.0f} s" if budget.left() < 0 else ""
    (log.info if result["status"].startswith(("ok", "skipped")) else log.error)(
        "[%s] %s (%.0f s%s)", name, result["status"], result["seconds"], over)
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description="Everything that needs a GPU, in one command (~7 min on one H100 or H200).")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the same script on CPU at tiny sizes (fp32, gloo, Triton interpreter); needs --out")
    p.add_argument("--out", type=Path, help=f"results folder (default on a GPU: {GPU_RESULTS.relative_to(ROOT)})")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--kernel-tests-k", help="pytest -k expression for the kernel tests (default: the plan's)")
    p.add_argument("--archive", type=Path, metavar="FILE.tar.gz",
                   help="also keep the results folder as one .tar.gz, rewritten before the first section and after "
                        "every section (a lent GPU machine returns few files: --archive $OUT/gpu_check.tar.gz)")
    return p.parse_args(argv)


def _checkpoint(out: Path, archive: Path | None, results: dict, machine: dict, mode: str, seconds: float,
                planned: dict, running: str | None = None, exit_code: int | None = None) -> None:
    """summary.{json,md} as things stand (unfinished sections marked), then the archive."""
    from benchmarks.gpu_check.report import write_archive, write_summary

    write_summary(out, results, machine, mode, exit_code, seconds, planned=planned, running=running)
    if archive is not None:
        try:
            size = write_archive(out, archive)
            log.info("archive %s rewritten (%.0f kB; %d of %d sections done)", archive, size / 1024, len(results),
                     len(planned))
        except OSError as exc:
            log.error("archive %s not written: %s", archive, exc)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu_check %(message)s", datefmt="%H:%M:%S")
    import torch  # does not import triton: the interpreter setting below still takes effect

    if args.cpu_dry_run and args.out is None:
        log.error("--cpu-dry-run needs --out DIR (%s is for GPU results)", GPU_RESULTS.relative_to(ROOT))
        return 2
    if not args.cpu_dry_run and not torch.cuda.is_available():
        log.error("no CUDA device visible: run this on a GPU machine, or use --cpu-dry-run --out DIR")
        return 2
    # only a run that goes ahead changes the environment (a refusal leaves its caller's as it was)
    if not args.cpu_dry_run and os.environ.pop("TRITON_INTERPRET", None) is not None:
        log.warning("TRITON_INTERPRET was set: removed, the GPU check runs compiled kernels")
    plan = DRY_RUN if args.cpu_dry_run else GPU
    if args.kernel_tests_k is not None:
        plan = Plan(**{**plan.__dict__, "kernel_tests_k": args.kernel_tests_k or None})
    mode = "cpu-dry-run" if plan.dry_run else "gpu"
    out = (args.out or GPU_RESULTS).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from benchmarks.gpu_check.machine import machine_info
    from benchmarks.gpu_check.report import write_section

    archive = args.archive.resolve() if args.archive else None
    if archive is not None:
        archive.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    machine = machine_info(plan.device)
    log.info("checking which packages import (one child process)")
    machine["packages"] = packages = check_packages(env=training._env(plan))
    log_packages(packages)
    if machine.get("driver_version") or machine.get("nvidia_smi"):
        log.info("CUDA %s, driver %s (nvidia-smi: %s)", machine.get("cuda"), machine.get("driver_version"),
                 machine.get("nvidia_smi"))
    total = sum(plan.budgets[s] for s in args.sections)
    log.info("%s on %s; sections %s, budget %.0f s in all; results -> %s%s", mode, machine["device_name"],
             ", ".join(args.sections), total, out, f" (archive {archive})" if archive else "")
    planned = {name: plan.budgets[name] for name in args.sections}
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        for name in args.sections:
            _checkpoint(out, archive, results, machine, mode, time.monotonic() - t0, planned, running=name)
            results[name] = run_section(name, plan, Path(work), packages)
            write_section(out, name, results[name], machine, mode)  # the next _checkpoint archives it
    failed = [n for n, r in results.items() if r["status"].startswith("failed")]
    exit_code = 1 if failed else 0
    _checkpoint(out, archive, results, machine, mode, time.monotonic() - t0, planned, exit_code=exit_code)
    log.info("done in %.0f s: %s; results in %s", time.monotonic() - t0,
             f"FAILED sections: {', '.join(failed)}" if failed else "every section ok or skipped", out)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
