"""The machine the results were measured on: device name, library versions, git commit, date.

The commit and whether the tree had uncommitted changes come from ``provenance.git_state()`` in a git
checkout. A copy of the tree (a docker image, the copy the device tool sends to a lent GPU host: the working
tree travels, uncommitted edits too, without its ``.git``) is named by whoever made it:
``ASCENDER_SOURCE_COMMIT=<hash>`` and, if they know it, ``ASCENDER_SOURCE_DIRTY=1`` (the copy had uncommitted
changes, e.g. ``git status --porcelain`` printed something) or ``=0`` (it was clean). Without
``ASCENDER_SOURCE_DIRTY`` the dirty state of a copy is recorded as unknown (``git_dirty: None``), never as clean.
"""

from __future__ import annotations

import datetime
import os
import subprocess

from ascender_dist.versions import package_version
from benchmarks.scaling import _machine

SOURCE_COMMIT_VAR = "ASCENDER_SOURCE_COMMIT"
SOURCE_DIRTY_VAR = "ASCENDER_SOURCE_DIRTY"
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]


def gpu_driver() -> dict:
    """``{"driver_version", "nvidia_smi"}``: the driver of the first GPU and nvidia-smi's lines (name, driver,
    memory of each GPU), or ``driver_version`` None and why, where nvidia-smi is absent or fails."""
    try:
        proc = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"driver_version": None, "nvidia_smi": f"not run: {type(exc).__name__}: {exc}"[:200]}
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    fields = [f.strip() for f in lines[0].split(",")] if lines else []
    if proc.returncode != 0 or len(fields) < 2:
        why = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1][:200]
        return {"driver_version": None, "nvidia_smi": f"exit {proc.returncode}: {why}"}
    return {"driver_version": fields[1], "nvidia_smi": lines}


def _flag(text):
    """True / False for the usual spellings of yes / no, None for anything else (unset, empty, unclear)."""
    value = (text or "").strip().lower()
    return True if value in ("1", "true", "yes", "dirty") else False if value in ("0", "false", "no", "clean") else None


def source_state() -> dict:
    """``{"commit": text for the header, "git_commit": sha or None, "git_dirty": True, False or None,
    "git_changes_sha256": the uncommitted changes' hash or None}``:
    the copier's word (``ASCENDER_SOURCE_COMMIT`` / ``ASCENDER_SOURCE_DIRTY``) when given, else
    ``provenance.git_state()`` of this checkout (None, None: not a git checkout, or the research extra that
    holds provenance is not installed)."""
    given = os.environ.get(SOURCE_COMMIT_VAR)
    if given:
        return {"commit": f"{given} (per {SOURCE_COMMIT_VAR})", "git_commit": given,
                "git_dirty": _flag(os.environ.get(SOURCE_DIRTY_VAR)), "git_changes_sha256": None}
    try:
        from ascender_dist.research.ablate.provenance import git_state
    except ImportError:  # ascender_dist.research needs the research extra (scipy, scikit-learn, matplotlib)
        state = {"git_commit": None, "git_dirty": None, "git_changes_sha256": None}
    else:
        state = git_state()
    commit = (state["git_commit"] or "")[:12] or f"unknown (not a git checkout; set {SOURCE_COMMIT_VAR} to the commit the copy was made from)"
    return {"commit": commit, **state}


def dirty_text(info: dict) -> str:
    """What the header says of uncommitted changes: none, present, or unknown (a copy whose maker did not say)."""
    if "git_dirty" not in info:  # a record made before git_state: the tracked files that differed
        return f" with uncommitted changes in {', '.join(info['uncommitted'])}" if info.get("uncommitted") else ""
    if info["git_dirty"] is None:
        return (f" (uncommitted changes unknown: a copy of the tree; {SOURCE_DIRTY_VAR}=1 or 0 names them)"
                if info.get("git_commit") else "")
    return " with uncommitted changes (git status not clean)" if info["git_dirty"] else ""


def machine_info(device: str) -> dict:
    """CPU, memory, torch/deepspeed/megatron versions and the git commit (``benchmarks/scaling.py``'s
    record), plus the GPU fields. ``device == "cpu"`` (the dry run) records no GPU, even on a GPU host."""
    import torch

    from ascender_dist.training.metrics import peak_tflops_per_device

    # a copy of the tree (a docker image, a copy sent to a GPU host) may carry no .git or another commit's:
    # whoever made the copy names its commit, and its dirty state if known (source_state)
    info = {**_machine(), **source_state(), "device": device, "triton": package_version("triton"),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
    info.pop("gpu", None)  # "is a GPU visible": replaced by the fields below, which say which one
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    device_memory_gib=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), peak_bf16_tflops=peak_tflops_per_device(None),
                    **gpu_driver())
    else:
        info.update(device_name=f"CPU ({info['cpu_model']})", device_count=0, device_memory_gib=None,
                    compute_capability=None, cuda=None, cudnn=None, peak_bf16_tflops=None, driver_version=None,
                    nvidia_smi=None)
    return info


def header_lines(info: dict) -> list[str]:
    """Markdown lines naming the machine (the top of every .md file)."""
    lines = [f"Device: **{info['device_name']}**" + (f" x {info['device_count']}" if info["device_count"] else "")
             + (f", {info['device_memory_gib']} GiB, compute capability {info['compute_capability']}"
                if info["device"] == "cuda" else " (CPU dry run: no GPU was used)") + ".",
             f"torch {info['torch']}, triton {info['triton'] or 'not installed'}, CUDA {info['cuda'] or 'none'}"
             + (f" (driver {info.get('driver_version') or 'unknown'})" if info["device"] == "cuda" else "") + ", "
             f"deepspeed {info['versions']['deepspeed']}, megatron-core {info['versions']['megatron-core']}, "
             f"Python {info['python']}; host CPU {info['cpu_model']} ({info['cores']} cores).",
             f"Commit {info['commit']}{dirty_text(info)}; measured {info['date_utc']}."]
    return lines
