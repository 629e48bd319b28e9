"""Rotary position embedding, rotate-half convention (Megatron's default and Hugging Face Llama's), and YaRN's
frequency scaling.

YaRN (``--position-embedding-type yarn``, or multi-latent attention's ``--rope-type yarn``): the inverse
frequencies blend the original ones (``1 / base^(2i/d)``, kept for the fast-rotating pairs) with interpolated ones
(divided by ``--rotary-scaling-factor``, for the slow ones) through a linear ramp over the pairs whose number of
rotations over ``--yarn-original-max-position-embeddings`` positions lies between ``--yarn-beta-fast`` and
``--yarn-beta-slow``; cos and sin are multiplied by the attention factor ``mscale(factor, --mscale) /
mscale(factor, --mscale-all-dim)`` (``mscale(factor)`` alone when either is 0), ``mscale(f, m) = 0.1 m ln f + 1``
(1 for ``f <= 1``). Multi-latent attention also multiplies its softmax scale by ``mscale(factor,
--mscale-all-dim)^2`` (:func:`yarn_softmax_mscale`). Hugging Face's ``_compute_yarn_parameters`` computes the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters, resolved (Megatron's defaults for the flags left unset)."""

    factor: float = 1.0  # --rotary-scaling-factor
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True  # --yarn-correction-range-round-to-int

    @classmethod
    def from_config(cls, attention) -> "YarnScaling":
        """From an :class:`~megatronish.model_config.AttentionConfig`."""
        def given(value, default):
            return default if value is None else value
        a = attention
        return cls(a.rotary_scaling_factor, given(a.yarn_original_max_position_embeddings, 4096),
                   given(a.yarn_beta_fast, 32.0), given(a.yarn_beta_slow, 1.0), a.mscale, a.mscale_all_dim,
                   given(a.yarn_correction_range_round_to_int, True))

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        """``[dim/2]``: the original frequencies for fast pairs, ``/ factor`` for slow ones, a ramp between."""
        def pair(rotations):  # the pair index that turns `rotations` times over the original context
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(base))
        low, high = pair(self.beta_fast), pair(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: scale
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return 1.0 / (self.factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)


def yarn_softmax_mscale(attention) -> float:
    """Multi-latent attention's softmax-scale factor: ``mscale(factor, --mscale-all-dim)^2`` under YaRN, else 1."""
    if not attention.yarn:
        return 1.0
    return yarn_get_mscale(attention.rotary_scaling_factor, attention.mscale_all_dim) ** 2


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` tables for the first ``rot_dim = kv_channels * rotary_percent`` channels of a head
    (``yarn``: YaRN's frequencies, and its attention factor on both tables).

    With ``use_triton_kernels`` set (GPTModel, ``--use-triton-kernels``) the tables come with a third item,
    ``True``, so that ``apply_rotary(x, *tables)`` rotates ``x`` in place with the fused kernel."""

    use_triton_kernels = False

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000,
                 yarn: YarnScaling | None = None):
        super().__init__()
        self.rot_dim = int(kv_channels * rotary_percent)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dimension {self.rot_dim} must be even (--kv-channels x --rotary-percent)")
        if yarn is None:
            inv_freq = 1.0 / (rotary_base ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float32) / self.rot_dim))
        else:
            inv_freq = yarn.inv_freq(self.rot_dim, rotary_base)
        self.attention_factor = 1.0 if yarn is None else yarn.attention_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq_len, dtype=torch.float32, device=device or self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq.to(pos.device))  # [s, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, rot]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if self.use_triton_kernels:
            return cos, sin, True
        return cos, sin


def rotary_embedding(config) -> RotaryEmbedding | None:
    """The model's rotary tables (None without rotary positions): over ``kv_channels * --rotary-percent``, or
    multi-latent attention's ``--qk-pos-emb-head-dim``; YaRN's when :attr:`AttentionConfig.yarn`."""
    a = config.attention
    if not a.rotary:
        return None
    yarn = YarnScaling.from_config(a) if a.yarn else None
    if a.multi_latent_attention:
        return RotaryEmbedding(a.qk_pos_emb_head_dim, 1.0, a.rotary_base, yarn)
    return RotaryEmbedding(config.kv_channels, a.rotary_percent, a.rotary_base, yarn)


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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: the rotated pairs are channels ``(0, 1), (2, 3), ...``; they are gathered to
    ``[even; odd]`` and rotated half against half, so the output is in that gathered order (as Megatron's
    ``mla_rotary_interleaved`` and Hugging Face's ``rope_interleave`` leave it)."""
    return apply_rotary(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
