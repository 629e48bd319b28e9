"""Fused SwiGLU on the MLP's fc1 output ``h = [gate, up]`` (last dimension ``2f``, gate first, as
:class:`megatronish.model.mlp.MLP` lays it out on every TP rank): ``out = silu(gate) * up`` in one pass, and
a backward that recomputes ``sigmoid(gate)`` from the saved ``h`` instead of keeping ``silu(gate)``:

``d_up = g * silu(a)``, ``d_gate = g * up * sigmoid(a) * (1 + a * (1 - sigmoid(a)))``.
"""
from __future__ import annotations

import torch

from ._triton import empty, exact_bf16, pow2, tl, to_out, triton


@triton.jit
def _swiglu_fwd(H, OUT, stride_h, stride_o, F, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    a = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(H + row * stride_h + F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(OUT + row * stride_o + cols, to_out(a * sig * b, OUT, EXACT_BF16), mask=mask)


@triton.jit
def _swiglu_bwd(H, G, DH, stride_h, stride_g, stride_dh, F, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    a = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(H + row * stride_h + F + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    silu = a * sig
    d_gate = g * b * (sig * (1.0 + a * (1.0 - sig)))
    d_up = g * silu
    tl.store(DH + row * stride_dh + cols, to_out(d_gate, DH, EXACT_BF16), mask=mask)
    tl.store(DH + row * stride_dh + F + cols, to_out(d_up, DH, EXACT_BF16), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(rows: int, f: int, block: int):
    return (rows, triton.cdiv(f, block))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        two_f = h.size(-1)
        if two_f % 2:
            raise ValueError(f"SwiGLU input's last dimension must be even ([gate, up]), got {two_f}")
        f = two_f // 2
        h2 = _rows(h, two_f)
        out = empty((h2.size(0), f), h.dtype, h.device)
        block = min(pow2(f), 1024)
        if h2.size(0) and f:
            _swiglu_fwd[_grid(h2.size(0), f, block)](h2, out, h2.stride(0), out.stride(0), f, BLOCK=block,
                                                      EXACT_BF16=exact_bf16(out.dtype))
        ctx.save_for_backward(h2)
        ctx.shape = h.shape
        return out.view(*h.shape[:-1], f)

    @staticmethod
    def backward(ctx, grad):
        (h2,) = ctx.saved_tensors
        rows, two_f = h2.shape
        f = two_f // 2
        g2 = _rows(grad, f)
        dh = empty((rows, two_f), h2.dtype, h2.device)
        block = min(pow2(f), 1024)
        if rows and f:
            _swiglu_bwd[_grid(rows, f, block)](h2, g2, dh, h2.stride(0), g2.stride(0), dh.stride(0), f, BLOCK=block,
                                               EXACT_BF16=exact_bf16(dh.dtype))
        return dh.view(ctx.shape)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[..., :f]) * h[..., f:]`` for ``h`` of last dimension ``2f``."""
    return _SwiGLU.apply(h)
