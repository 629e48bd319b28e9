"""Fused vocab-parallel cross entropy: the loss of :func:`megatronish.parallel.cross_entropy.
vocab_parallel_cross_entropy` (same all-reduces, same padded-vocabulary masking, same label smoothing)
without materializing the fp32 softmax.

Forward, one program per token, walking its local vocabulary slice in chunks of ``BLOCK_V``: the local max
and the sum of ``exp(x - running max)`` (online rescaling), the sum of the logits (label smoothing) and the
target's logit. The TP all-reduces then run on per-token vectors: the max (MAX), then target logit, sum of
exponentials (rescaled to the global max) and sum of logits together (SUM), as in the unfused version.
Saved for backward: the logits themselves (their dtype), the targets and two fp32 numbers per token.

Backward, again chunk by chunk: ``(exp(x - max) / sum_exp - (1 - smoothing) * [target] - smoothing / V) *
grad_loss`` (zero on padded entries), written over the logits' memory (the logits are not needed after this
backward, as Megatron consumes its saved softmax in place); the logits' version counter is bumped, so a second
backward through the same graph fails loudly instead of reading gradients as logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm_log as comm
from ..parallel.cross_entropy import loss_from_local_stats, vocab_partition
from ._triton import INTERPRETED, empty, exact_bf16, pow2, tl, to_out, triton


@triton.jit
def _ce_fwd(LOGITS, TARGET, MAX, SUMEXP, PRED, SUMX, stride_row, part, start, total_vocab,
            BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    sx = tl.zeros((), tl.float32)
    for c in range(0, part, BLOCK_V):
        offs = c + tl.arange(0, BLOCK_V)
        valid = (offs < part) & (start + offs < total_vocab)
        x = tl.load(ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # while every entry so far is padding (-inf), shift by 0 instead: exp(-inf - 0) = 0, never NaN
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        e = tl.where(valid, tl.exp(x - m_safe), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        sx += tl.sum(tl.where(valid, x, 0.0), axis=0)
        m = m_new
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(SUMX + row, sx)
    t = tl.load(TARGET + row) - start
    hit = (t >= 0) & (t < part)
    p = tl.load(ptr + tl.where(hit, t, 0), mask=hit, other=0.0).to(tl.float32)
    tl.store(PRED + row, p)


@triton.jit
def _ce_bwd(LOGITS, GRAD, TARGET, MAX, SUMEXP, GLOSS, stride_row, stride_grad, part, start, total_vocab,
            target_weight, delta, BLOCK_V: tl.constexpr, EXACT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    gptr = GRAD + row * stride_grad
    m = tl.load(MAX + row)
    se = tl.load(SUMEXP + row)
    g = tl.load(GLOSS + row)
    t = tl.load(TARGET + row) - start
    for c in range(0, part, BLOCK_V):
        offs = c + tl.arange(0, BLOCK_V)
        in_row = offs < part
        valid = in_row & (start + offs < total_vocab)
        x = tl.load(ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - m) / se
        p = p - tl.where(offs == t, target_weight, 0.0)
        p = p - tl.where(valid, delta, 0.0)
        tl.store(gptr + offs, to_out(p * g, GRAD, EXACT_BF16), mask=in_row)


def _block_v(part: int, block_v: int | None) -> int:
    if block_v is not None:
        return pow2(block_v)
    return min(pow2(part), 256 if INTERPRETED else 4096)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, group, block_v, inplace_backward):
        world, part, start, total_vocab = vocab_partition(logits, vocab_size, group)
        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in (0, 1), got {label_smoothing}")
        x2 = logits.reshape(-1, part)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n = x2.size(0)
        tgt = target.reshape(-1).contiguous()
        dev = logits.device
        local_max, local_sum, pred, sum_x = (empty((n,), torch.float32, dev) for _ in range(4))
        block = _block_v(part, block_v)
        if n:
            _ce_fwd[(n,)](x2, tgt, local_max, local_sum, pred, sum_x, x2.stride(0), part, start, total_vocab,
                          BLOCK_V=block, num_warps=_warps(block))
        logits_max = local_max.clone()
        if world > 1:
            comm.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # this slice's sum of exponentials relative to the global max (0 for a slice that is all padding)
        rescale = torch.where(local_max == float("-inf"), 0.0, torch.exp(local_max - logits_max))
        outside = (tgt < start) | (tgt >= start + part)
        predicted = torch.where(outside, 0.0, pred - logits_max)
        stats = [predicted, local_sum * rescale]
        if label_smoothing > 0:  # sum of the shifted logits of this slice's true entries
            n_valid = max(0, min(part, total_vocab - start))
            stats.append(sum_x - n_valid * logits_max)
        loss, sum_exp, smoothing = loss_from_local_stats(stats, group, world, label_smoothing, total_vocab)
        # the input itself when x2 is a view of it (so autograd's version check names the input)
        ctx.save_for_backward(logits if x2.data_ptr() == logits.data_ptr() else x2, tgt, logits_max, sum_exp)
        ctx.shape, ctx.start, ctx.total_vocab, ctx.smoothing = logits.shape, start, total_vocab, smoothing
        ctx.block, ctx.inplace = block, inplace_backward
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        saved, tgt, logits_max, sum_exp = ctx.saved_tensors
        part = ctx.shape[-1]
        x2 = saved.reshape(-1, part)
        n = x2.size(0)
        g = grad_loss.reshape(-1).float().contiguous()
        grad = x2 if ctx.inplace else empty((n, part), x2.dtype, x2.device)
        if n:
            _ce_bwd[(n,)](x2, grad, tgt, logits_max, sum_exp, g, x2.stride(0), grad.stride(0), part, ctx.start,
                          ctx.total_vocab, 1.0 - ctx.smoothing, ctx.smoothing / ctx.total_vocab, BLOCK_V=ctx.block,
                          EXACT_BF16=exact_bf16(grad.dtype), num_warps=_warps(ctx.block))
        if ctx.inplace:
            torch.autograd.graph.increment_version(saved)  # the logits now hold their gradient
        return grad.reshape(ctx.shape), None, None, None, None, None, None


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None, group=None, *,
                                 block_v: int | None = None, inplace_backward: bool = True) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (fp32) from logits ``[s, b, V/t]`` and targets ``[s, b]``; arguments as
    :func:`megatronish.parallel.cross_entropy.vocab_parallel_cross_entropy`. ``block_v``: vocabulary chunk
    per step (a power of two; default 4096 compiled); ``inplace_backward=False`` writes the gradient to a
    new buffer instead of over the logits."""
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size,
                                                 group, block_v, inplace_backward)
