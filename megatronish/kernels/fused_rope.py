"""Fused rotary position embedding (rotate-half convention, as :func:`megatronish.model.rope.apply_rotary`),
applied in place to ``x`` ``[s, b, heads, d]`` of any strides: one program per ``(s, b)`` rotates the first
``rot = cos.size(-1)`` channels of every head and leaves the rest. Backward applies the transposed rotation
to the incoming gradient (and copies the pass-through channels); nothing but the tables is saved.

With ``x1, x2`` the two halves of the rotated channels and ``c, s`` the tables (halves ``c1, c2, s1, s2``):
``out1 = x1*c1 - x2*s1``, ``out2 = x2*c2 + x1*s2``; the gradient is ``g1*c1 + g2*s2`` and ``g2*c2 - g1*s1``.
"""
from __future__ import annotations

import torch

from ._triton import empty, exact_bf16, pow2, tl, to_out, triton


@triton.jit
def _rope(X, COS, SIN, OUT, B, NH, sx_s, sx_b, sx_h, sx_d, so_s, so_b, so_h, so_d, sc_s, ss_s, HALF, D,
          BACKWARD: tl.constexpr, COPY_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
          BLOCK_PASS: tl.constexpr, EXACT_BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    s = pid // B
    b = pid % B
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NH) & (cols < HALF)
    xp = X + s * sx_s + b * sx_b + heads * sx_h
    op = OUT + s * so_s + b * so_b + heads * so_h
    x1 = tl.load(xp + cols * sx_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + (cols + HALF) * sx_d, mask=mask, other=0.0).to(tl.float32)
    cmask = cols < HALF
    c1 = tl.load(COS + s * sc_s + cols, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + s * sc_s + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + s * ss_s + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + s * ss_s + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(op + cols * so_d, to_out(y1, OUT, EXACT_BF16), mask=mask)
    tl.store(op + (cols + HALF) * so_d, to_out(y2, OUT, EXACT_BF16), mask=mask)
    if COPY_PASS:  # channels past the rotated ones: gradient passes through
        for start in range(2 * HALF, D, BLOCK_PASS):
            pc = start + tl.arange(0, BLOCK_PASS)[None, :]
            pmask = (heads < NH) & (pc < D)
            v = tl.load(xp + pc * sx_d, mask=pmask, other=0.0)
            tl.store(op + pc * so_d, v, mask=pmask)


def _launch(x, cos, sin, out, backward):
    s, b, nh, d = x.shape
    rot = cos.size(-1)
    if rot % 2 or rot > d:
        raise ValueError(f"rotary tables of width {rot} do not fit heads of size {d} (need an even width <= d)")
    if cos.size(0) < s:
        raise ValueError(f"rotary tables cover {cos.size(0)} positions, the input has {s}")
    cos2, sin2 = cos.reshape(cos.size(0), rot), sin.reshape(sin.size(0), rot)
    if cos2.stride(-1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(-1) != 1:
        sin2 = sin2.contiguous()
    half = rot // 2
    if s * b == 0 or rot == 0 and not backward:
        return
    _rope[(s * b,)](x, cos2, sin2, out, b, nh, *x.stride(), *out.stride(), cos2.stride(0), sin2.stride(0), half, d,
                    BACKWARD=backward, COPY_PASS=backward and rot < d, BLOCK_H=pow2(nh), BLOCK_HALF=pow2(half),
                    BLOCK_PASS=pow2(min(d - rot, 128)) if rot < d else 1, EXACT_BF16=exact_bf16(out.dtype))


class _RotaryInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        _launch(x, cos, sin, x, backward=False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        out = empty(grad.shape, grad.dtype, grad.device)
        _launch(grad, cos, sin, out, backward=True)
        return out, None, None


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` in place with tables ``cos``/``sin`` ``[>= s, 1, 1, rot]``; returns ``x``."""
    if x.dim() != 4:
        raise ValueError(f"fused RoPE expects [s, b, heads, d], got shape {tuple(x.shape)}")
    return _RotaryInplace.apply(x, cos, sin)
