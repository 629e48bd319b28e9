"""Rotary position embedding, rotate-half convention (Megatron's default and Hugging Face Llama's)."""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` tables for the first ``rot_dim = kv_channels * rotary_percent`` channels of a head.

    With ``use_triton_kernels`` set (GPTModel, ``--use-triton-kernels``) the tables come with a third item,
    ``True``, so that ``apply_rotary(x, *tables)`` rotates ``x`` in place with the fused kernel."""

    use_triton_kernels = False

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000):
        super().__init__()
        self.rot_dim = int(kv_channels * rotary_percent)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dimension {self.rot_dim} must be even (--kv-channels x --rotary-percent)")
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float32) / self.rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq_len, dtype=torch.float32, device=device or self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq.to(pos.device))  # [s, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, rot]
        if self.use_triton_kernels:
            return emb.cos(), emb.sin(), True
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``x``: ``[s, b, heads, d]``; rotates the first ``cos.size(-1)`` channels, passes the rest.
    ``fused``: rotate ``x`` in place with the Triton kernel (``megatronish.kernels``) and return it."""
    if fused:
        return kernels.apply_rotary_(x, cos, sin)
    rot = cos.size(-1)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out
