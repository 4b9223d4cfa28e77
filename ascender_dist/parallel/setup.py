"""Distributed start-up, in order: process group -> megatron model-parallel groups -> seeds.

Engine setup (DeepSpeed) is a separate later step (:mod:`ascender_dist.training.engine`).
The same code runs on CPU (gloo, fp32; CI and tests) and GPU (NCCL, bf16; clusters).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        """The rank that owns the loss (last pipeline stage) with tp_rank 0 and dp_rank 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a Slurm cpuset, a container, taskset), not
    every CPU of the node."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_world_size() -> int:
    """Ranks on this node, as torchrun (LOCAL_WORLD_SIZE) or the deepspeed launcher (LOCAL_SIZE) says."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1))


def _set_cpu_threads() -> None:
    """The deepspeed launcher leaves OMP_NUM_THREADS unset: every rank would use every core
    (measured 2.7x slower on 2 ranks / 2 cores). Give each local rank its share."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, usable_cpus() // local_world_size()))


def nvidia_devices() -> list[str]:
    """The NVIDIA GPU device nodes this process can open (/dev/nvidia0, ...): present on a GPU node
    and in a container given its GPUs; absent, or refused (EPERM: Slurm's device cgroup on a CPU job,
    a container sharing /dev without --gpus), where the GPUs are not this process's."""
    usable = []
    for path in sorted(Path("/dev").glob("nvidia[0-9]*")):
        try:
            os.close(os.open(path, os.O_RDWR))
        except OSError:
            continue
        usable.append(str(path))
    return usable


def hides_all_gpus(visible: Optional[str]) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES value names no device: empty, or no entry that is an index or
    a GPU- / MIG- UUID (-1, none, NoDevFiles, ...); CUDA then sees no GPU, on purpose."""
    if visible is None:
        return False
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return not any(e.isdigit() or e.startswith(("GPU-", "MIG-")) for e in entries)


def check_gpus_usable() -> None:
    """Refuse, in one line, to train on CPU on a node whose GPUs torch cannot use (a CPU build of
    torch, or a driver older than the build's CUDA): every rank would silently run at CPU speed.
    DS_ACCELERATOR=cpu, or a CUDA_VISIBLE_DEVICES that names no device (empty, as launch/train.py and
    the conversion tools' relaunched ranks set it, or -1 / none), is the deliberate choice of CPU
    ranks. launch/single_node.sh runs it before it picks CPU ranks itself for a node where torch sees
    no GPU."""
    from ascender_dist.config.errors import UserError

    if torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu" or \
            hides_all_gpus(os.environ.get("CUDA_VISIBLE_DEVICES")):
        return
    devices = nvidia_devices()
    if devices:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(f"this node has NVIDIA GPUs ({', '.join(devices)}) but torch {torch.__version__} "
                        f"({build}) cannot use them: install a CUDA build of torch that this driver supports, "
                        f"or set DS_ACCELERATOR=cpu to train on CPU on purpose")


DEFAULT_TIMEOUT_MINUTES = 10  # parallel.distributed_timeout_minutes (torch's gloo default is 30)

_job_store = None  # (environment key, store) of this process


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def launcher_env() -> tuple[str, int, int, int]:
    """(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) as the launcher (deepspeed, torchrun) sets them;
    a UserError naming what is missing or malformed when the process was started some other way."""
    from ascender_dist.config.errors import UserError

    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        raise UserError(f"{', '.join(missing)} not set: start training through a launcher, e.g. "
                        f"`deepspeed --num_accelerators 2 launch/train.py --config run.yaml` (README)")
    try:
        env = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
               int(os.environ["WORLD_SIZE"]))
    except ValueError:
        values = ", ".join(f"{name}={os.environ[name]!r}" for name in LAUNCHER_VARIABLES[1:])
        raise UserError(f"launcher environment: MASTER_PORT, RANK and WORLD_SIZE must be integers ({values})") from None
    if not 1 <= env[1] <= 65535:  # torch's TCPStore refuses it with a pybind11 TypeError on every rank
        raise UserError(f"launcher environment: MASTER_PORT must be a port number, 1-65535 (got {env[1]})")
    return env


def set_cuda_device() -> None:
    """This rank's GPU (LOCAL_RANK), refused in one line when the node shows fewer: more ranks per
    node than GPUs (--num_gpus, GPUS_PER_NODE, a hostfile's slots) was a CUDA "invalid device
    ordinal" traceback from every rank past the count."""
    from ascender_dist.config.errors import UserError

    local_rank, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"LOCAL_RANK {local_rank}, but this node shows {count} GPU(s): start at most {count} "
                        "rank(s) per node (the launcher's --num_gpus, GPUS_PER_NODE, the hostfile's slots)")
    torch.cuda.set_device(local_rank)


def job_store(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES):
    """The job's rendezvous key-value store, made once per process from the launcher's environment
    (rank 0 hosts it on MASTER_ADDR:MASTER_PORT, or torchrun's agent does). The process group is
    built on it, and it exists before the config is read, so ranks can agree which one reports an
    error (:mod:`ascender_dist.parallel.job_errors`) even when the process group never started."""
    import torch.distributed as dist

    global _job_store
    from datetime import timedelta

    key = launcher_env()
    if _job_store is None or _job_store[0] != key:
        addr, port, rank, world = key
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
        try:
            store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent,
                                  timeout=timedelta(minutes=timeout_minutes), wait_for_workers=False)
        except dist.DistError as exc:  # unreachable or unresolvable master, port taken, timeout
            from ascender_dist.config.errors import UserError

            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"rank {rank}: cannot reach the job's rendezvous {addr}:{port} within "
                            f"{timeout_minutes:g} min ({first})") from None
        if agent:  # the key space torch's own env:// rendezvous uses under torchrun
            store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        _job_store = (key, store)
    return _job_store[1]


def existing_job_store():
    """The store :func:`job_store` made in this process, or None."""
    return _job_store[1] if _job_store is not None else None


def process_group_kwargs(backend: str, timeout_minutes: float) -> dict:
    """Arguments of ``torch.distributed.init_process_group``: ``timeout`` bounds every collective
    (gloo) and arms the NCCL watchdog, so a rank that stops answering ends the job."""
    from datetime import timedelta

    _, _, rank, world = launcher_env()
    return {"backend": backend, "store": job_store(timeout_minutes), "rank": rank, "world_size": world,
            "timeout": timedelta(minutes=timeout_minutes)}


def init_process_group(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """Start torch.distributed on the job store (RANK/WORLD_SIZE/MASTER_* from the launcher) with
    ``timeout_minutes`` for every collective, then hand it to DeepSpeed (which adopts an existing
    process group). faulthandler is enabled so that a rank the NCCL watchdog aborts dumps its
    Python stack to its log."""
    import faulthandler
    import sys
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    check_gpus_usable()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    # The shm all-reduce op compiles C++ for minutes on a fresh machine and is only used for inference.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized():
        return
    _set_cpu_threads()
    if torch.cuda.is_available():
        set_cuda_device()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    dist.init_process_group(**process_group_kwargs(backend, timeout_minutes))
    job_store(timeout_minutes).set_timeout(timedelta(minutes=timeout_minutes))
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(minutes=timeout_minutes))


def shutdown_process_group() -> None:
    """End a finished job's torch.distributed on every rank together: megatron's groups, then one
    barrier, then the default group, as torchtitan and Megatron-LM end a run. Left to interpreter
    exit, each rank tears its groups down in its own time while its peers, and the job store that
    rank 0 hosts, may already be gone."""
    import torch.distributed as dist

    from megatron.core import parallel_state as mps

    if not dist.is_initialized():
        return
    mps.destroy_model_parallel()  # forgets the groups; the default group's destroy below ends them all
    dist.barrier()
    dist.destroy_process_group()


def init_single_process() -> None:
    """A private 1-rank gloo group for single-process tools (inspection, figures). A fresh port is
    picked every time: an inherited MASTER_PORT may belong to another live group."""
    import torch.distributed as dist

    from ascender_dist.ports import free_port

    if dist.is_initialized():
        return
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_process_group()


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int,
                        timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> ParallelState:
    """megatron-core's TP/PP/DP groups plus its model-parallel RNG tracker (same init on every DP
    replica). ``timeout_minutes`` bounds the collectives of these groups too (DeepSpeed reduces
    gradients over the data-parallel one); megatron's own default is 30."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascender_dist.compat.megatron_cpu import install_if_needed

    install_if_needed()
    if mps.model_parallel_is_initialized() and (
            mps.get_tensor_model_parallel_world_size() != tensor_parallel
            or mps.get_pipeline_model_parallel_world_size() != pipeline_parallel):
        destroy_model_parallel()  # a new layout in the same process (tests, conversions)
    if not mps.model_parallel_is_initialized():
        mps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
            distributed_timeout_minutes=timeout_minutes,
        )
    # each pipeline stage builds its layers from its own stream (Megatron-LM's offset): with one seed
    # everywhere, stages 1, 2, ... (no embedding drawn first) would start as copies of each other
    stage_seed = seed + 100 * mps.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return ParallelState(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        tp_rank=mps.get_tensor_model_parallel_rank(),
        tp_size=mps.get_tensor_model_parallel_world_size(),
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        pp_size=mps.get_pipeline_model_parallel_world_size(),
        dp_rank=mps.get_data_parallel_rank(),
        dp_size=mps.get_data_parallel_world_size(),
        device=device,
    )


def _megatron_process_groups() -> list:
    """The process groups megatron's parallel_state holds (module globals, lists of groups included),
    each once, except its ``*_GLOO`` groups, which its own destroy ends, and the default group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    groups: dict[int, object] = {}
    ended_by_megatron = {id(dist.GroupMember.WORLD)}
    for name, value in vars(mps).items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(item, dist.ProcessGroup):
                continue
            if name.endswith("_GLOO"):
                ended_by_megatron.add(id(item))
            else:
                groups[id(item)] = item
    # megatron's list of every group it made (_global_process_group_list) holds the "_GLOO" ones too
    return [group for key, group in groups.items() if key not in ended_by_megatron]


def destroy_model_parallel() -> None:
    """End megatron's model-parallel groups for real, for a process that goes on with another layout
    (tests, conversions). megatron-core's own destroy only forgets them (and ends its gloo copies):
    torch keeps every group registered, each gloo one with three threads that wake on their own, and
    such a process slowed down with thousands of idle threads. A job's end (shutdown_process_group)
    ends every group with the default one, after its barrier."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    if not mps.model_parallel_is_initialized():
        return
    groups = _megatron_process_groups()
    mps.destroy_model_parallel()
    for group in groups:
        dist.destroy_process_group(group)


class MegatronMPU:
    """megatron-core's parallel_state under the names DeepSpeed's ``mpu=`` argument asks for
    (DeepSpeed reduces gradients over the data-parallel group and grad norms over model-parallel)."""

    def __getattr__(self, name):
        from megatron.core import parallel_state as mps

        return getattr(mps, name)

    def get_model_parallel_rank(self):
        from megatron.core import parallel_state as mps

        return mps.get_tensor_model_parallel_rank() + (
            mps.get_pipeline_model_parallel_rank() * mps.get_tensor_model_parallel_world_size()
        )

    def get_model_parallel_world_size(self):
        from megatron.core import parallel_state as mps

        return mps.get_tensor_model_parallel_world_size() * mps.get_pipeline_model_parallel_world_size()
