"""The megatron-core CPU layer refuses versions it was not written for and keeps megatron on the CPU."""

import subprocess
import sys

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is installed only where CUDA is absent")
def test_cuda_requests_land_on_cpu():
    megatron_cpu.install_if_needed()
    assert megatron_cpu.is_installed()
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_device_contexts_still_work_when_installed_first():
    """In a fresh process (torch caches the set of factories a device context intercepts on first
    use): install the layer, then build tensors under torch.device("meta") and the default-device
    setting, as transformers does while loading a model. They must land on the meta device."""
    code = (
        "import torch\n"
        "from ascender_dist.compat import megatron_cpu\n"
        "megatron_cpu.install()\n"
        "with torch.device('meta'):\n"
        "    made = [torch.arange(4), torch.zeros(2), torch.empty(3), torch.full((2,), 1.0)]\n"
        "torch.set_default_device('meta')\n"
        "made.append(torch.ones(2))\n"
        "torch.set_default_device('cpu')\n"
        "print(','.join(t.device.type for t in made), torch.zeros(1, device='cuda').device.type)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["meta,meta,meta,meta,meta", "cpu"]
