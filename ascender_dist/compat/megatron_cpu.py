"""Run megatron-core on a machine without a GPU.

megatron-core calls CUDA unconditionally in a handful of places (``torch.cuda.current_device()``
as a ``device=`` argument, the CUDA RNG tracker, ``torch.cuda.synchronize``, hard-coded
``device="cuda"`` in factories, ``Tensor.cuda()``). On a CPU-only machine (our CI, every test,
the default demo) those calls fail, although the math itself runs fine over gloo.

This module patches those entry points at runtime (no megatron file is edited) so that the SAME
model code runs on CPU and GPU. It is installed only when no CUDA device is present
(:func:`install_if_needed`), and refuses a megatron-core version it was not written for, because
the call sites it covers were audited for exactly that version.

Patches (process-global; device contexts such as ``with torch.device("meta")`` keep working):
  1. ``torch.cuda.current_device()`` -> ``"cpu"``
  2. CUDA RNG state (megatron's tensor-parallel RNG tracker, activation recompute) -> the CPU generator
  3. ``torch.cuda.synchronize`` -> no-op
  4. factory functions with ``device="cuda"`` -> ``"cpu"`` (and ``pin_memory`` dropped)
  5. ``Tensor.cuda()``, ``Tensor.to("cuda")``, ``Tensor.pin_memory()`` -> stay on CPU
A ``TorchFunctionMode`` cannot do this: it is popped while its handler runs, so code inside an
``autograd.Function`` (activation recompute) escapes it.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

SUPPORTED_MEGATRON_CORE = ("0.16.1",)

_installed = False

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn",
    "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "randn_like", "empty_strided", "eye",
)


class UnsupportedMegatronVersion(RuntimeError):
    pass


def megatron_core_version() -> Optional[str]:
    from ascender_dist.versions import package_version

    return package_version("megatron-core")


def is_installed() -> bool:
    return _installed


def install_if_needed() -> bool:
    """Install the CPU layer when (and only when) no CUDA device is usable. Returns True if installed."""
    if torch.cuda.is_available():
        return False
    install()
    return True


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int index means cuda:N


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory_on_cpu(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory_on_cpu.__ascender_cpu_compat__ = True
    return factory_on_cpu


def _patch_current_device_and_sync() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None


def _patch_rng() -> None:
    """Route the 'CUDA' RNG stream to the CPU generator so megatron's RNG tracker works unchanged."""

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    def manual_seed(seed):
        # not torch.manual_seed: that calls cuda.manual_seed_all and would recurse into us
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = lambda seed: None

    import megatron.core.tensor_parallel.random as mrandom

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    # fork() warns "CPU RNG state changed within GPU RNG context" on every call on CPU
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


def _patch_factories() -> None:
    # `with torch.device(...)` and torch.set_default_device recognise factories by identity, in a
    # set torch builds once (lru_cache) on first use. Build it now, from the original functions:
    # built after the swap it would hold our wrappers, never the originals they call, and every
    # later device context would silently be ignored (measured: Hugging Face models loaded after
    # megatron got uninitialised RoPE buffers from transformers' meta-device init).
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__ascender_cpu_compat__", False):
            setattr(torch, name, _wrap_factory(fn))


def _patch_tensor_methods() -> None:
    tensor_cls = torch.Tensor
    original_to = tensor_cls.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + tuple(args[1:])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    tensor_cls.cuda = lambda self, *a, **k: self
    tensor_cls.to = to
    tensor_cls.pin_memory = lambda self, *a, **k: self


def install() -> None:
    """Install all patches once per process. Call before building any megatron object."""
    global _installed
    if _installed:
        return
    found = megatron_core_version()
    if found not in SUPPORTED_MEGATRON_CORE:
        raise UnsupportedMegatronVersion(
            f"megatron-core {found or '(not installed)'}: the CPU compatibility layer was written for "
            f"{', '.join(SUPPORTED_MEGATRON_CORE)}; install megatron-core=={SUPPORTED_MEGATRON_CORE[-1]}"
        )
    _patch_current_device_and_sync()
    _patch_rng()
    _patch_factories()
    _patch_tensor_methods()
    _installed = True
