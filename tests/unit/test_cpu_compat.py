"""The megatron-core CPU layer refuses versions it was not written for and keeps megatron on the CPU."""

import pytest
import torch

from ascender_dist.compat import megatron_cpu


def test_refuses_unknown_megatron_version(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_installed", False)
    monkeypatch.setattr(megatron_cpu, "megatron_core_version", lambda: "0.99.0")
    with pytest.raises(megatron_cpu.UnsupportedMegatronVersion, match="megatron-core 0.99.0"):
        megatron_cpu.install()


def test_installed_only_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.install_if_needed() is False


def test_cuda_requests_land_on_cpu():
    assert not torch.cuda.is_available(), "this test documents the CPU-only path"
    megatron_cpu.install_if_needed()
    assert megatron_cpu.is_installed()
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
