# shellcheck shell=bash
# Sourced by single_node.sh and multi_node.sh: run_launcher MODE CMD... runs the `deepspeed` launcher
# and waits for it, so that a stop request sent to the script alone reaches the ranks.
#
# `docker stop` (through docker's --init), Kubernetes and `kill <script pid>` signal this script's
# process only. Had it exec'd the launcher, DeepSpeed's runner would die of that SIGTERM at once (it
# has no handler unless it drives other hosts over pdsh) and leave its launch.py and the ranks running
# as orphans without the signal, until the container's end killed them mid-step. Instead:
#   MODE local  (the ranks are on this host: single_node.sh, multi_node.sh --node_rank, or a one-host
#               hostfile): the launcher runs in its own process group, and a SIGTERM or SIGUSR1 here
#               becomes SIGUSR1 to that group: the ranks save at the next step boundary and exit 75
#               (train.exit_signals must keep SIGUSR1), the launcher ignores SIGUSR1 and ends with
#               them. A second SIGTERM is passed on as SIGTERM (DeepSpeed's launch.py then stops its
#               ranks): a rank still starting up, before it watches its signals, ignores SIGUSR1.
#               SIGINT (Ctrl-C, which no longer reaches that group from the terminal) and SIGHUP are
#               passed on as they are. A rank reading the terminal (breakpoint()) is stopped by
#               SIGTTIN: debug with the launcher started directly.
#   MODE ssh    (multi-node over pdsh): the ranks are on other hosts; SIGTERM, SIGINT and SIGHUP go to
#               the runner, whose own handler ends the remote launchers (pkill; no save, exit 1).
# SIGUSR1 (a scheduler's warning, e.g. slurm.sbatch's --signal, sent to every process of the job) is
# for the ranks: the launcher processes ignore it (its default action would end them, and the job,
# at once); the ranks inherit the ignore and install their own handler for training.
# The exit status is the launcher's (75 after a stop on request; 1 when it exits 0 with ranks still
# running, which DeepSpeed's runner does after its launch.py died of a signal). If the launcher itself ended
# abnormally (local mode), what is left of its process group is asked to stop and waited for, up to
# STOP_WAIT_S seconds (default 40: DeepSpeed's launch.py gives its ranks 30 s after a SIGTERM before
# SIGKILL), so that a checkpoint being saved is not cut by this script's exit (Slurm ends a step's
# processes when the task's main process exits, a container when its init's child does). A launcher
# killed by SIGTERM gets SIGUSR1 sent after it, not another SIGTERM: the SIGTERM came from a scheduler
# that signals every process of the job, launch.py included (a second one interrupts its wait for the
# ranks); a SIGKILLed or failed launcher's group gets SIGTERM. Whatever still runs after STOP_WAIT_S
# gets SIGTERM and is left behind. A SIGKILL to this script's own process group (not the launcher's)
# cannot be passed on.
_launcher_terms=0

visible_gpu_include() {  # $1: ranks, $2: CUDA_VISIBLE_DEVICES; prints the launcher's --include value
  # DeepSpeed's --num_accelerators drops CUDA_VISIBLE_DEVICES and takes GPUs 0..N-1 (another job's on a
  # shared node); --include names the physical GPUs, by index only (a UUID crashes its parser). Prints
  # nothing for a value that hides every GPU (-1...); a one-line error and status 2 for one it cannot use.
  local ranks=$1 visible=$2 listed
  [ "${visible#-}" = "$visible" ] || return 0
  case ",$visible," in
    *,,*|*[!0-9,]*) echo "CUDA_VISIBLE_DEVICES=$visible: GPU indices needed (DeepSpeed's --include takes no UUIDs)"; return 2 ;;
  esac
  IFS=, read -r -a listed <<< "$visible"
  if [ "$ranks" -gt "${#listed[@]}" ]; then
    echo "NUM_RANKS=$ranks ranks, but CUDA_VISIBLE_DEVICES=$visible lists ${#listed[@]} GPUs"
    return 2
  fi
  echo "localhost:$(IFS=,; echo "${listed[*]:0:$ranks}")"
}

ignored_gpus_problem() {  # $1: ranks per node, $2: CUDA_VISIBLE_DEVICES, $3: GPUs the node shows (nvidia-smi)
  # With a hostfile DeepSpeed gives each node's ranks GPUs 0..N-1 of what the node shows and drops
  # CUDA_VISIBLE_DEVICES. Where the node shows more GPUs than the variable lists (no device cgroup
  # renumbering them), other GPUs than the listed ones would be used: perhaps another job's. Prints
  # that in one line with status 2; nothing for a value it cannot mislead (unset, hiding every GPU).
  local ranks=$1 visible=$2 shown=$3 listed expected
  [ -n "$visible" ] && [ "${visible#-}" = "$visible" ] || return 0
  IFS=, read -r -a listed <<< "$visible"
  expected=$(seq -s, 0 $(( ranks - 1 )))
  if [ "$(IFS=,; echo "${listed[*]:0:$ranks}")" != "$expected" ] && [ "$shown" -gt ${#listed[@]} ]; then
    echo "CUDA_VISIBLE_DEVICES=$visible, but the multi-node launcher ignores it and would give this node's $ranks ranks GPUs $expected of the $shown it shows: give the job whole nodes, or GPUs through the scheduler's device isolation (cgroups, containers)"
    return 2
  fi
}

_launcher_term() {  # $1: the launcher's pid; local mode
  _launcher_terms=$((_launcher_terms + 1))
  if [ "$_launcher_terms" -eq 1 ]; then
    kill -USR1 -- "-$1" 2>/dev/null || true
  else
    kill -TERM -- "-$1" 2>/dev/null || true
  fi
}

_launcher_group_alive() {  # $1: a process group id; true while a member has not exited
  if command -v ps >/dev/null; then  # zombies count for kill -0: orphans wait for a reaper
    ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
  else
    kill -0 -- "-$1" 2>/dev/null
  fi
}

_launcher_group_wait() {  # $1: the launcher's pid (its process group); false after STOP_WAIT_S
  local deadline=$((SECONDS + ${STOP_WAIT_S:-40}))
  while _launcher_group_alive "$1"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

run_launcher() {
  local mode=$1 child rc
  shift
  trap '' USR1
  if [ "$mode" = local ]; then
    set -m  # job control: the background launcher gets its own process group, pgid = its pid
    "$@" &
    child=$!
    set +m
    # the launcher ignores SIGUSR1 from its start (inherited); from here on this shell passes it on
    trap 'kill -USR1 -- "-$child" 2>/dev/null || true' USR1
    trap '_launcher_term "$child"' TERM
    trap 'kill -INT -- "-$child" 2>/dev/null || true' INT
    trap 'kill -HUP -- "-$child" 2>/dev/null || true' HUP
  else
    "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    trap 'kill -INT "$child" 2>/dev/null || true' INT
    trap 'kill -HUP "$child" 2>/dev/null || true' HUP
  fi
  while :; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal ended the wait, not the launcher
  done
  if [ "$rc" -gt 128 ] || [ "$rc" -lt 0 ]; then  # the launcher may have ended between an interrupted wait and the test
    local again=0
    wait "$child" 2>/dev/null || again=$?
    case "$again" in 127|-*) ;; *) rc=$again ;; esac  # 127: no such job; -1: below
  fi
  # bash 5.2 may report -1 for a launcher that ended while a trap ran: its status is lost. After a
  # trapped SIGTERM it is taken as 143 (a stop), else as a failure
  if [ "$rc" -lt 0 ]; then rc=$(( _launcher_terms > 0 ? 143 : 1 )); fi
  # DeepSpeed's runner exits 0 when its launch.py died of a signal (it only passes on codes > 0), with
  # the ranks still training: a clean exit leaves nothing behind (W&B's service runs in its own session)
  local grace=$(( ${STOP_WAIT_S:-40} < 10 ? ${STOP_WAIT_S:-40} : 10 ))
  if [ "$mode" = local ] && [ "$rc" -eq 0 ] && ! STOP_WAIT_S=$grace _launcher_group_wait "$child"; then
    echo "run_launcher: the launcher exited 0 but its processes still run $grace s later (its launch.py was killed?): stopping them, exit status 1" >&2
    rc=1
  fi
  if [ "$mode" = local ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 75 ] && _launcher_group_alive "$child"; then
    # launch.py and the ranks the launcher left behind (a killed runner) may be saving a checkpoint
    if [ "$rc" -eq 143 ]; then
      kill -USR1 -- "-$child" 2>/dev/null || true  # they had the SIGTERM too; ranks record one stop request
    else
      kill -TERM -- "-$child" 2>/dev/null || true
    fi
    if ! _launcher_group_wait "$child"; then
      echo "run_launcher: the launcher's processes still run ${STOP_WAIT_S:-40} s after it ended (STOP_WAIT_S): sending SIGTERM and leaving them" >&2
      kill -TERM -- "-$child" 2>/dev/null || true
    fi
  fi
  return "$rc"
}
