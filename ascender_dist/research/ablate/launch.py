"""Running a grid: one training process per (variant, seed), resumable; the child that trains one run."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ascender_dist.launcher import NO_HOSTFILE, deepspeed_launcher
from ascender_dist.locks import exclusive_lock
from ascender_dist.ports import free_port
from ascender_dist.training.callbacks import Callback
from data_pipeline._io import exclusive_temporary

from .collect import _load_record, load_checked_record
from .grid import RESULT, AblationError, Grid, Variant, run_config, run_dir



# ============================================================================ one run (child process)

def _status_kib(name: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
        return True
    except OSError:
        return False


def _ascender_omegas(model) -> dict:
    """{layer number: [[omega_align, omega_sep, omega_coh] per head]} of every ASCender layer."""
    out = {}
    for module in model.modules():
        if type(module).__name__ == "AscenderCoreAttention":
            out[str(int(module.layer_number))] = module.params.omega.detach().float().cpu().tolist()
    return out


def order_validation(per_rank: Sequence[Sequence[float]], micro_batch_size: int) -> tuple[list, list]:
    """Per-sequence values of every data-parallel rank -> (values, global indices) in validation order.

    ``StreamingLoader`` gives rank ``r`` the rows ``t * mbs * dp + r * mbs + [0, mbs)`` of its ``t``-th
    validation micro-batch, so item ``k`` of rank ``r`` is global row ``(k // mbs) * mbs * dp + r * mbs +
    k % mbs``."""
    dp = len(per_rank)
    pairs = []
    for r, values in enumerate(per_rank):
        for k, v in enumerate(values):
            t, j = divmod(k, micro_batch_size)
            pairs.append((t * micro_batch_size * dp + r * micro_batch_size + j, float(v)))
    pairs.sort()
    return [v for _, v in pairs], [i for i, _ in pairs]


def document_blocks(windows: Sequence[Sequence[int]], eos_id: int) -> list[int]:
    """Document id of each validation window (token ids, in validation order): the document that
    holds the window's middle token.

    Shards pack documents (each followed by EOS) back to back into windows, so a window usually ends
    one document and starts the next; grouping windows that share any document would chain nearly
    every window into one block. Each window goes instead with the document of its middle token (ids
    count the EOS tokens of the stream before that token), so the windows of a long document are
    resampled together and a window straddling a boundary goes with one of its two documents.
    Validation shards that are not adjacent in the packed stream are read as one stream: ids stay
    distinct across the gap."""
    ids, before = [], 0
    for window in windows:
        is_eos = [int(t) == eos_id for t in window]
        ids.append(before + sum(is_eos[: len(is_eos) // 2]))
        before += sum(is_eos)
    return ids


def validation_documents(cfg, tokenizer, indices: Sequence[int]) -> Optional[list[int]]:
    """Document id of each validation row in ``indices`` (global rows, see :func:`order_validation`);
    None without a tokenizer (no EOS id)."""
    import dataclasses
    from types import SimpleNamespace

    from ascender_dist.training.run import build_loader

    if tokenizer is None or getattr(tokenizer, "eos_id", None) is None or not indices:
        return None
    one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1, global_batch_size=1))
    loader = build_loader(one, tokenizer, SimpleNamespace(dp_rank=0, dp_size=1), split="val")
    windows = []
    for k, batch in enumerate(loader):
        if k > max(indices):
            break
        windows.append(batch["tokens"][0].tolist())  # the whole window: inputs and the last label
    blocks = document_blocks(windows, int(tokenizer.eos_id))
    return [blocks[i] for i in indices]


class ValidationLosses(Callback):
    """``(step, loss)`` of every validation the trainer runs during ``fit`` (``train.eval_interval``)."""

    def __init__(self):
        self.curve: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, loss: float) -> None:
        self.curve.append((int(trainer.step), float(loss)))


def _connection_hooks(model, stats: dict) -> list:
    """Hooks on every Connection layer that count, over the validation pass, the reasoning steps each
    reasoning state took (a histogram over 0..max_steps) and the token load of each slot (the
    compression weights summed over tokens). ``stats``: {Connection layer index from 1: {"steps_hist",
    "slot_load", "max_steps"}}."""
    hooks = []
    layers = [m for m in model.modules() if hasattr(m, "slot_loads") and hasattr(m, "last_stats")]
    for number, layer in enumerate(layers, start=1):
        entry = stats.setdefault(str(number), {"max_steps": int(layer.hp.max_steps),
                                               "steps_hist": [0] * (int(layer.hp.max_steps) + 1),
                                               "slot_load": [0.0] * int(layer.hp.num_slots)})

        def loads(module, args, entry=entry):
            load = module.slot_loads(args[0]).sum(dim=(0, 1)).float().cpu()  # [N]
            entry["slot_load"] = [a + float(b) for a, b in zip(entry["slot_load"], load)]

        def steps(module, args, out, entry=entry):
            taken = module.last_stats.steps.reshape(-1).long().cpu()
            counts = torch.bincount(taken, minlength=entry["max_steps"] + 1)
            entry["steps_hist"] = [a + int(b) for a, b in zip(entry["steps_hist"], counts.tolist())]

        hooks += [layer.register_forward_pre_hook(loads), layer.register_forward_hook(steps)]
    return hooks


def merge_connection_stats(per_rank: Sequence[dict]) -> dict:
    """The Connection statistics of the whole validation set from each data-parallel rank's share
    (_connection_hooks): step histograms and slot loads add up, layer by layer."""
    merged: dict = {}
    for stats in per_rank:
        for layer, entry in stats.items():
            into = merged.setdefault(layer, {"max_steps": entry["max_steps"],
                                             "steps_hist": [0] * len(entry["steps_hist"]),
                                             "slot_load": [0.0] * len(entry["slot_load"])})
            into["steps_hist"] = [a + b for a, b in zip(into["steps_hist"], entry["steps_hist"])]
            into["slot_load"] = [a + b for a, b in zip(into["slot_load"], entry["slot_load"])]
    return merged


def _gather(obj, group=None) -> list:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def run_one(config_path: Path, result_path: Path, eval_iters: Union[int, str, None] = None) -> dict:
    """Train one run on the ranks the launcher started; rank 0 writes its result JSON atomically."""
    import resource

    import torch
    from megatron.core import parallel_state as mps

    from ascender_dist.config import load_config
    from ascender_dist.config.loader import to_dict
    from ascender_dist.models.counting import count_model
    from ascender_dist.training.callbacks import DataDigest, PerSequenceValidationLosses, Throughput
    from ascender_dist.training.trainer import Trainer

    from .provenance import run_provenance

    cfg = load_config(config_path)
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise AblationError(f"{config_path}: ablate collects per-sequence losses from the model's output; "
                            "pipeline_model_parallel_size must be 1")
    # the code and data that train it, taken now: a commit made while it trains is not this run's
    provenance = run_provenance(to_dict(cfg), cfg.data.manifest) if int(os.environ.get("RANK", "0")) == 0 else {}
    t_start = time.perf_counter()
    digest, per_sequence, curve = DataDigest(), PerSequenceValidationLosses(), ValidationLosses()
    trainer = Trainer(cfg, callbacks=[digest, per_sequence, curve])
    setup_s = time.perf_counter() - t_start
    if trainer.step:
        raise AblationError(f"{cfg.output_dir}: resumed at step {trainer.step}; an ablation run must start fresh")
    step_times = next(cb for cb in trainer.callbacks if isinstance(cb, Throughput)).step_times
    rss_before = _status_kib("VmRSS")
    peak_resettable = _reset_peak_rss()
    t_fit = time.perf_counter()
    losses = trainer.fit()
    if trainer.stop_reason is not None:  # a signal or time budget: a run of fewer steps is no record
        raise AblationError(f"{cfg.output_dir}: stopped at step {trainer.step} of {cfg.train.train_steps} "
                            f"({trainer.stop_reason}); no result is written: run the grid again")
    fit_s = time.perf_counter() - t_fit
    train_peak = _status_kib("VmHWM")
    val_curve = list(curve.curve)  # the train.eval_interval validations, before the final one

    # final validation over eval_iters micro-batches in all (dealt to the data-parallel ranks);
    # per-sequence losses from the callback
    eval_requested = eval_iters if eval_iters is not None else cfg.train.eval_iters  # recorded: collect checks it
    if eval_iters == "all":
        eval_iters = 1 << 62  # validate clips it to the batches there are
    connection_stats: dict = {}
    hooks = _connection_hooks(trainer.engine.module, connection_stats)
    t_val = time.perf_counter()
    val_loss = trainer.validate(int(eval_iters or cfg.train.eval_iters))
    val_s = time.perf_counter() - t_val
    for hook in hooks:
        hook.remove()
    iters = trainer.validation_batches(int(eval_iters or cfg.train.eval_iters))  # per rank
    per_example = per_sequence.losses
    dp_group = mps.get_data_parallel_group()
    example_losses, example_index = order_validation(_gather(per_example, dp_group), cfg.train.micro_batch_size)
    connection_stats = merge_connection_stats(_gather(connection_stats, dp_group))
    rank_digests = _gather(digest.hexdigest())  # every rank hashes the tokens it read
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return {}

    vocab = cfg.model.vocab_size or trainer.tokenizer.vocab_size
    counts = count_model(cfg.model, vocab, cfg.parallel.tensor_model_parallel_size)
    params = sum(p.numel() for p in {id(p): p for p in trainer.engine.module.parameters()}.values())
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    steady = step_times[2:] if len(step_times) > 3 else step_times
    median_step = float(np.median(steady)) if steady else float("nan")
    tail = max(1, len(losses) // 10)
    from ascender_dist.config.architectures import expand_layer_pattern

    data_sha = rank_digests[0] if len(rank_digests) == 1 else hashlib.sha256("".join(rank_digests).encode()).hexdigest()
    result = {
        "config": None, "seed": cfg.train.seed,  # filled by the parent (variant name)
        "name": cfg.name, "architecture": cfg.model.architecture, "layer_pattern": expand_layer_pattern(cfg.model),
        "world_size": trainer.pstate.world_size, "device": str(trainer.pstate.device),
        "val_loss": float(val_loss), "eval_iters": eval_requested, "val_batches": iters,
        "val_sequences": len(example_losses),
        "val_example_losses": example_losses, "val_example_index": example_index,
        "val_example_documents": validation_documents(cfg, trainer.tokenizer, example_index),
        "val_curve": [[step, loss] for step, loss in val_curve],
        "val_curve_sequences": (trainer.validation_batches(cfg.train.eval_iters) * (len(example_losses) // iters)
                                if val_curve and iters else None),  # the first batches of the validation split
        "final_train_loss": float(np.mean(losses[-tail:])) if losses else None,
        "train_losses": [float(x) for x in losses],
        "steps": len(losses), "tokens": len(losses) * tokens_per_step,
        "step_time_s": step_times, "median_step_time_s": median_step,
        "tokens_per_s": tokens_per_step / median_step if steady else None,
        "tokens_per_s_mean": len(losses) * tokens_per_step / fit_s if fit_s > 0 else None,
        "params": int(params), "params_analytic": int(counts.total_params),
        "non_embedding_params": int(counts.non_embedding_params),
        "flops_per_token": float(counts.flops_per_token),
        "training_flops": float(counts.flops_per_token) * len(losses) * tokens_per_step,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_peak_rss_delta_mib": ((train_peak - rss_before) / 1024
                                     if peak_resettable and train_peak and rss_before else None),
        "omega": _ascender_omegas(trainer.engine.module),
        "connection": connection_stats or None,  # summed over the data-parallel ranks' validation shares
        "data_sha256": data_sha,
        "setup_s": setup_s, "fit_s": fit_s, "val_s": val_s,
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir": str(trainer.derived.checkpoint_dir),
        "provenance": provenance,
    }
    result_path = Path(result_path)
    tmp, fd = exclusive_temporary(result_path)
    with open(fd, "w") as fh:
        fh.write(json.dumps(result))
    tmp.rename(result_path)
    return result


# ============================================================================ running the grid (parent)

@dataclass
class Launcher:
    """How each run is started: the ``deepspeed`` launcher, as training is (docs/cluster.md).

    ``ranks``: ranks per node (GPUs per node on a GPU host, CPU processes otherwise); ``hostfile``:
    DeepSpeed's ``<host> slots=<n>`` file (ssh/pdsh mode, the run directory on a shared file system);
    ``slurm``: one ``srun`` task per node of the current allocation, each running the launcher for its
    own node without ssh (``--no_ssh --node_rank $SLURM_NODEID``), as ``launch/slurm.sbatch`` does."""

    ranks: int = 1
    hostfile: Optional[str] = None
    slurm: bool = False
    master_addr: Optional[str] = None
    cuda: Optional[bool] = None  # None: whatever torch sees on this host
    gpu_ids: Optional[list[int]] = None  # None: CUDA_VISIBLE_DEVICES, else every device torch sees

    def use_cuda(self) -> bool:
        if self.cuda is None:
            import torch

            self.cuda = bool(torch.cuda.is_available())
        return self.cuda

    def device_type(self) -> str:
        """"cuda" or "cpu": the device kind the runs record (parallel/setup.py trains on CUDA whenever
        torch sees a GPU)."""
        return "cuda" if self.use_cuda() else "cpu"

    def gpus(self) -> list[int]:
        """The GPU indices runs may use: ``CUDA_VISIBLE_DEVICES`` when set (``--include`` names physical
        GPUs, and the launcher drops that variable), else every device torch sees."""
        if self.gpu_ids is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
            try:
                self.gpu_ids = [int(x) for x in visible.split(",")] if visible else None
            except ValueError:
                raise AblationError(f"CUDA_VISIBLE_DEVICES={visible!r}: ablate needs GPU indices, not UUIDs") from None
            if self.gpu_ids is None:
                import torch

                self.gpu_ids = list(range(torch.cuda.device_count()))
        return self.gpu_ids

    def device_ids(self, slot: int) -> Optional[list[int]]:
        """The GPUs of job slot ``slot`` (0 .. jobs - 1) on a single CUDA host: the host's GPUs form
        groups of ``ranks`` and slot k takes group k mod (number of groups), so runs that train at the
        same time share a GPU only when there are more slots than groups (the launcher's
        ``--num_accelerators`` would start every run on GPUs 0 .. ranks - 1). None on CPU and on
        multi-node runs (one run at a time there: check_jobs)."""
        if not self.use_cuda() or self.hostfile or self.slurm:
            return None
        ids = self.gpus()
        if len(ids) < self.ranks:
            raise AblationError(f"--ranks {self.ranks} needs {self.ranks} GPUs, this host has {len(ids)}")
        group = slot % (len(ids) // self.ranks)
        return ids[group * self.ranks:(group + 1) * self.ranks]

    def world_size(self) -> int:
        """The ranks one run spans: ``ranks`` per host of ``hostfile`` (launch_command passes
        ``--num_accelerators ranks``, which DeepSpeed's launcher gives every host whatever its
        ``slots``), else per node of the SLURM allocation under ``slurm``, else ``ranks``."""
        if self.hostfile:
            return self.ranks * hostfile_hosts(Path(self.hostfile))
        if self.slurm:
            return self.ranks * int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        return self.ranks

    def check_jobs(self, jobs: int) -> None:
        """Refuse concurrent runs across hosts; warn when concurrent runs must share GPUs (their
        tokens/s then measure the sharing, not the model)."""
        if jobs <= 1 or not self.use_cuda():
            return
        if self.hostfile or self.slurm:
            raise AblationError(f"--jobs {jobs} with --hostfile/--slurm: runs at the same time would share the "
                                "hosts' GPUs; use --jobs 1 (each run spans the hosts)")
        groups = len(self.gpus()) // self.ranks
        if jobs > groups:
            logging.getLogger("ascender_dist").warning(
                "--jobs %d x --ranks %d on %d GPUs: concurrent runs share GPUs (tokens/s are not comparable "
                "between runs; losses are unaffected)", jobs, self.ranks, len(self.gpus()))


ENTRY = Path(__file__).resolve().with_name("run_entry.py")


_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's runner reads a hostfile line so


def hostfile_hosts(path: Path) -> int:
    """The number of hosts of a DeepSpeed hostfile (``<host> slots=<N> ...`` lines; blank lines and
    ``#`` comments skipped), one line naming the file and line when it cannot be read."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AblationError(f"{path}: hostfile unreadable ({exc.strerror or exc})") from None
    hosts = 0
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not _HOSTFILE_LINE.match(text):
            raise AblationError(f"{path}:{number}: expected '<host> slots=<N>', got {line.strip()!r}")
        hosts += 1
    if not hosts:
        raise AblationError(f"{path}: no '<host> slots=<N>' line")
    return hosts


def check_layouts(grid: Grid, world_size: int) -> None:
    """Every run's config checked at the world size its runs will have (the batch divisible by the
    data-parallel size, TP x PP dividing it), before a dataset is built or a run started: otherwise
    each run failed in turn after its launch."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.config.resolve import validate

    for s in grid.seeds:
        for v in grid.variants:
            try:
                validate(run_config(grid, v, s), world_size)
            except ConfigError as exc:
                raise AblationError(f"{v.name} seed {s} on {world_size} ranks: {exc}") from None


def launch_command(launcher: Launcher, child_args: Sequence[str], port: int, slot: int = 0) -> list[str]:
    """The command line that starts one run's ranks (what ``--dry-run`` prints); ``slot``: the job slot
    the run holds (its GPUs on a CUDA host, Launcher.device_ids)."""
    deepspeed = str(deepspeed_launcher())
    if launcher.slurm:
        inner = [deepspeed, "--hostfile", launcher.hostfile or "$ABLATE_HOSTFILE", "--no_ssh",
                 "--node_rank", "$SLURM_NODEID", "--master_addr", launcher.master_addr or "$ABLATE_MASTER_ADDR",
                 "--master_port", str(port), "--num_accelerators", str(launcher.ranks), str(ENTRY), *child_args]
        return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c",
                " ".join(x if x.startswith("$") else shlex.quote(x) for x in inner)]
    cmd = [deepspeed, "--hostfile", launcher.hostfile or NO_HOSTFILE]
    if launcher.hostfile and launcher.master_addr:
        cmd += ["--master_addr", launcher.master_addr]
    devices = launcher.device_ids(slot)
    if devices is None:
        cmd += ["--num_accelerators", str(launcher.ranks)]
    else:
        cmd += ["--include", "localhost:" + ",".join(map(str, devices))]
    cmd += ["--master_port", str(port), str(ENTRY), *child_args]
    return cmd


def slurm_hostfile(path: Path, ranks: int) -> tuple[Path, str]:
    """Write the hostfile of the current SLURM allocation (``slots=ranks`` per node); returns it and
    the first node (the master address)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise AblationError("--slurm: not inside a SLURM allocation (SLURM_JOB_NODELIST is unset)")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    path.write_text("".join(f"{h} slots={ranks}\n" for h in hosts))
    return path, hosts[0]


def slurm_prelude(directory: Path, ranks: int, master_addr: Optional[str]) -> str:
    """The shell line that sets what a ``--slurm`` launch command reads (``$ABLATE_HOSTFILE``,
    ``$ABLATE_MASTER_ADDR``) as slurm_hostfile does, so a printed command runs when pasted inside the
    allocation."""
    hosts = 'scontrol show hostnames "$SLURM_JOB_NODELIST"'
    hostfile = shlex.quote(str(directory / "hostfile"))
    master = shlex.quote(master_addr) if master_addr else f"$({hosts} | head -n 1)"
    return (f"export ABLATE_HOSTFILE={hostfile} ABLATE_MASTER_ADDR={master}; mkdir -p {shlex.quote(str(directory))}; "
            f"{hosts} | sed 's/$/ slots={ranks}/' > \"$ABLATE_HOSTFILE\"")


def _child_env(threads: int, launcher: Launcher) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the launcher sets them for every rank
    if not launcher.use_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def child_args(grid: Grid, variant: Variant, seed: int) -> list[str]:
    directory = run_dir(grid, variant, seed)
    args = ["--run-one", str(directory / "config.yaml"), "--result", str(directory / RESULT)]
    if grid.eval_iters is not None:
        args += ["--eval-iters", str(grid.eval_iters)]
    return args


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch's prefix on a rank's traceback lines
_ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception)\b|^error:")


def _last_error_line(log_file: Path) -> str:
    """The run log's last error line (an exception or a one-line ``error:``), without the rank prefix
    torch puts on a rank's lines; the launcher's own exit report is not the cause and is passed over."""
    if not log_file.exists():
        return "(no log)"
    lines = [_RANK_PREFIX.sub("", ln.strip()) for ln in log_file.read_text(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln and "sigkill_handler" not in ln]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


_LIVE_RUNS: set = set()  # the runs training now (Popen, each its own process group)
_LIVE_LOCK = threading.Lock()


def stop_live_runs(grace_s: float = 30.0) -> None:
    """SIGTERM every training run's process group (the launcher and its ranks), SIGKILL what is left
    after ``grace_s``: a stopped ``ablate`` leaves no run training (and writing a result) behind."""
    with _LIVE_LOCK:
        procs = list(_LIVE_RUNS)
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def runs_stopped_on_signals():
    """Inside: SIGTERM and SIGINT (in the main thread) stop the training runs, which are started in
    their own process groups so a terminal's Ctrl-C does not reach them by itself, then end the body
    as an interrupt. The previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        stop_live_runs()
        raise KeyboardInterrupt(f"ablate stopped by signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _train(cmd: list[str], env: dict, log_file: Path, timeout: Optional[float]) -> int:
    """Run one training command in its own process group, output to ``log_file``; its exit status.
    A timeout or an interrupt of this process stops the whole group."""
    with open(log_file, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with _LIVE_LOCK:
        _LIVE_RUNS.add(proc)
    try:
        return proc.wait(timeout)
    except BaseException:  # a timeout, an interrupt: the run does not go on without us
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE_RUNS.discard(proc)


def check_recorded_layout(grid: Grid, variant: Variant, seed: int, record: dict, launcher: Launcher) -> None:
    """Refuse to reuse a finished run trained on another number of ranks or kind of device than this
    invocation trains on: neither is in the config hash, and its losses (other reduction orders and
    kernels) would be compared with runs that differ from it by more than their variant."""
    got_ranks = record.get("world_size")
    got_device = str(record.get("device") or "").split(":")[0] or None
    want_ranks, want_device = launcher.world_size(), launcher.device_type()
    if (got_ranks is not None and got_ranks != want_ranks) or (got_device is not None and got_device != want_device):
        raise AblationError(f"{run_dir(grid, variant, seed)}: finished on {got_ranks} {got_device} rank(s), this "
                            f"invocation trains on {want_ranks} {want_device} rank(s): run the grid as it ran "
                            "(--ranks), or use another --runs-dir")


def launch_run(grid: Grid, variant: Variant, seed: int, threads: int, timeout: Optional[float] = None,
               launcher: Optional[Launcher] = None, slot: int = 0) -> dict:
    """Run one (variant, seed) through the launcher unless its result exists; return its record.
    ``slot``: the job slot it holds (which GPUs it may use)."""
    directory = run_dir(grid, variant, seed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # one process trains a run directory: a second ablate over the same runs (another --only sharing the
    # baseline) waits here, then reuses the result instead of deleting the directory under the first
    with exclusive_lock(directory.parent / f".{directory.name}.lock", AblationError, "the run's lock file"):
        return _launch_run_locked(grid, variant, seed, threads, timeout, launcher or Launcher(), slot)


def _launch_run_locked(grid: Grid, variant: Variant, seed: int, threads: int, timeout: Optional[float],
                       launcher: Launcher, slot: int) -> dict:
    directory = run_dir(grid, variant, seed)
    result_file = directory / RESULT
    if result_file.exists():  # refused when it was trained with another config or layout than asked now
        record = load_checked_record(grid, variant, seed)
        check_recorded_layout(grid, variant, seed, record, launcher)
        return record
    if directory.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    cfg = run_config(grid, variant, seed)
    from ascender_dist.config.loader import dump_yaml, to_dict

    (directory / "config.yaml").write_text(dump_yaml(to_dict(cfg)))
    env = _child_env(threads, launcher)
    if launcher.slurm and not launcher.hostfile:
        hostfile, master = slurm_hostfile(directory / "hostfile", launcher.ranks)
        env["ABLATE_HOSTFILE"], env["ABLATE_MASTER_ADDR"] = str(hostfile), launcher.master_addr or master
    cmd = launch_command(launcher, child_args(grid, variant, seed), free_port(), slot)
    log_file = directory / "run.log"
    (directory / "launch.txt").write_text(shlex.join(cmd) + "\n")
    returncode = _train(cmd, env, log_file, timeout)
    if returncode != 0 or not result_file.exists():
        raise AblationError(f"{log_file}: run {variant.name} seed {seed} failed (exit {returncode}): "
                            f"{_last_error_line(log_file)}")
    record = _load_record(result_file, variant.name)
    if not grid.keep_checkpoints:
        shutil.rmtree(record.get("checkpoint_dir") or directory / "checkpoints", ignore_errors=True)
    return record


def run_grid(grid: Grid, jobs: Optional[int] = None, threads: Optional[int] = None, progress: bool = True,
             launcher: Optional[Launcher] = None) -> list[dict]:
    """Every (variant, seed) not yet done, ``jobs`` at a time, with a progress bar. Returns all records."""
    from tqdm import tqdm

    jobs = max(1, jobs or grid.jobs)
    threads = max(1, threads or grid.threads)
    todo = [(v, s) for s in grid.seeds for v in grid.variants]  # seed-major: early seeds complete first
    launcher = launcher or Launcher()
    done = [(v, s) for v, s in todo if (run_dir(grid, v, s) / RESULT).exists()]
    for v, s in done:  # before training anything: a finished run of another config or layout is refused
        check_recorded_layout(grid, v, s, load_checked_record(grid, v, s), launcher)
    pending = [t for t in todo if t not in done]
    bar = tqdm(total=len(todo), initial=len(done), unit="run", desc=f"ablate {grid.name}", disable=not progress)
    launcher.check_jobs(min(jobs, max(1, len(pending))))
    slots: queue.Queue = queue.Queue()
    for k in range(jobs):
        slots.put(k)

    def in_slot(v: Variant, s: int) -> dict:  # holds a job slot (its GPUs) while the run trains
        k = slots.get()
        try:
            return launch_run(grid, v, s, threads, None, launcher, k)
        finally:
            slots.put(k)

    records = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(in_slot, v, s): (v, s) for v, s in pending}
        for future in concurrent.futures.as_completed(futures):
            v, s = futures[future]
            record = future.result()  # AblationError propagates: the runs training finish, no queued one starts
            bar.update(1)
            bar.set_postfix_str(f"{v.name} seed {s}: {grid.metric} {record.get(grid.metric, float('nan')):.4f}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    for v, s in todo:
        records.append(_load_record(run_dir(grid, v, s) / RESULT, v.name))
    return records
