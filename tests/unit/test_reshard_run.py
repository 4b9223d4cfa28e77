"""The run ``reshard`` builds only writes a checkpoint into --out: no log sinks (TensorBoard, W&B) and
no output in the source run's directories, whatever the consolidated config or --set says; its
tokenizer must be the one the weights were trained with. (The integration test,
tests/integration/test_conversion.py, checks the source run's TensorBoard directory is untouched.)"""

from __future__ import annotations

import shutil

import pytest

from ascender_dist.tools.convert import ConversionError, check_reshard_tokenizer, read_consolidated, reshard_config
from tests.helpers.errors import one_line

from .export_fixtures import run_with_tokenizer, two_tokenizers  # noqa: F401  (fixtures)


def test_the_reshard_run_has_no_log_sinks_and_writes_under_out(run_with_tokenizer, tmp_path):
    _, cfg, _ = read_consolidated(run_with_tokenizer)
    overrides = ["output_dir=/source/run", "logging.tensorboard=true", "logging.wandb.project=source-project",
                 "logging.wandb.entity=team", "logging.wandb.mode=offline", "parallel.tensor_model_parallel_size=2"]
    out = tmp_path / "resharded"
    resharded = reshard_config(cfg, out, overrides, run_with_tokenizer / "config.yaml", data_parallel=1)
    assert resharded.logging.tensorboard is False and resharded.logging.wandb.project == ""
    assert resharded.logging.wandb.entity is None  # an entity alone is refused (W&B needs its project)
    assert resharded.output_dir == str(out) and resharded.checkpoint.dir == str(out)
    assert resharded.parallel.tensor_model_parallel_size == 2  # the layout overrides still apply


def test_reshard_refuses_a_run_tokenizer_that_is_not_the_weights_one(run_with_tokenizer, two_tokenizers):
    ours, other = two_tokenizers
    _, cfg, meta = read_consolidated(run_with_tokenizer)
    check_reshard_tokenizer(cfg, meta, run_with_tokenizer / "meta.json")  # the recorded one
    shutil.copyfile(other, ours)
    with pytest.raises(ConversionError) as info:
        check_reshard_tokenizer(cfg, meta, run_with_tokenizer / "meta.json")
    one_line(info.value, str(ours), str(run_with_tokenizer / "meta.json"), "not the tokenizer the weights")
    ours.unlink()
    with pytest.raises(ConversionError) as info:
        check_reshard_tokenizer(cfg, meta, run_with_tokenizer / "meta.json")
    one_line(info.value, str(ours), "cannot read the run's tokenizer")
