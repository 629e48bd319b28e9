"""Fused RMSNorm and LayerNorm over the last dimension: one program per row in forward; in backward each
program walks a band of rows, writes their input gradients and keeps its band's weight/bias gradient partial
sums in registers (fp32), which are then summed over the bands.

Saved for backward: the input, the weight, and per row ``rstd`` (and ``mean`` for LayerNorm): no normalized
copy of the input.
"""
from __future__ import annotations

import torch

from ._triton import empty, exact_bf16, num_row_programs, pow2, tl, to_out, triton


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, H, eps,
              RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / H
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    var = tl.sum(xc * xc, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, to_out(y, Y, EXACT_BF16), mask=mask)


@triton.jit
def _norm_bwd(X, W, DY, DX, MEAN, RSTD, DW, DB, stride_x, stride_dy, stride_dx, rows, H, rows_per_program,
              RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # 64-bit row offsets: rows * stride may pass 2**31
    end = tl.minimum(start + rows_per_program, rows)
    for row in range(start, end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / H
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / H
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, to_out(dx, DX, EXACT_BF16), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW + pid * H + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * H + cols, db, mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        shape, hidden = x.shape, x.shape[-1]
        x2 = _rows(x, hidden)
        rows = x2.size(0)
        y = empty((rows, hidden), x.dtype, x.device)
        rstd = empty((rows,), torch.float32, x.device)
        mean = rstd if rms else empty((rows,), torch.float32, x.device)
        block = pow2(hidden)
        if rows:
            _norm_fwd[(rows,)](x2, weight, weight if bias is None else bias, y, mean, rstd, x2.stride(0),
                               y.stride(0), hidden, eps, RMS=rms, HAS_BIAS=bias is not None, BLOCK=block,
                               EXACT_BF16=exact_bf16(y.dtype), num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.shape = rms, bias is not None, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = _rows(dy, hidden)
        dx = empty((rows, hidden), x2.dtype, x2.device)
        programs = num_row_programs(rows, x2.device)
        per = triton.cdiv(max(rows, 1), programs)
        programs = triton.cdiv(max(rows, 1), per)
        dw = empty((programs, hidden), torch.float32, x2.device)
        db = empty((programs, hidden), torch.float32, x2.device) if ctx.has_bias else dw
        block = pow2(hidden)
        _norm_bwd[(programs,)](x2, weight, dy2, dx, mean, rstd, dw, db, x2.stride(0), dy2.stride(0), dx.stride(0),
                               rows, hidden, per, RMS=ctx.rms, HAS_BIAS=ctx.has_bias, BLOCK=block,
                               EXACT_BF16=exact_bf16(dx.dtype), num_warps=_warps(block))
        grad_w = dw.sum(0).to(weight.dtype)
        grad_b = db.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), grad_w, grad_b, None, None


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _FusedNorm.apply(x, weight, None, float(eps), True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _FusedNorm.apply(x, weight, bias, float(eps), False)
