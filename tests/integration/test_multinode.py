"""Two 'nodes' on one machine through launch/multi_node.sh train exactly like one node with 2 ranks.

Each node is its own `deepspeed` launcher process in no-ssh mode (what launch/slurm.sbatch runs on
every node), 1 local rank each, sharing a two-host hostfile ('localhost' and '127.0.0.1', the
names DeepSpeed maps ranks by):

    launch/multi_node.sh --hostfile H --node_rank {0,1} --master_addr 127.0.0.1 --master_port P ...
      -> deepspeed --hostfile H --master_addr 127.0.0.1 --master_port P --no_ssh --node_rank {0,1} ...

The reference is launch/single_node.sh with NUM_RANKS=2 (one launcher, 2 local ranks). Same world
size, same data order, fp32 on CPU with one thread per rank: losses, grad norms and the final
weights must be bit-identical. All three launchers run at once (about 40-60 s on 2 idle cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import REPO_ROOT, free_port
from tests.helpers.tensorboard import read_scalars

pytestmark = pytest.mark.slow

STEPS = 8
TIMEOUT_S = 300  # a safety net on a loaded machine; the normal run is well under 90 s
# Launcher settings a developer's shell may have exported; the scripts read them as defaults.
LAUNCH_ENV = ("HOSTFILE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NUM_NODES", "GPUS_PER_NODE", "NUM_RANKS",
              "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ENV_FILE")


def _run_all(commands: dict[str, list[str]], env: dict, logdir: Path) -> dict[str, tuple[int, str]]:
    """Start every command in its own session; kill every process group on timeout or on a failure."""
    procs = {}
    for name, cmd in commands.items():
        log = open(logdir / f"{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        log.close()
    deadline = time.monotonic() + TIMEOUT_S
    failed_at = None
    try:
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if any(p.poll() not in (None, 0) for p in procs.values()):
                failed_at = failed_at or now
            if now > deadline or (failed_at and now > failed_at + 10):  # let peers report, then stop all
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            try:  # ranks left behind by a launcher that died first
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return {name: (p.returncode, (logdir / f"{name}.log").read_text(errors="replace")) for name, p in procs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    data = make_tiny_dataset(root / "data")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(data, root / "unused", train={"train_steps": STEPS})))
    hostfile = root / "hostfile"
    hostfile.write_text("# two 'nodes' on this machine, one rank each\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    single_port = free_port()
    multi_port = free_port()
    while multi_port == single_port:
        multi_port = free_port()

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    commands = {
        "single": ["env", "NUM_RANKS=2", f"MASTER_PORT={single_port}", "bash", "launch/single_node.sh",
                   "--config", str(config), "--set", f"output_dir={root / 'single'}"],
    }
    for node in (0, 1):
        commands[f"node{node}"] = [
            "bash", "launch/multi_node.sh", "--hostfile", str(hostfile), "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(multi_port),
            "--config", str(config), "--set", f"output_dir={root / 'multi'}"]
    started = time.monotonic()
    results = _run_all(commands, env, root)
    elapsed = time.monotonic() - started
    for name, (code, log) in results.items():
        assert code == 0, f"{name} exited {code} after {elapsed:.0f}s:\n{log[-4000:]}"
    print(f"single node and two nodes trained in {elapsed:.1f}s")
    return {"root": root, "logs": {name: log for name, (_, log) in results.items()}}


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    return read_scalars(run_dir / "tensorboard")[tag]


def test_two_nodes_train_to_the_same_losses_as_one_node(runs):
    single = _scalars(runs["root"] / "single", "train/loss")
    multi = _scalars(runs["root"] / "multi", "train/loss")
    assert [step for step, _ in single] == list(range(1, STEPS + 1))
    assert multi == single  # exact: same world size, same data order, fp32


def test_two_nodes_match_grad_norms_and_final_weights(runs):
    import torch

    root = runs["root"]
    assert _scalars(root / "multi", "train/grad_norm") == _scalars(root / "single", "train/grad_norm")
    tag = f"step_{STEPS:08d}"
    states = []
    for run in ("single", "multi"):
        ckpt = root / run / "checkpoints"
        assert (ckpt / "latest").read_text().strip() == tag
        assert (ckpt / tag / "COMPLETE").is_file()
        states.append(torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                                 weights_only=False)["module"])
    single, multi = states
    assert single.keys() == multi.keys() and single
    for name, tensor in single.items():
        if torch.is_tensor(tensor):
            assert torch.equal(tensor, multi[name]), name


def test_each_node_ran_one_rank_of_a_two_node_world(runs):
    logs = runs["logs"]
    for node in (0, 1):
        log = logs[f"node{node}"]
        assert f"--node_rank={node}" in log  # the deepspeed runner took the no-ssh path
        assert f"nnodes=2, num_local_procs=1, node_rank={node}" in log
        assert "dist_world_size=2" in log
    assert "world 2 = tp 1 x pp 1 x dp 2" in logs["node0"]
    assert "num_local_procs=2" in logs["single"]
    # only global rank 0 (on node 0) logs and reports where the results are
    assert "done: tensorboard logs in" in logs["node0"] and "done: tensorboard logs in" not in logs["node1"]
    assert "done: tensorboard logs in" in logs["single"]
