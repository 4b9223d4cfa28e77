#!/usr/bin/env bash
# One-time set-up of a machine: a virtualenv in .venv, torch FIRST, then this project and its pinned
# dependencies (megatron-core, deepspeed, ...) under a constraint that keeps that torch.
# Which torch (launch/torch_plan.py decides; `--dry-run` prints the decision and stops):
#   TORCH_SPEC set -> exactly that; a torch in pyproject.toml's range already installed (in .venv, or
#   in $PYTHON, e.g. an NGC container's build: the venv then sees $PYTHON's packages) -> kept, never
#   replaced; no CUDA device -> the CPU build of the tested version; a CUDA device -> its CUDA build
#   (TORCH_CUDA_INDEX, default the PyTorch cu126 index). Re-runnable: a re-run keeps the venv and a torch
#   in range, but pip still contacts the package index (pip's upgrade, the project's requirements).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DRY_RUN=0
case "$#:${1:-}" in
  0:) ;;
  1:--dry-run) DRY_RUN=1 ;;
  *) echo "setup.sh: error: unknown arguments '$*' (usage: bash launch/setup.sh [--dry-run]); nothing installed" >&2
     exit 2 ;;
esac

ACTION="" SPEC="" INDEX_URL="" LOCAL_SPEC="" SYSTEM_SITE="" REMOVE="" GPU="" REASON=""
PLAN=$("$PYTHON" launch/torch_plan.py .venv/bin/python "$PYTHON")
eval "$PLAN"
echo "setup: torch: $ACTION $SPEC${INDEX_URL:+ (index $INDEX_URL)}: $REASON"
if [ -n "$LOCAL_SPEC" ]; then echo "setup: trying $LOCAL_SPEC from pip's own indexes and wheel folders first"; fi
if [ -n "$REMOVE" ]; then echo "setup: uninstalling .venv's own $REMOVE first: it would hide $PYTHON's"; fi
if [ "$DRY_RUN" = 1 ]; then exit 0; fi

if [ -n "$REMOVE" ]; then  # before the venv sees $PYTHON's packages; pip never removes one outside the venv
    read -ra remove_pkgs <<< "$REMOVE"
    .venv/bin/python -m pip uninstall --quiet --yes "${remove_pkgs[@]}" 2>/dev/null || true
fi
if [ "$SYSTEM_SITE" = 1 ]; then
    "$PYTHON" -m venv --system-site-packages .venv   # (re)writes pyvenv.cfg; installed packages stay
elif [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then  # e.g. left by a venv made without ensurepip
    echo "setup: error: .venv has no pip (a half-made virtualenv, e.g. from a failed '$PYTHON -m venv' without ensurepip / python3-venv): delete it (rm -rf .venv) and re-run" >&2
    exit 2
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "$ACTION" = install ]; then
    # a torch already here is one the plan refused (another build, or out of range): pip would call a
    # CPU build "already satisfied" by torch==X from the CUDA index, so it goes first
    .venv/bin/python -m pip uninstall --quiet --yes torch 2>/dev/null || true
    if [ -n "$LOCAL_SPEC" ] && .venv/bin/python -m pip install --quiet "$LOCAL_SPEC" 2>/dev/null; then
        echo "setup: installed $LOCAL_SPEC without the PyTorch index"
    else
        .venv/bin/python -m pip install --quiet ${INDEX_URL:+--index-url "$INDEX_URL"} "$SPEC"
    fi
fi
TORCH_VERSION=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("torch"))')
if [ "$GPU" = 1 ] && [ -z "${TORCH_SPEC:-}" ] && ! .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    # installed or kept: on a GPU host the torch the venv imports must be a CUDA build
    echo "setup: error: a CUDA device is present but the torch .venv imports ($TORCH_VERSION) has no CUDA; set TORCH_CUDA_INDEX or TORCH_SPEC" >&2
    exit 2
fi
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
.venv/bin/python launch/keep_installed.py > "$CONSTRAINT"   # never swap torch, nor the triton it came with
.venv/bin/python -m pip install --quiet --constraint "$CONSTRAINT" -e ".[dev]"
.venv/bin/python -c 'from importlib.metadata import version as v; print("setup: torch", v("torch"), "| megatron-core", v("megatron-core"), "| deepspeed", v("deepspeed"))'
