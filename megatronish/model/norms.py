"""LayerNorm and RMSNorm whose parameters carry their global description.

They are replicated over TP; under sequence parallelism each rank normalizes only its sequence chunk, so
their gradients are marked ``sequence_parallel`` (summed over TP after backward).

``zero_centered`` (``--apply-layernorm-1p``, Megatron's zero-centered gamma): the weight starts at 0 and the norm
scales by ``1 + weight``, so weight decay pulls the scale towards 1 instead of 0.
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


class _Norm(nn.Module):
    use_triton_kernels = False  # set per instance (GPTModel with --use-triton-kernels): fused Triton kernel

    def __init__(self, hidden: int, eps: float, sequence_parallel: bool, params_dtype, device, zero_centered: bool):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = _param((hidden,), "zeros" if zero_centered else "ones", sequence_parallel, params_dtype, device)

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight


class LayerNorm(_Norm):
    def __init__(self, hidden: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None, zero_centered: bool = False):
        super().__init__(hidden, eps, sequence_parallel, params_dtype, device, zero_centered)
        self.bias = _param((hidden,), "zeros", sequence_parallel, params_dtype, device)

    def forward(self, x):
        if self.use_triton_kernels:
            return kernels.layer_norm(x, self.scale(), self.bias, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.scale(), self.bias, self.eps)


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, hidden: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None, zero_centered: bool = False):
        super().__init__(hidden, eps, sequence_parallel, params_dtype, device, zero_centered)

    def forward(self, x):
        if self.use_triton_kernels:
            return kernels.rms_norm(x, self.scale(), self.eps)
        return F.rms_norm(x, x.shape[-1:], self.scale(), self.eps)


def build_norm(kind: str, hidden: int, eps: float, sequence_parallel: bool, params_dtype, device,
               zero_centered: bool = False) -> nn.Module:
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[kind]
    return cls(hidden, eps, sequence_parallel, params_dtype, device, zero_centered)
