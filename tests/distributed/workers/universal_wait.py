"""Checkpoint-directory collectives on 2 ranks whose process group times out after a few seconds:
ensure_universal (rank 0's conversion, a stand-in that takes longer than that, must not time the
other rank out; a failed conversion stops both ranks with rank 0's message) and check_shared_dir
(a directory that is not the same on every rank is refused on every rank) and the resume tag
(rank 0's reading of `latest` on every rank, also where another rank's view of it is stale) and
the checkpoint's file records (every file hashed although one rank's listing misses one), and a
weights-file error, a configuration or a checkpoint directory that differs on one rank stops every
rank (each check: what a rank deciding alone did before: go on into the next collective and wait)."""

import contextlib
import json
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from tests.helpers.multiproc import run_checks

GROUP_TIMEOUT_S = 5
CONVERSION_S = 2 * GROUP_TIMEOUT_S


def _tag(root: Path, name: str) -> Path:
    """A complete-looking tag: ensure_universal reads its meta.json (files verified by a stand-in);
    beside it what a killed conversion of it left (its work directory, with output)."""
    tag = root / name
    if dist.get_rank() == 0:
        tag.mkdir(parents=True)
        (tag / "meta.json").write_text(json.dumps({"step": 1, "files": {}}))
        leftover = root / f".{name}-universal.tmp" / f"{name}-universal"
        leftover.mkdir(parents=True)
        (leftover / "param0.pt").write_text("from a killed attempt")
    dist.barrier()
    return tag


# the writing converter: one more file every second, five heartbeats (0.2 s) per write, so that a loaded
# machine that delays some beats still sees most writes (at 0.5 s apart, a clean-clone CI run failed the
# test once, which passed alone twice on the same machine)
WRITES, WRITE_EVERY_S = 6, 1.0


def _slow_converter(fail: bool, writing: bool = False):
    """A stand-in for ds_to_universal: silent for CONVERSION_S, then a failure or one output file;
    or (``writing``) one more output file every WRITE_EVERY_S, as a conversion that advances."""
    def run(cmd, **kwargs):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        if writing:
            out.mkdir(parents=True)
            for i in range(WRITES):
                (out / f"param{i}.pt").write_text("x" * (i + 1))
                time.sleep(WRITE_EVERY_S)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        time.sleep(CONVERSION_S)
        if fail:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nKeyError: 'optimizer_state'")
        out.mkdir(parents=True)
        (out / "weights.txt").write_text("converted")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def _ensure(root: Path, name: str, fail: bool, rank0_patches: dict | None = None, writing: bool = False,
            progress_raises: bool = False) -> dict:
    """ensure_universal with a slow stand-in converter; rank 0's heartbeat every 0.2 s, the waiting
    rank's patience 2 s (a fifth of the conversion: the heartbeat must keep it waiting). ``progress``:
    what ensure_universal reported on this rank as the conversion's output changed (``progress_raises``:
    the report raises after recording, as a failing callback)."""
    from ascender_dist.training import checkpoint as ckpt

    _tag(root, name)
    start, reports = time.monotonic(), []

    def progress(what: str) -> None:
        reports.append(what)
        if progress_raises:
            raise RuntimeError("a callback's bug")

    patches = dict(verify_files=mock.DEFAULT, UNIVERSAL_POLL_S=0.2, UNIVERSAL_HEARTBEAT_S=0.2, UNIVERSAL_STALE_S=2.0)
    if dist.get_rank() == 0:
        patches.update(rank0_patches or {})
    with mock.patch.multiple(ckpt, **patches), mock.patch.object(subprocess, "run", _slow_converter(fail, writing)):
        try:
            tag = ckpt.ensure_universal(root, name, progress)
            return {"tag": tag, "seconds": time.monotonic() - start, "progress": reports}
        except ckpt.CheckpointError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - start, "progress": reports}


def _crash(*_args):
    raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")


@contextlib.contextmanager
def _silent(*_args):
    """A rank 0 that writes no heartbeat (as one killed mid-conversion) ..."""
    yield


def _stuck(*_args):
    """... while it takes longer than the waiting rank's patience."""
    time.sleep(3.0)


def _short_timeout_group(root: Path) -> None:
    """The default process group with a GROUP_TIMEOUT_S timeout on every collective, formed only
    once both ranks are up (their start can be further apart than that under load)."""
    import os

    rank = int(os.environ["RANK"])
    store = dist.FileStore(str(root / "store"), 2)
    store.set_timeout(timedelta(seconds=120))
    store.add("arrived", 1)
    while store.add("arrived", 0) < 2:
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _shared(directory: Path) -> dict:
    from ascender_dist.training import checkpoint as ckpt

    directory.mkdir(parents=True, exist_ok=True)
    try:
        with mock.patch.object(ckpt, "SHARED_CHECK_WAIT_S", 0.5):  # well inside the group's timeout
            ckpt.check_shared_dir(directory)
        return {"error": None}
    except ckpt.CheckpointError as exc:
        return {"error": str(exc)}


def _saved_tags(directory: Path, steps: list, latest: int | None) -> None:
    """Complete-looking tags (meta.json and marker) for ``steps``, ``latest`` naming one (or none)."""
    if dist.get_rank() == 0:
        for step in steps:
            tag = directory / f"step_{step:08d}"
            tag.mkdir(parents=True)
            (tag / "meta.json").write_text(json.dumps({"step": step, "data_parallel_size": 2, "zero_stage": 1}))
            (tag / "COMPLETE").write_text(f"{step}\n")
        if latest is not None:
            (directory / "latest").write_text(f"step_{latest:08d}")
    dist.barrier()


def _resume_tag(directory: Path, steps: list, latest: int | None, stale_on_rank1: bool = False,
                marker_hidden_on_rank1: bool = False, meta_unreadable_on_rank1: bool = False) -> dict:
    """resume_tag_for_layout on both ranks; rank 1 optionally reads an older `latest` (an NFS
    client's cached pointer), cannot see the tag's marker, or cannot read its meta.json (the layout
    check's input)."""
    from types import SimpleNamespace

    from ascender_dist.config.errors import UserError
    from ascender_dist.training import checkpoint as ckpt
    from ascender_dist.training.run import resume_tag_for_layout

    _saved_tags(directory, steps, latest)
    pstate = SimpleNamespace(is_logging_rank=dist.get_rank() == 0, tp_size=1, pp_size=1, dp_size=2)
    patches = [mock.patch.object(ckpt, "SHARED_CHECK_WAIT_S", 0.5)]
    if dist.get_rank() == 1 and stale_on_rank1:
        patches.append(mock.patch.object(ckpt, "latest_tag", lambda _dir: f"step_{steps[0]:08d}"))
    if dist.get_rank() == 1 and marker_hidden_on_rank1:
        patches.append(mock.patch.object(ckpt, "COMPLETE", "COMPLETE-not-synced-yet"))
    if dist.get_rank() == 1 and meta_unreadable_on_rank1:
        def unreadable(checkpoint_dir, tag):
            raise ckpt.CheckpointError(f"{Path(checkpoint_dir) / tag / 'meta.json'}: unreadable (Stale file handle)")
        patches.append(mock.patch.object(ckpt, "read_meta", unreadable))
    try:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            return {"tag": resume_tag_for_layout(directory, pstate, 1)}
    except UserError as exc:  # a CheckpointError; on the other ranks, the failing rank's error (guard.on_every_rank)
        return {"error": str(exc), "rank": getattr(exc, "rank", None)}


def _hash_with_stale_listing(staged: Path) -> dict:
    """_hash_share over four files while rank 1's directory listing misses one of them."""
    from ascender_dist.training import checkpoint as ckpt

    if dist.get_rank() == 0:
        (staged / "sub").mkdir(parents=True)
        for name in ("a.pt", "b.pt", "c.pt", "sub/d.pt"):
            (staged / name).write_text(name)
    dist.barrier()
    listing = ckpt._files_under
    stale = lambda d: [n for n in listing(d) if n != "b.pt"]  # noqa: E731
    with mock.patch.object(ckpt, "_files_under", stale if dist.get_rank() == 1 else listing):
        return {"files": sorted(ckpt._hash_share(staged))}


def _init_from_fails_on_rank1() -> dict:
    """guard.on_every_rank around a step that fails on rank 1 only (the pipeline stage holding a
    layer the weights file lacks): rank 0 must not go on into the next collective."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.training.guard import on_every_rank

    def shards():
        if dist.get_rank() == 1:
            raise ConfigError("checkpoint.init_from", "w.safetensors: no tensor decoder.layers.3.mlp.linear_fc1.weight")
        return ["rank 0's shards"]

    try:
        result = on_every_rank(shards)
        dist.barrier()  # the collective that follows (check_all_weights_used's gather)
        return {"result": result}
    except ConfigError as exc:
        return {"error": str(exc), "rank": getattr(exc, "rank", None)}


def _os_error_on_rank1() -> dict:
    """on_every_rank around a step that fails with an OSError (not a UserError) on rank 1 only."""
    from ascender_dist.config.errors import UserError
    from ascender_dist.training.guard import on_every_rank

    def step():
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return "fine"

    try:
        return {"result": on_every_rank(step)}
    except UserError as exc:
        return {"error": str(exc), "rank": exc.rank}
    except OSError as exc:
        return {"os_error": str(exc)}


def _config_differs_on_rank1() -> dict:
    """check_same_config where rank 1 read another learning rate (a file edited mid-launch)."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.training.run import check_same_config

    check_same_config(config_from_dict({"optimizer": {"lr": 1e-3}}))
    try:
        check_same_config(config_from_dict({"optimizer": {"lr": 1e-3 * (1 + dist.get_rank())}}))
        return {"error": None}
    except ConfigError as exc:
        return {"error": str(exc)}


def _read_only_on_rank1(directory: Path) -> dict:
    """prepare_checkpoint_dir under on_every_rank (as build_run calls it) where rank 1's mount is
    read-only: both ranks stop, rather than rank 0 going on into the shared-directory check."""
    import os

    from ascender_dist.config.errors import UserError
    from ascender_dist.training import checkpoint as ckpt
    from ascender_dist.training.guard import on_every_rank

    writable = os.access if dist.get_rank() == 0 else (lambda path, mode: False)
    with mock.patch.object(os, "access", writable):
        try:
            on_every_rank(lambda: ckpt.prepare_checkpoint_dir(directory))
            ckpt.check_shared_dir(directory)
            return {"error": None}
        except UserError as exc:
            return {"error": str(exc), "rank": getattr(exc, "rank", None)}


def main(args):
    import ascender_dist.training.run  # noqa: F401  (megatron and deepspeed: a slow first import, before
    # any collective can time out on the other rank waiting)

    root = Path(args["root"])
    _short_timeout_group(root)
    return run_checks({"shared_dir": lambda: _shared(root / "shared"),
                       "node_local_dir": lambda: _shared(root / f"local{dist.get_rank()}"),
                       "slow_conversion": lambda: _ensure(root, "step_00000001", fail=False),
                       "failed_conversion": lambda: _ensure(root, "step_00000002", fail=True),
                       "crashed_conversion": lambda: _ensure(root, "step_00000003", fail=False,
                                                             rank0_patches={"_universal_input_view": _crash}),
                       "writing_conversion": lambda: _ensure(root, "step_00000005", fail=False, writing=True),
                       "raising_progress": lambda: _ensure(root, "step_00000006", fail=False, writing=True,
                                                           progress_raises=True),  # on every rank
                       "dead_rank0": lambda: _ensure(root, "step_00000004", fail=False,
                                                     rank0_patches={"_heartbeat": _silent,
                                                                    "_convert_to_universal": _stuck}),
                       "stale_latest": lambda: _resume_tag(root / "stale", [1, 2], 2, stale_on_rank1=True),
                       "marker_not_visible": lambda: _resume_tag(root / "hidden", [1], 1, marker_hidden_on_rank1=True),
                       "latest_missing": lambda: _resume_tag(root / "missing", [1], None),
                       "meta_unreadable_rank1": lambda: _resume_tag(root / "meta", [1], 1, meta_unreadable_on_rank1=True),
                       "stale_listing": lambda: _hash_with_stale_listing(root / "step_00000009.partial"),
                       "init_from_rank1": _init_from_fails_on_rank1,
                       "os_error_rank1": _os_error_on_rank1,
                       "config_rank1": _config_differs_on_rank1,
                       "read_only_rank1": lambda: _read_only_on_rank1(root / "read-only")})
