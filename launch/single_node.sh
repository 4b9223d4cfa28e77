#!/usr/bin/env bash
# Training on the ranks of ONE machine through the `deepspeed` launcher (docs/cluster.md).
#
#   bash launch/single_node.sh --config configs/demo.yaml [--set key=value ...]
#
# Environment:
#   NUM_RANKS        ranks to start, one per GPU (default: one per GPU that torch sees; 2 on a CPU-only
#                    machine), on the first NUM_RANKS GPUs CUDA_VISIBLE_DEVICES lists (indices), else 0..N-1
#   MASTER_PORT      rendezvous port on 127.0.0.1 (default: a free one)
#   OMP_NUM_THREADS  threads per rank (default: cores / ranks)
#   DEEPSPEED        the launcher command (default: deepspeed, from .venv/bin if there, else PATH)
#   DS_ACCELERATOR   DeepSpeed accelerator (default: cpu when there is no GPU, else DeepSpeed's choice)
#   STOP_WAIT_S      after a launcher killed on a stop, seconds to wait for its ranks to finish their
#                    save before this script exits (default 40; launch/run_launcher.sh)
# Everything on the command line is passed to launch/train.py: --config FILE (required),
# --set key=value ... Relative paths inside the config and in --set values are taken from the
# repository root (as in demo.sh); --config may be relative to the current directory.
set -euo pipefail

die() { echo "single_node.sh: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

CONFIG=""
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --config) [ $# -ge 2 ] || die "--config needs a value"; CONFIG=$2; shift 2 ;;
    --config=*) CONFIG=${1#--config=}; shift ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done
[ -n "$CONFIG" ] || die "no config: pass --config FILE (a YAML run config, e.g. configs/demo.yaml)"
[ -f "$CONFIG" ] || die "config $CONFIG does not exist"
for n in NUM_RANKS MASTER_PORT STOP_WAIT_S; do
  # a leading zero would make bash's arithmetic read the number as octal (08: "value too great for base")
  case "${!n:-}" in *[!0-9]*|0[0-9]*) die "$n must be a non-negative integer without leading zeros, got '${!n}'" ;; esac
done
if [ -n "${MASTER_PORT:-}" ] && { [ ${#MASTER_PORT} -gt 5 ] || [ "$((10#$MASTER_PORT))" -lt 1 ] \
    || [ "$((10#$MASTER_PORT))" -gt 65535 ]; }; then  # length first: bash arithmetic wraps at 2^64
  die "MASTER_PORT must be a port number, 1-65535 (got $MASTER_PORT)"
fi
CONFIG=$(CDPATH='' cd -- "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")  # CDPATH: cd would print the dir

cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DEEPSPEED=${DEEPSPEED:-deepspeed}
command -v "$DEEPSPEED" >/dev/null || die "launcher $DEEPSPEED not found (run launch/setup.sh, or use the docker image)"
# the Python next to the launcher (its environment's torch), not whatever `python` PATH has, if any
PY=$(dirname "$(command -v "$DEEPSPEED")")/python
[ -x "$PY" ] || PY=python3

ranks_arg=(--num_accelerators "${NUM_RANKS:-}")
if [ "${DS_ACCELERATOR:-}" = cpu ]; then
  # CPU ranks on purpose (docs/cluster.md), GPUs or not: 2 by default, and no --include of GPU ids
  # (DeepSpeed's CPU accelerator has no such slots: "No slot '1' specified on host 'localhost'")
  gpus=0
  NUM_RANKS=${NUM_RANKS:-2}
  ranks_arg=(--num_accelerators "$NUM_RANKS")
elif [ -z "${NUM_RANKS:-}" ]; then
  # GPUs torch cannot use (a CPU build, an old driver) stop here rather than train on CPU unnoticed
  gpus=$("$PY" -c 'import sys, torch
from ascender_dist.config.errors import UserError
from ascender_dist.parallel.setup import check_gpus_usable
try:
    check_gpus_usable()
except UserError as exc:
    sys.exit(f"single_node.sh: error: {exc}")
print(torch.cuda.device_count())') || exit 2
  NUM_RANKS=$(( gpus > 0 ? gpus : 2 ))
  ranks_arg=(--num_accelerators "$NUM_RANKS")
  [ "$gpus" -gt 0 ] || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
else
  gpus=$( (compgen -G "/dev/nvidia[0-9]*" || true) | wc -l)  # device nodes: no torch import
fi
[ "$NUM_RANKS" -ge 1 ] || die "NUM_RANKS must be at least 1"
# the ranks take the GPUs CUDA_VISIBLE_DEVICES lists (visible_gpu_include)
# shellcheck source=launch/run_launcher.sh
. launch/run_launcher.sh
if [ "$gpus" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  include=$(visible_gpu_include "$NUM_RANKS" "$CUDA_VISIBLE_DEVICES") || die "$include"
  [ -z "$include" ] || ranks_arg=(--include "$include")
fi
MASTER_PORT=${MASTER_PORT:-$("$PY" -c 'from ascender_dist.ports import free_port; print(free_port())')}
# The launcher leaves OMP_NUM_THREADS unset: every rank would use every core.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NUM_RANKS > 0 ? cores / NUM_RANKS : 1 ))}

echo "single_node.sh: $NUM_RANKS ranks, $OMP_NUM_THREADS threads each, port $MASTER_PORT" >&2
# SIGTERM to this script: the ranks save and stop (exit 75); SIGUSR1 is for the ranks (launch/run_launcher.sh)
rc=0
# --hostfile /dev/null: this machine alone, even where DeepSpeed's default /job/hostfile exists
run_launcher local "$DEEPSPEED" --hostfile /dev/null ${ranks_arg[@]+"${ranks_arg[@]}"} --master_port "$MASTER_PORT" \
  launch/train.py --config "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} || rc=$?
exit "$rc"
