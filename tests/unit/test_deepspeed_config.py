"""What training.deepspeed_config hands DeepSpeed for the parallel layouts (the distributed layout
matrix checks the training itself: tests/distributed/test_layouts.py)."""

from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.training.deepspeed_config import to_deepspeed_config


def _ds(tmp_path, **parallel):
    cfg = config_from_dict({"output_dir": str(tmp_path), "parallel": parallel, "model": {"vocab_size": 128}})
    return to_deepspeed_config(cfg, derive(cfg, world_size=4))


def test_pipeline_stages_exchange_whole_tensors_under_sequence_parallelism(tmp_path):
    """DeepSpeed's partitioned stage exchange assumes every TP rank holds the same activation; under
    sequence parallelism each holds its own slice, so the partitioning must be off."""
    ds = _ds(tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}


def test_without_sequence_parallelism_deepspeeds_partitioned_exchange_stays(tmp_path):
    for parallel in ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                     {"tensor_model_parallel_size": 2, "sequence_parallel": True}):
        assert "pipeline" not in _ds(tmp_path, **parallel)


def test_bf16_reduces_gradients_in_fp32_unless_asked_for_bf16(tmp_path):
    def ds(**train):
        cfg = config_from_dict({"output_dir": str(tmp_path), "model": {"vocab_size": 128},
                                "parallel": {"zero_stage": 1}, "train": train})
        return to_deepspeed_config(cfg, derive(cfg, world_size=2))

    bf16 = ds(precision="bf16")
    assert bf16["communication_data_type"] == "fp32" and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds(precision="bf16", grad_reduce_dtype="bf16")["communication_data_type"] == "bf16"
    assert "communication_data_type" not in ds(precision="fp32")


def test_bf16_gradient_reduction_needs_a_bf16_run():
    import pytest

    from ascender_dist.config import ConfigError

    with pytest.raises(ConfigError, match="train.grad_reduce_dtype: bf16 needs train.precision bf16"):
        config_from_dict({"train": {"grad_reduce_dtype": "bf16"}})
