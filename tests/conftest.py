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
