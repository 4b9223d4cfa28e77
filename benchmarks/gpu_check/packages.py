"""Which of the project's packages import here, with versions, checked once at start-up in a child process.

A lent GPU machine has its own Python with torch and triton but not deepspeed, megatron-core or webdataset
(they travel as wheels: ``prepare_wheels.py``). Each package is imported for real (an installed package
whose own dependency is missing, deepspeed without pydantic say, fails here with that dependency named), in
a child process so that the check imports nothing into gpu_check itself. A section whose packages do not
all import is skipped with one line naming them (``missing_line``), instead of failing deep inside a launch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("gpu_check")
ROOT = Path(__file__).resolve().parents[2]

# (import name, distribution name): what the sections import, in the order the record lists them
PACKAGES = (("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"), ("megatron.core", "megatron-core"),
            ("deepspeed", "deepspeed"), ("webdataset", "webdataset"), ("sentencepiece", "sentencepiece"),
            ("yaml", "PyYAML"), ("tensorboard", "tensorboard"), ("safetensors", "safetensors"),
            ("pytest", "pytest"), ("matplotlib", "matplotlib"))
# import names each section cannot run without (the kernel tests skip themselves without triton: counted)
TRAINER = ("megatron.core", "deepspeed", "webdataset", "sentencepiece", "yaml", "tensorboard")
NEEDS = {"tests": ("pytest",), "attention": ("torch",), "training": TRAINER, "nccl": TRAINER}
MARK = "GPU_CHECK_PACKAGES "
CHECK_TIMEOUT_S = 180.0

_CHILD = r"""
import json, sys, time
from importlib import import_module
from pathlib import Path

from ascender_dist.versions import package_version  # the child runs in the repo root

out = {}
for mod, dist in json.loads(sys.argv[1]):
    t0 = time.perf_counter()
    try:
        m = import_module(mod)
    except BaseException as exc:  # SystemExit too: an import must not end the check
        top = mod.split(".")[0]
        absent = isinstance(exc, ModuleNotFoundError) and exc.name in (mod, top)
        text = (str(exc).strip().splitlines() or [""])[0][:200]
        out[mod] = {"ok": False, "error": "not installed" if absent else f"{type(exc).__name__}: {text}"}
        continue
    v = package_version(dist) or getattr(m, "__version__", None)
    f = getattr(m, "__file__", None)
    where = None
    if f:
        p = Path(f).resolve()
        where = str(p.parents[len(mod.split(".")) - (0 if p.name == "__init__.py" else 1)])
    out[mod] = {"ok": True, "version": str(v) if v is not None else None, "from": where,
                "import_s": round(time.perf_counter() - t0, 2)}
print("\n" + sys.argv[2] + json.dumps(out), flush=True)
"""


def check_packages(env: dict | None = None, packages=PACKAGES, timeout: float = CHECK_TIMEOUT_S) -> dict:
    """``{import name: {"ok": True, "version", "from", "import_s"} or {"ok": False, "error"}}``; where the
    check itself breaks or times out, every entry is ``{"ok": None, "error": why}`` (unknown: sections run)."""
    full_env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-c", _CHILD, json.dumps([list(p) for p in packages]), MARK]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
        if not line:
            tail = (proc.stdout + proc.stderr).strip().splitlines()
            raise RuntimeError(f"exit {proc.returncode}: {(tail or ['no output'])[-1][:200]}")
        return json.loads(line[-1][len(MARK):])
    except Exception as exc:  # noqa: BLE001 - the check must never stop the run
        why = f"import check failed ({type(exc).__name__}: {str(exc)[:200]})"
        if isinstance(exc, subprocess.TimeoutExpired):
            why = f"import check timed out after {timeout:.0f} s"
        return {mod: {"ok": None, "error": why} for mod, _ in packages}


def missing_line(section: str, packages: dict) -> str | None:
    """``"needs deepspeed (ModuleNotFoundError: No module named 'hjson'), webdataset (not installed)"`` for
    the section's packages that did not import; None when all did (or were not checked)."""
    bad = [f"{mod} ({packages[mod].get('error')})" for mod in NEEDS.get(section, ())
           if mod in packages and packages[mod].get("ok") is False]
    return "needs " + ", ".join(bad) if bad else None


def summary_line(packages: dict) -> str:
    """One line for the logs and summary.md: ``torch 2.11.0, ..., deepspeed MISSING (not installed)``."""
    parts = []
    for mod, rec in packages.items():
        if rec.get("ok"):
            parts.append(f"{mod} {rec.get('version') or '?'}")
        else:
            parts.append(f"{mod} {'MISSING' if rec.get('ok') is False else 'unknown'} ({rec.get('error')})")
    return ", ".join(parts)


def log_packages(packages: dict) -> None:
    missing = [m for m, r in packages.items() if r.get("ok") is False]
    log.info("packages: %s", summary_line(packages))
    if missing:
        log.warning("packages that do not import: %s (sections that need them are skipped; carry them as wheels: "
                    "python -m benchmarks.gpu_check.prepare_wheels)", ", ".join(missing))
