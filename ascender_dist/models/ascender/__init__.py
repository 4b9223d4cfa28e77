"""ASCender attention (Alignment-Separation-Cohesion biases on attention scores), pure torch.

Public API:
    AscenderHParams        - hyper-parameters (config ``model.ascender``), .validate(prefix, head_dim)
    AscenderHeadParams     - per-head learned tensors for the TP-local heads (dim 0 = heads)
    ascender_attention     - entry point: (q, k, v, z, h, params, hp, *, step, ...) -> out
    reference_attention    - dense O(s^2) reference (maps for visualisation, tests)
    fast_attention         - chunked O(s * (window + chunk)) path
    kernels.triton_attention - the same through Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)
    set_aux_loss_scale     - gradient scale of the aux losses attached to the output
"""

from .attention import ascender_attention
from .common import set_aux_loss_scale
from .fast import fast_attention
from ascender_dist.config.ascender_hparams import AscenderHParams
from .params import AscenderHeadParams
from .reference import AscenderResult, reference_attention

__all__ = [
    "AscenderHParams",
    "AscenderHeadParams",
    "AscenderResult",
    "ascender_attention",
    "fast_attention",
    "reference_attention",
    "set_aux_loss_scale",
]
