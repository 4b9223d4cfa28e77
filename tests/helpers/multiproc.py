"""Run a function on N real processes over gloo on localhost, several checks per launch.

Each launch costs 10-20 s (importing megatron and DeepSpeed), so a worker function runs MANY
named checks and returns ``{check_name: result}``; pytest tests then assert on those results.

    results = run_ranks("tests.distributed.workers.gpt_parity:main", world_size=2)
    results[rank]["tp2_matches_tp1"]  # whatever the check returned (or raised)

- every rank is a fresh ``python -m tests.helpers.multiproc`` process with RANK/WORLD_SIZE/
  LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (what torchrun or the deepspeed launcher would set);
- the whole process group is killed on timeout (no stray ranks holding ports);
- each rank's failure is reported with the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil

from ascender_dist.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


class RankFailure(AssertionError):
    pass




def start_launcher_job(config: Path, stdout: Path, stderr: Path | None = None, *extra: str) -> subprocess.Popen:
    """A 2-rank training job of ``launch/train.py`` through the real ``deepspeed`` launcher, in its own
    process group (so :func:`wait_job` can kill all of it); stderr joins stdout unless given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    deepspeed = Path(sys.executable).with_name("deepspeed")
    err = open(stderr, "w") if stderr is not None else subprocess.STDOUT
    return subprocess.Popen([str(deepspeed), "--num_accelerators", "2", "--master_port", str(free_port()),
                             "launch/train.py", "--config", str(config), *extra], cwd=REPO_ROOT, env=env,
                            stdout=open(stdout, "a"), stderr=err, start_new_session=True)


def wait_job(proc: subprocess.Popen, timeout: float) -> int:
    """The job's exit status; past ``timeout`` its whole process group and every descendant (the launch
    scripts start the launcher in a process group of its own) are killed and TimeoutExpired raised."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        descendants = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.wait()
        raise


def run_job_ok(config: Path, log: Path, timeout: float, *extra: str) -> None:
    """Run a launcher job (stderr into ``log``) and fail with the log's tail unless it exits 0."""
    status = wait_job(start_launcher_job(config, log, None, *extra), timeout)
    assert status == 0, f"job {config.name} exited {status}; {log}:\n{_tail(log, 60)}"


def _tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_ranks(target: str, world_size: int, *, timeout: float = 300.0, args: dict | None = None,
              env: dict | None = None, attempts: int = 3, exits: dict[int, int] | None = None) -> list[dict]:
    """Run ``module:function(args) -> dict`` on ``world_size`` ranks; return each rank's dict.

    ``exits``: ranks expected to end their process with that status instead of returning (their
    dict is {}; any other status, or 0, is a failure).

    The rendezvous port is picked free but can be taken by another process before rank 0 binds
    it (EADDRINUSE): such a launch is retried with a new port."""
    for attempt in range(attempts):
        try:
            return _run_ranks_once(target, world_size, timeout=timeout, args=args, env=env, exits=exits or {})
        except RankFailure as exc:
            if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _run_ranks_once(target: str, world_size: int, *, timeout: float, args: dict | None,
                    env: dict | None, exits: dict[int, int]) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="ranks_"))
    port = free_port()
    base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    (workdir / "args.json").write_text(json.dumps(args or {}))
    procs = []
    for rank in range(world_size):
        rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.multiproc", target, str(workdir)],
            env=rank_env, cwd=REPO_ROOT, start_new_session=True,
            stdout=open(workdir / f"rank{rank}.out", "w"), stderr=open(workdir / f"rank{rank}.err", "w"),
        ))
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        if any(p.poll() not in (None, 0, exits.get(rank)) for rank, p in enumerate(procs)):
            time.sleep(5)  # give peers a moment to report their own error, then stop everyone
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failures = []
    results = []
    for rank, p in enumerate(procs):
        out = workdir / f"rank{rank}.json"
        if rank in exits and p.returncode == exits[rank]:
            results.append({})
        elif rank in exits or p.returncode != 0 or not out.exists():
            why = "timed out" if timed_out and p.returncode == -signal.SIGKILL else f"exit {p.returncode}"
            why += f" (expected exit {exits[rank]})" if rank in exits else ""
            failures.append(f"rank {rank}: {why}\n{_tail(workdir / f'rank{rank}.err')}")
            results.append({})
        else:
            results.append(json.loads(out.read_text()))
    if failures:
        raise RankFailure(f"{target} on {world_size} ranks failed ({workdir}):\n" + "\n".join(failures))
    return results


def run_checks(checks: dict) -> dict:
    """Run named zero-argument checks in order; a raising check records its error, later ones still run.

    Checks that call collectives must run on every rank in the same order (they do: same code)."""
    results = {}
    for name, check in checks.items():
        try:
            results[name] = {"ok": True, "value": check()}
        except Exception as exc:  # reported per check, per rank, by the pytest side
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=8)}
    return results


def assert_check(results: list[dict], name: str):
    """Assert that check ``name`` passed on every rank; return the per-rank values."""
    missing = [r for r, res in enumerate(results) if name not in res]
    if missing:
        raise AssertionError(f"check {name} did not run on ranks {missing}")
    errors = [f"rank {r}: {res[name]['error']}\n{res[name]['traceback']}"
              for r, res in enumerate(results) if not res[name]["ok"]]
    if errors:
        raise AssertionError(f"check {name} failed:\n" + "\n".join(errors))
    return [res[name]["value"] for res in results]


def _rank_main(target: str, workdir: str) -> None:
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    args = json.loads((Path(workdir) / "args.json").read_text())
    result = fn(args)
    rank = int(os.environ["RANK"])
    tmp = Path(workdir) / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, Path(workdir) / f"rank{rank}.json")
    # end torch.distributed on every rank together, as the trainer does: groups left to interpreter
    # exit were torn down by each rank alone, and a rank whose results were all written once died
    # there with SIGABRT ("terminate called without an active exception") in a CI run
    from ascender_dist.parallel.setup import shutdown_process_group

    shutdown_process_group()


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()
    _rank_main(sys.argv[1], sys.argv[2])
