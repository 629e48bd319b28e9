"""LayerNorm and RMSNorm whose parameters carry their global description.

They are replicated over TP; under sequence parallelism each rank normalizes only its sequence chunk, so
their gradients are marked ``sequence_parallel`` (summed over TP after backward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..parallel.init import TensorDesc, set_desc


def _param(shape, init, sequence_parallel, dtype, device):
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    return set_desc(p, TensorDesc(tuple(shape), None, 1, init, sequence_parallel=sequence_parallel))


class LayerNorm(nn.Module):
    use_triton_kernels = False  # set per instance (GPTModel with --use-triton-kernels): fused Triton kernel

    def __init__(self, hidden: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), "ones", sequence_parallel, params_dtype, device)
        self.bias = _param((hidden,), "zeros", sequence_parallel, params_dtype, device)

    def forward(self, x):
        if self.use_triton_kernels:
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``."""

    use_triton_kernels = False  # set per instance (GPTModel with --use-triton-kernels): fused Triton kernel

    def __init__(self, hidden: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden,), "ones", sequence_parallel, params_dtype, device)

    def forward(self, x):
        if self.use_triton_kernels:
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def build_norm(kind: str, hidden: int, eps: float, sequence_parallel: bool, params_dtype, device) -> nn.Module:
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[kind]
    return cls(hidden, eps, sequence_parallel, params_dtype, device)
