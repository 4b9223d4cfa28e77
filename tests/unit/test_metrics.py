"""Throughput and MFU arithmetic (the numbers MFU targets are judged by)."""

import pytest

from ascender_dist.training.metrics import peak_tflops_per_device, throughput


def test_mfu_hand_computed():
    # 6 GFLOPs/token x 1e5 tokens/s over 2 devices = 300 TFLOP/s each; peak 1000 -> 30 %
    values = throughput(6e9, 1e5, 2, 1000.0)
    assert values["train/tflops_per_device"] == pytest.approx(300.0)
    assert values["train/mfu"] == pytest.approx(0.3)


def test_no_mfu_without_a_peak():
    assert "train/mfu" not in throughput(6e9, 1e5, 2, None)
    assert peak_tflops_per_device(None) is None  # CPU machine: nothing to compare against
    assert peak_tflops_per_device(400.0) == 400.0


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
                                        ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("Tesla V100-SXM2-32GB", None)])
def test_peak_by_device_name(monkeypatch, name, peak):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert peak_tflops_per_device(None) == peak


def test_cuda_peak_mib_is_the_peak_above_what_was_allocated_before(monkeypatch):
    """The CUDA memory counters are faked (no GPU here): 3 MiB before, a 7 MiB high-water mark during fn."""
    import torch

    from ascender_dist.training.metrics import cuda_peak_mib

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 7 * 2**20)
    assert cuda_peak_mib(lambda: calls.append("fn")) == 4.0
    assert calls == ["sync", "reset", "fn", "sync"]


def test_an_output_dir_that_is_a_file_is_one_line_naming_output_dir(tmp_path):
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.training.metrics import prepare_log_dir

    (tmp_path / "out").write_text("not a directory")
    target = tmp_path / "out" / "tensorboard"
    with pytest.raises(ConfigError) as info:
        prepare_log_dir(target)
    message = str(info.value)
    assert message.startswith(f"output_dir: {target}: cannot create the TensorBoard directory") and "\n" not in message
