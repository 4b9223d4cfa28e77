"""Session-wide test setup.

TRITON_INTERPRET=1 where no CUDA device exists, before anything imports triton (torch._dynamo,
megatron.core and torch.compile import it as a side effect): the interpreter is chosen when
triton is first imported, and the ASCender Triton kernel tests then run on CPU tensors
(tests/unit/test_ascender_triton.py checks it took effect).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
