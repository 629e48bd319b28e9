"""The MLP: column-parallel fc1, GELU or SwiGLU, row-parallel fc2.

With SwiGLU, fc1's global weight is ``[gate; up]`` (``2 * ffn`` rows); it is split with stride 2 so each TP
rank holds its slice of the gate rows followed by its slice of the up rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import ModelConfig
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear


def activation(h: torch.Tensor, swiglu: bool, openai_gelu: bool, use_triton_kernels: bool = False) -> torch.Tensor:
    """The MLP's activation on fc1's output: SwiGLU over ``[gate; up]`` (the fused kernel with
    ``--use-triton-kernels``), or GELU (tanh-approximated with ``--openai-gelu``)."""
    if swiglu and use_triton_kernels:
        return kernels.swiglu(h)
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if openai_gelu else "none")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool, output_init_std: float,
                 params_dtype=torch.float32, device=None, tp_group=None):
        super().__init__()
        c = config
        self.swiglu, self.openai_gelu = c.swiglu, c.openai_gelu
        self.use_triton_kernels = c.kernels.use_triton_kernels  # fused SwiGLU (megatronish.kernels)
        fc1_out = c.ffn_hidden_size * (2 if c.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(c.hidden_size, fc1_out, bias=c.add_bias_linear,
                                               sequence_parallel=sequence_parallel, init_std=c.init_method_std,
                                               stride=2 if c.swiglu else 1, params_dtype=params_dtype,
                                               device=device, tp_group=tp_group)
        self.linear_fc2 = RowParallelLinear(c.ffn_hidden_size, c.hidden_size, bias=c.add_bias_linear,
                                            input_is_parallel=True, skip_bias_add=True,
                                            sequence_parallel=sequence_parallel, init_std=output_init_std,
                                            params_dtype=params_dtype, device=device, tp_group=tp_group)

    def forward(self, x: torch.Tensor):
        h, _ = self.linear_fc1(x)  # [s, b, ffn/t] (x2 with SwiGLU)
        h = activation(h, self.swiglu, self.openai_gelu, self.use_triton_kernels)
        return self.linear_fc2(h)  # (out, bias)
