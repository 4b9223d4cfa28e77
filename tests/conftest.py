"""Session-wide test setup.

TRITON_INTERPRET=1 where no CUDA device exists, before anything imports triton (torch._dynamo,
megatron.core and torch.compile import it as a side effect): the interpreter is chosen when
triton is first imported, and the ASCender Triton kernel tests then run on CPU tensors
(tests/unit/test_ascender_triton.py checks it took effect).
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_interpreter_setting_kept():
    """A test must leave TRITON_INTERPRET as it found it: the Triton path reads the variable at every
    call (kernels.support.interpreter_requested), so a test that removed it would send every later
    test of its worker that asks for impl "triton" down the torch path, passing without running a
    kernel. The setting is restored and the test that changed it fails."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
        pytest.fail(f"the test changed TRITON_INTERPRET ({before!r} -> {after!r}); restored", pytrace=False)


@pytest.fixture(autouse=True)
def _transformers_handler_not_left_on_a_closed_stream():
    """transformers binds its default log handler to sys.stderr when it first logs: inside a
    test with capsys that is the test's capture buffer, closed afterwards, and every later
    transformers warning would print a logging traceback into another test's stderr (the test
    order of pytest-xdist made one such test fail). After each test its messages go to the root
    logger instead, which pytest captures per test."""
    yield
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


@pytest.fixture(autouse=True)
def _aux_loss_scale_restored():
    """Building a Trainer sets the process-wide ASCender aux-loss gradient scale (1 / (accumulation x
    TP), training.run); a later test of the same worker that checks the aux gradient at scale 1 failed
    when it ran after one (test order). Each test starts at, and leaves, the scale it found."""
    from ascender_dist.models.ascender.common import AttachAuxLoss, set_aux_loss_scale

    before = AttachAuxLoss.scale
    yield
    set_aux_loss_scale(before)
