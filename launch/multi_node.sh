#!/usr/bin/env bash
# Multi-node training through the `deepspeed` launcher and a hostfile (docs/cluster.md).
#
# Two ways to start it:
#   ssh mode (default): run it on ONE node; DeepSpeed starts the ranks of every hostfile host over
#     pdsh + passwordless ssh.
#       bash launch/multi_node.sh --hostfile hosts --config configs/x.yaml [--set key=value ...]
#   no-ssh mode (--node_rank R): run it on EVERY node yourself (SLURM srun, containers, k8s), with
#     the same hostfile, --master_addr and --master_port everywhere; R is this node's line in the hostfile.
#       bash launch/multi_node.sh --hostfile hosts --node_rank 0 --master_addr node-001 --config ...
#
# Launcher options (flag, as --flag VALUE or --flag=VALUE, or the environment variable next to it):
#   --hostfile FILE      HOSTFILE       required: lines "<host> slots=<ranks>" (launch/hostfile.example)
#   --master_addr ADDR   MASTER_ADDR    address of the first host that every node can reach
#                                       (default: the first hostfile host)
#   --master_port PORT   MASTER_PORT    rendezvous port on the first host (default 29500)
#   --node_rank R        NODE_RANK      no-ssh mode: start only this node's ranks
#   --num_nodes N        NUM_NODES      use only the first N hostfile hosts (default: all)
#   --gpus_per_node N    GPUS_PER_NODE  ranks on every node (default: each host's slots)
#   --ssh_port PORT      SSH_PORT       ssh mode: the port of the sshd on every host (default: ssh's)
#   DEEPSPEED      the launcher command (default: deepspeed, from .venv/bin if there, else PATH)
#   STOP_WAIT_S    after a launcher killed on a stop (this node's ranks), seconds to wait for them to
#                  finish their save before this script exits (default 40; launch/run_launcher.sh)
#   STOPPED_MARK   a file to create, exiting 0 instead of 75, when the ranks stopped cleanly (75: saved,
#                  run the same command again): slurm.sbatch's srun ends every task at the first non-zero
#                  exit, which would cut the other nodes' teardown short and hide the 75 from the job
# ssh mode forwards NCCL_* (also when DeepSpeed sees no GPU on this node), PYTHON*, OMP_NUM_THREADS,
# DS_ACCELERATOR, GLOO_SOCKET_IFNAME, TORCH_NCCL_ASYNC_ERROR_HANDLING, CUDA_DEVICE_MAX_CONNECTIONS, the
# names in FORWARD_ENV and the lines of DeepSpeed's env files (DS_ENV_FILE, default .deepspeed_env, in
# ~ and the repository root); it passes train.py's arguments through each host's shell, so values with
# quotes, $, globs and the like are refused there (put them in the config file, or use --node_rank).
# Everything else is passed to launch/train.py: --config FILE (required), --set key=value ...
# Relative paths inside the config and in --set values are taken from the repository root (as in
# demo.sh); --config and --hostfile may be relative to the current directory.
# Assumes: the repository and its .venv (or the docker image) at the same path on every node, and
# output_dir on storage shared by all nodes (checkpoints are written by every rank into one folder).
set -euo pipefail

die() { echo "multi_node.sh: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

HOSTFILE=${HOSTFILE:-}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-}
NUM_NODES=${NUM_NODES:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-}
SSH_PORT=${SSH_PORT:-}
STOP_WAIT_S=${STOP_WAIT_S:-}
CONFIG=""
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hostfile|--master_addr|--master_port|--node_rank|--num_nodes|--gpus_per_node|--ssh_port|--config)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --hostfile) HOSTFILE=$2 ;;
        --master_addr) MASTER_ADDR=$2 ;;
        --master_port) MASTER_PORT=$2 ;;
        --node_rank) NODE_RANK=$2 ;;
        --num_nodes) NUM_NODES=$2 ;;
        --gpus_per_node) GPUS_PER_NODE=$2 ;;
        --ssh_port) SSH_PORT=$2 ;;
        --config) CONFIG=$2 ;;
      esac
      shift 2 ;;
    --hostfile=*|--master_addr=*|--master_port=*|--node_rank=*|--num_nodes=*|--gpus_per_node=*|--ssh_port=*|--config=*)
      value=${1#*=}
      case "${1%%=*}" in
        --hostfile) HOSTFILE=$value ;;
        --master_addr) MASTER_ADDR=$value ;;
        --master_port) MASTER_PORT=$value ;;
        --node_rank) NODE_RANK=$value ;;
        --num_nodes) NUM_NODES=$value ;;
        --gpus_per_node) GPUS_PER_NODE=$value ;;
        --ssh_port) SSH_PORT=$value ;;
        --config) CONFIG=$value ;;
      esac
      shift ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done

[ -n "$HOSTFILE" ] || die "no hostfile: pass --hostfile FILE or set HOSTFILE (format: launch/hostfile.example)"
[ -f "$HOSTFILE" ] || die "hostfile $HOSTFILE does not exist"
[ -n "$CONFIG" ] || die "no config: pass --config FILE (a YAML run config, e.g. configs/demo.yaml)"
[ -f "$CONFIG" ] || die "config $CONFIG does not exist"
for n in MASTER_PORT NODE_RANK NUM_NODES GPUS_PER_NODE SSH_PORT STOP_WAIT_S; do
  # a leading zero would make bash's arithmetic read the number as octal (08: "value too great for base")
  case "${!n}" in *[!0-9]*|0[0-9]*) die "$n must be a non-negative integer without leading zeros, got '${!n}'" ;; esac
done
if [ -z "$MASTER_PORT" ] || [ ${#MASTER_PORT} -gt 5 ] || [ "$((10#$MASTER_PORT))" -lt 1 ] \
    || [ "$((10#$MASTER_PORT))" -gt 65535 ]; then  # length first: bash arithmetic wraps at 2^64
  die "MASTER_PORT must be a port number, 1-65535 (got $MASTER_PORT)"
fi
# CDPATH='': with CDPATH exported, cd prints the directory it found and the path would hold it twice
HOSTFILE=$(CDPATH='' cd -- "$(dirname "$HOSTFILE")" && pwd)/$(basename "$HOSTFILE")
CONFIG=$(CDPATH='' cd -- "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")

# The hostfile, parsed as DeepSpeed does: "<host> slots=<n>", '#' comments, blank lines and a
# trailing carriage return (a file written on Windows) ignored.
mapfile -t HOSTS < <(awk '{sub(/\r$/, "")} /^[[:space:]]*(#|$)/ {next}
  $2 ~ /^slots=[0-9]+$/ && seen[$1]++ {print "DUP " NR " " $1; exit}
  $2 ~ /^slots=[0-9]+$/ {print $1, substr($2, 7); next}
  {print "BAD " NR ": " $0; exit}' "$HOSTFILE")
[ ${#HOSTS[@]} -gt 0 ] || die "hostfile $HOSTFILE lists no host (format: launch/hostfile.example)"
last=${HOSTS[${#HOSTS[@]}-1]}
case "$last" in
  "BAD "*) die "hostfile $HOSTFILE line ${last#BAD } is not '<host> slots=<n>'" ;;
  "DUP "*) read -r _ line host <<< "$last"
           die "hostfile $HOSTFILE line $line lists $host a second time (one line per host)" ;;
esac
[ -z "$NUM_NODES" ] || [ "$NUM_NODES" -ge 1 ] || die "NUM_NODES must be at least 1"
[ -z "$NUM_NODES" ] || [ "$NUM_NODES" -le ${#HOSTS[@]} ] ||
  die "--num_nodes $NUM_NODES but the hostfile lists ${#HOSTS[@]} hosts (DeepSpeed would run on those alone)"
if [ -n "$NUM_NODES" ] && [ "$NUM_NODES" -lt ${#HOSTS[@]} ]; then HOSTS=("${HOSTS[@]:0:$NUM_NODES}"); fi
[ -n "$MASTER_ADDR" ] || MASTER_ADDR=${HOSTS[0]%% *}
# A loopback rendezvous (a MASTER_ADDR left from local runs, a hostfile starting with localhost) is
# each node's own: the other nodes would wait out the distributed timeout (slurm.sbatch refuses it too)
is_loopback() { case "$1" in localhost|127.*|::1) return 0 ;; esac; return 1; }
# Whether a hostfile's host is the machine this script runs on (loopback, its hostname, or a name
# that resolves to one of its addresses)
is_this_machine() {
  is_loopback "$1" && return 0
  case "$1" in "$(hostname)"|"$(hostname -s 2>/dev/null)"|"$(hostname -f 2>/dev/null)") return 0 ;; esac
  # ahosts: forward resolution for names and address literals alike (hosts does a reverse lookup
  # for an address, which fails without a PTR record); every address it gives is tried
  local addr
  for addr in $(getent ahosts "$1" 2>/dev/null | awk '{print $1}' | sort -u); do
    is_loopback "$addr" && return 0
    hostname -I 2>/dev/null | tr ' ' '\n' | grep -qxF -- "$addr" && return 0
  done
  return 1
}
if is_loopback "$MASTER_ADDR" && [ ${#HOSTS[@]} -gt 1 ]; then
  for entry in "${HOSTS[@]}"; do  # hosts that all name this machine are fine (tests/integration/test_multinode.py)
    is_loopback "${entry%% *}" ||
      die "MASTER_ADDR=$MASTER_ADDR is this node only, but the hostfile also lists ${entry%% *}: set --master_addr (or MASTER_ADDR) to the first host's address"
  done
fi

cd "$(dirname "$0")/.."
# shellcheck source=launch/run_launcher.sh
. launch/run_launcher.sh
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DEEPSPEED=${DEEPSPEED:-deepspeed}
command -v "$DEEPSPEED" >/dev/null || die "launcher $DEEPSPEED not found (run launch/setup.sh, or use the docker image)"

cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
[ -z "$NUM_NODES" ] || cmd+=(--num_nodes "$NUM_NODES")
[ -z "$GPUS_PER_NODE" ] || cmd+=(--num_accelerators "$GPUS_PER_NODE")
[ -z "$SSH_PORT" ] || [ -n "$NODE_RANK" ] || cmd+=(--ssh_port "$SSH_PORT")
if [ -n "$NODE_RANK" ]; then
  [ "$NODE_RANK" -lt ${#HOSTS[@]} ] || die "--node_rank $NODE_RANK but the hostfile lists ${#HOSTS[@]} hosts"
  local_host=${HOSTS[$NODE_RANK]}
  # node rank 0 hosts the rendezvous at MASTER_ADDR: elsewhere every rank waits out the timeout and then
  # blames the network (a warning: a service name or NAT may reach this node under another address)
  if [ "$NODE_RANK" -eq 0 ] && ! is_this_machine "$MASTER_ADDR"; then
    echo "multi_node.sh: warning: --node_rank 0 hosts the rendezvous, but MASTER_ADDR=$MASTER_ADDR does not name this machine ($(hostname)); if the ranks then wait for the rendezvous, set MASTER_ADDR to this node's address or run --node_rank 0 on $MASTER_ADDR" >&2
  fi
else
  # DeepSpeed starts a one-host hostfile locally, without pdsh: right when the host is this machine;
  # another one (a compute node named from a login node) is reached over pdsh only with --force_multi
  over_pdsh=0
  if [ ${#HOSTS[@]} -gt 1 ] || ! is_this_machine "${HOSTS[0]%% *}"; then over_pdsh=1; fi
  [ ${#HOSTS[@]} -gt 1 ] || [ "$over_pdsh" -eq 0 ] || cmd+=(--force_multi)
  if [ "$over_pdsh" -eq 1 ]; then
    command -v pdsh >/dev/null || die "pdsh not found: install it (ssh mode), or start every node yourself with --node_rank"
    case "$PWD" in  # DeepSpeed's pdsh runner sends every host an unquoted 'cd <repo>; <python> ...'
      *[[:space:]]*) die "ssh mode cannot start ranks in a path with spaces ($PWD): DeepSpeed's remote command does not quote it; move the repository, or start every node yourself with --node_rank" ;;
    esac
    # ...and the arguments of train.py, through the remote shell: DeepSpeed only wraps one holding a
    # space in "...", so quotes, $, `, globs and the like would be changed or run there (on every
    # host alike, so no config-hash check could notice); pdsh replaces %h, %n, %u and %% first
    for arg in "$PWD" "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}; do
      case "$arg" in
        *[!A-Za-z0-9\ _./:=,+@-]*) die "ssh mode passes '$arg' through each host's shell unquoted, which would change it: put the value in the config file (only letters, digits, spaces and _./:=,+@- pass), or start every node yourself with --node_rank" ;;
      esac
    done
  fi
  for entry in "${HOSTS[@]}"; do  # DeepSpeed would end in a traceback for an unreachable one
    ssh -o BatchMode=yes -o ConnectTimeout=10 ${SSH_PORT:+-p "$SSH_PORT"} "${entry%% *}" true </dev/null >/dev/null 2>&1 ||
      die "host ${entry%% *} is not reachable by passwordless ssh${SSH_PORT:+ on port $SSH_PORT} (ssh mode needs it; or start every node yourself with --node_rank)"
  done
  local_host=${HOSTS[0]}  # nodes are assumed alike: threads per rank are computed here for all
fi
if command -v getent >/dev/null; then  # else every rank would wait out the rendezvous timeout
  getent ahosts "$MASTER_ADDR" >/dev/null || die "master address $MASTER_ADDR does not resolve on this node (set MASTER_ADDR, or fix the hostfile's first host)"
fi
local_ranks=${GPUS_PER_NODE:-${local_host##* }}
[ "$local_ranks" -ge 1 ] || die "no ranks on this node (slots=0)"
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && command -v nvidia-smi >/dev/null; then  # (ignored_gpus_problem)
  shown=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  problem=$(ignored_gpus_problem "$local_ranks" "$CUDA_VISIBLE_DEVICES" "$shown") || die "$problem"
fi

# The launcher leaves OMP_NUM_THREADS unset: every rank would use every core.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / local_ranks > 0 ? cores / local_ranks : 1 ))}

# The DeepSpeed env files (the name in DS_ENV_FILE, default .deepspeed_env, under ~ and .; an absolute
# path as it is): DeepSpeed reads them on its pdsh path only
user_env=${DS_ENV_FILE:-.deepspeed_env}
case "$user_env" in /*) env_files=("$user_env") ;; *) env_files=("${HOME:-/nonexistent}/$user_env" "$user_env") ;; esac
if [ -n "$NODE_RANK" ]; then
  # This node only: no ssh; the ranks inherit this environment (NCCL_*, OMP_NUM_THREADS, ...), with
  # the env files' KEY=VALUE lines exported as the pdsh path exports them (NCCL_IB_HCA kept there
  # would be lost under slurm.sbatch or a container otherwise)
  for f in "${env_files[@]}"; do
    [ -f "$f" ] || continue
    while IFS= read -r line; do export "${line%$'\r'}"; done < <(grep -E '^[A-Za-z_][A-Za-z0-9_]*=' "$f" || true)
  done
  cmd+=(--no_ssh --node_rank "$NODE_RANK")
else
  # pdsh forwards only NCCL_*, PYTHON*, UCX_*, MV2_*, MLFLOW_* and what a DeepSpeed env file lists.
  env_file=$(mktemp "${TMPDIR:-/tmp}/ascender-ds-env.XXXXXX")
  trap 'rm -f "$env_file"' EXIT
  # Setting DS_ENV_FILE hides the env files DeepSpeed would read: carry them over.
  for f in "${env_files[@]}"; do [ ! -f "$f" ] || grep -E '^[A-Za-z_][A-Za-z0-9_]*=' "$f" >> "$env_file" || true; done
  read -ra extra_env <<< "${FORWARD_ENV:-}"
  # NCCL_* too: DeepSpeed forwards them only when it finds a GPU on this node (its CUDA accelerator's
  # export_envs); started from a login node or a CPU-only torch, NCCL_SOCKET_IFNAME would stay behind
  mapfile -t nccl_env < <(compgen -e | grep -E '^NCCL_' || true)
  for n in OMP_NUM_THREADS DS_ACCELERATOR CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING \
           GLOO_SOCKET_IFNAME ${nccl_env[@]+"${nccl_env[@]}"} ${extra_env[@]+"${extra_env[@]}"}; do
    case "${!n:-}" in *$'\n'*) die "ssh mode cannot forward $n: its value holds a newline (set it in each host's environment, or start every node yourself with --node_rank)" ;; esac
    [ -z "${!n:-}" ] || printf '%s=%s\n' "$n" "${!n}" >> "$env_file"
  done
  # DeepSpeed writes each as export NAME="value" into the remote command: inside "..." the remote
  # shell still reads $, `, " and \ (a value would change or run there, on every host alike), and
  # pdsh first replaces %h, %u, %n and %% in the whole command (its own per-host placeholders)
  while IFS= read -r line; do
    case "${line#*=}" in
      *[\$\`\"\\%]*) die "ssh mode forwards ${line%%=*} to every host inside \"...\", where its value '${line#*=}' would change (\$, \`, \" and \\ are read by the remote shell, % by pdsh): set it in each host's environment, or start every node yourself with --node_rank" ;;
    esac
  done < "$env_file"
  export DS_ENV_FILE="$env_file"
fi
cmd+=(launch/train.py --config "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
echo "multi_node.sh: ${#HOSTS[@]} nodes, $local_ranks ranks per node, master $MASTER_ADDR:$MASTER_PORT${NODE_RANK:+, this node rank $NODE_RANK}" >&2
# SIGTERM to this script: with the ranks on this host (--node_rank, or one host) they save and stop
# (exit 75); over pdsh the runner ends the remote launchers. SIGUSR1 (a scheduler's warning, e.g.
# slurm.sbatch's --signal) is for the ranks, not the launcher (launch/run_launcher.sh)
mode=ssh
if [ -n "$NODE_RANK" ] || [ "${over_pdsh:-0}" -eq 0 ]; then mode=local; fi  # this machine alone: no pdsh
rc=0
run_launcher "$mode" "${cmd[@]}" || rc=$?
if [ "$rc" -eq 75 ] && [ -n "${STOPPED_MARK:-}" ]; then
  : > "$STOPPED_MARK" || die "cannot create STOPPED_MARK $STOPPED_MARK (the ranks stopped cleanly: exit 75)"
  exit 0
fi
exit "$rc"
