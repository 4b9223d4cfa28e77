#!/usr/bin/env bash
# One-time set-up of a fresh machine: a virtualenv in .venv with torch installed FIRST and pinned
# (an unpinned torch pulled in by megatron-core/deepspeed would fetch a multi-GB CUDA build), then
# this project and its pinned dependencies. Idempotent: re-running only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet -e ".[dev]"
.venv/bin/python -c 'from importlib.metadata import version as v; print("setup: torch", v("torch"), "| megatron-core", v("megatron-core"), "| deepspeed", v("deepspeed"))'
