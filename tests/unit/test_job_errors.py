"""Process-group timeout and the one-line error machinery (parallel/setup.py, parallel/job_errors.py)."""

from __future__ import annotations

import io
import os
from datetime import timedelta
from unittest import mock

import pytest

from ascender_dist.parallel import job_errors, setup
from tests.helpers.multiproc import free_port


@pytest.fixture
def fresh_launch_env(monkeypatch):
    """A 1-rank launcher environment on a free port; the process's job store is restored after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(setup, "_job_store", None)


@pytest.mark.parametrize("cuda, backend", [(True, "nccl"), (False, "gloo")])
def test_distributed_timeout_reaches_the_process_group_init(fresh_launch_env, cuda, backend):
    with mock.patch("torch.distributed.is_initialized", return_value=False), \
            mock.patch("torch.cuda.is_available", return_value=cuda), \
            mock.patch("torch.cuda.set_device"), mock.patch("torch.cuda.device_count", return_value=1), \
            mock.patch("torch.distributed.init_process_group") as init_pg, \
            mock.patch("deepspeed.init_distributed") as init_ds:
        setup.init_process_group(timeout_minutes=7)
    init_pg.assert_called_once()
    kwargs = init_pg.call_args.kwargs
    assert kwargs["backend"] == backend and kwargs["timeout"] == timedelta(minutes=7)
    assert kwargs["rank"] == 0 and kwargs["world_size"] == 1 and kwargs["store"] is setup.existing_job_store()
    assert init_ds.call_args.kwargs["timeout"] == timedelta(minutes=7)
    assert init_ds.call_args.kwargs["dist_backend"] == backend


def test_default_timeout_is_ten_minutes():
    from ascender_dist.config.schema import ParallelConfig

    assert ParallelConfig().distributed_timeout_minutes == 10 == setup.DEFAULT_TIMEOUT_MINUTES


def test_a_line_is_written_in_one_piece(tmp_path):
    path = tmp_path / "err"
    with open(path, "w") as stream:
        writes = []
        real_write = os.write

        def record(fd, data):
            writes.append(data)
            return real_write(fd, data)

        with mock.patch("os.write", side_effect=record):
            job_errors.write_line("error: rank 1: two\nlines", stream)
    assert writes == [b"error: rank 1: two lines\n"] and path.read_text() == "error: rank 1: two lines\n"
    buffer = io.StringIO()  # not a file (pytest's capture): still one write of the whole line
    job_errors.write_line("error: x", buffer)
    assert buffer.getvalue() == "error: x\n"


def test_the_collective_of_a_timeout_is_named():
    import torch.distributed as dist

    def waits_in_all_reduce():
        def all_reduce():  # a stand-in frame "inside" torch.distributed, where gloo raises
            raise RuntimeError("[pair.cc:534] Timed out waiting 60000ms for recv operation to complete")
        all_reduce.__code__ = all_reduce.__code__.replace(co_filename=dist.distributed_c10d.__file__)
        all_reduce()

    with pytest.raises(RuntimeError) as info:
        waits_in_all_reduce()
    assert job_errors.is_timeout(info.value)
    assert job_errors.collective_name(info.value) == "all_reduce"
    assert job_errors._timeout_minutes(info.value) == 1
    assert not job_errors.is_timeout(RuntimeError("Timed out"))  # not raised inside torch.distributed


def test_distributed_timeout_reaches_megatrons_model_parallel_groups():
    """DeepSpeed reduces gradients over megatron's data-parallel group: its timeout must be ours
    (megatron's default is 30 minutes)."""

    class Called(Exception):
        pass

    with mock.patch("megatron.core.parallel_state.model_parallel_is_initialized", return_value=False), \
            mock.patch("megatron.core.parallel_state.initialize_model_parallel", side_effect=Called) as init_mp, \
            mock.patch("ascender_dist.compat.megatron_cpu.install_if_needed"):
        with pytest.raises(Called):
            setup.init_model_parallel(2, 1, seed=0, timeout_minutes=7)
    assert init_mp.call_args.kwargs == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                                        "distributed_timeout_minutes": 7}


def test_a_command_line_mistake_under_a_multi_rank_launch_is_the_jobs_one_error_line(monkeypatch, capsys):
    """Every rank printed argparse's usage block (the top-level one, which never mentions --set):
    one line for the job instead, through the user-error report; the launchers' --local-rank=N
    (torch.distributed.launch's spelling) is dropped like DeepSpeed's --local_rank=N (found by a review)."""
    from ascender_dist import cli

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    reported = []
    monkeypatch.setattr(job_errors, "connect", lambda: None)
    monkeypatch.setattr(job_errors, "report", lambda message, about_rank=None: reported.append(message))
    assert cli.main(["train", "--config", "x.yaml", "--set-x=1", "--local-rank=1"]) == 2
    # the subcommand's parser names it (its --help lists --set; the top-level one's does not)
    assert reported == ["ascender-dist train: unrecognized arguments: --set-x=1 (see ascender-dist train --help)"]
    assert capsys.readouterr().err == ""  # no usage block
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: argparse's usage, as at a terminal
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "x.yaml", "--set-x=1"])
    assert "usage: ascender-dist train [-h] --config CONFIG [--set KEY=VALUE]" in capsys.readouterr().err
