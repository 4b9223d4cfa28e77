# shellcheck shell=bash
# Sourced by single_node.sh and multi_node.sh: run_launcher MODE CMD... runs the `deepspeed` launcher
# and waits for it, so that a stop request sent to the script alone reaches the ranks.
#
# `docker stop` (through docker's --init), Kubernetes and `kill <script pid>` signal this script's
# process only. Had it exec'd the launcher, DeepSpeed's runner would die of that SIGTERM at once (no
# handler outside pdsh mode) and leave its launch.py and the ranks running as orphans without the
# signal, until the container's end killed them mid-step. Instead:
#   MODE local  (single node, or multi-node --node_rank): the launcher runs in its own process group
#               and a SIGTERM or SIGUSR1 here becomes SIGUSR1 to that group: the ranks save at the
#               next step boundary and exit 75 (train.exit_signals), the launcher ignores SIGUSR1 and
#               ends with them. SIGINT (Ctrl-C, which no longer reaches that group from the terminal)
#               is passed on as it is.
#   MODE ssh    (multi-node over pdsh): the ranks are on other hosts; SIGTERM and SIGINT go to the
#               runner, whose own handler ends the remote launchers (they stop their ranks).
# SIGUSR1 (a scheduler's warning, e.g. slurm.sbatch's --signal, sent to every process of the job) is
# for the ranks: the launcher processes ignore it (its default action would end them, and the job,
# at once); the ranks inherit the ignore and install their own handler for training.
# The exit status is the launcher's (75 after a stop on request).
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
    trap 'kill -USR1 -- "-$child" 2>/dev/null || true' TERM USR1
    trap 'kill -INT -- "-$child" 2>/dev/null || true' INT
  else
    "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    trap 'kill -INT "$child" 2>/dev/null || true' INT
  fi
  while :; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal ended the wait, not the launcher
  done
  if [ "$rc" -gt 128 ]; then  # the launcher may have ended between an interrupted wait and the test
    local again=0
    wait "$child" 2>/dev/null || again=$?
    [ "$again" -eq 127 ] || rc=$again
  fi
  return "$rc"
}
