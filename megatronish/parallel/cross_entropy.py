"""Vocab-parallel cross entropy: the loss from logits split over TP along the vocabulary, never gathered.

Megatron's algorithm (max, target logit, sum of exponentials, each reduced over TP), with two differences:
- the target logit, the sum of exponentials and (for label smoothing) the sum of logits travel in one
  all-reduce, so a call costs two collectives instead of three;
- logits of padded vocabulary entries (``>= vocab_size``) are excluded, so the padding rows are never
  predicted and the loss does not depend on how far the vocabulary was padded (that is, on TP);
- label smoothing uses the mean log-probability over the whole vocabulary (Megatron's averages only the
  local slice, which makes its smoothed loss depend on TP). The target distribution is Megatron's:
  ``1 - alpha`` on the target, ``alpha / (V - 1)`` on every other token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def loss_from_local_stats(stats: list, group, world: int, label_smoothing: float, total_vocab: int):
    """The one all-reduce of the per-token statistics of this rank's vocabulary slice, and the loss from it.

    ``stats``: ``[predicted, sum_exp]`` (the target's shifted logit where this slice holds the target, else 0;
    this slice's sum of ``exp(logit - global max)``), plus, with label smoothing, the sum of this slice's shifted
    true logits. Returns ``(loss, sum_exp, smoothing)``: the per-token loss, the global sum of exponentials and
    the weight ``alpha * V / (V - 1)`` that the backward spreads over the vocabulary (0 without smoothing)."""
    stats = torch.stack(stats)
    if world > 1:
        dist.all_reduce(stats, group=group)
    predicted, sum_exp = stats[0], stats[1]
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - predicted
    smoothing = 0.0
    if label_smoothing > 0:
        smoothing = label_smoothing * total_vocab / (total_vocab - 1)
        mean_log_probs = stats[2] / total_vocab - log_sum_exp
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss, sum_exp, smoothing


def vocab_partition(logits: torch.Tensor, vocab_size: int | None, group) -> tuple[int, int, int, int]:
    """``(TP size, entries of this rank's vocabulary slice, its first global index, true vocabulary size)`` for
    logits ``[..., V/t]`` split over ``group`` (``vocab_size`` None: no padding)."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    part = logits.size(-1)
    return world, part, rank * part, part * world if vocab_size is None else vocab_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, group):
        world, part, start, total_vocab = vocab_partition(logits, vocab_size, group)
        vocab_parallel_logits_dtype = logits.dtype
        logits = logits.float()  # [s, b, V/t], a copy for 16-bit inputs
        valid = None
        if total_vocab < part * world:  # mask padded entries of this slice
            valid = torch.arange(start, start + part, device=logits.device) < total_vocab
            logits = logits.masked_fill(~valid, float("-inf"))
        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        sum_logits = None
        if label_smoothing > 0:
            finite = shifted if valid is None else shifted.masked_fill(~valid, 0.0)
            sum_logits = finite.sum(dim=-1)
        exp = shifted.exp_()  # in place: `shifted` is not needed any more; padded entries: exp(-inf) = 0
        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in (0, 1), got {label_smoothing}")
        stats = [predicted, exp.sum(dim=-1)] + ([sum_logits] if sum_logits is not None else [])
        loss, sum_exp, smoothing = loss_from_local_stats(stats, group, world, label_smoothing, total_vocab)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, valid)
        ctx.smoothing, ctx.total_vocab, ctx.in_dtype = smoothing, total_vocab, vocab_parallel_logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, valid = ctx.saved_tensors
        grad = softmax  # consumed in place (as Megatron does): this backward runs once, no retain_graph
        hit = (~outside).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing > 0:
            delta = ctx.smoothing / ctx.total_vocab
            grad -= delta if valid is None else delta * valid.to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 group=None) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (fp32) from logits ``[s, b, V/t]`` and targets ``[s, b]``.

    ``vocab_size`` is the true (unpadded) vocabulary; entries past it are never predicted. The gradient
    w.r.t. the logits is returned in their dtype. ``group``: the tensor-parallel group the vocabulary is split
    over (None: not split).
    """
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size, group)
    return loss


# ---------------------------------------------------------------------------------------------------------------
# --cross-entropy-loss-fusion --cross-entropy-fusion-impl native: the same loss, fused in PyTorch (any device)
# ---------------------------------------------------------------------------------------------------------------
_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries per step: at most this many logits (16 MiB)


def _row_chunks(rows: int, part: int):
    step = max(1, _CHUNK_ELEMENTS // max(part, 1))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Forward walks the tokens in chunks (fp32 temporaries of one chunk at a time) and keeps, per token, only the
    global max and sum of exponentials; backward recomputes the softmax chunk by chunk and writes the gradient
    over the logits' own memory (they are not needed after this backward). Same all-reduces as the unfused
    function (the max, then one for the per-token statistics)."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, group):
        world, part, start, total_vocab = vocab_partition(logits, vocab_size, group)
        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in (0, 1), got {label_smoothing}")
        flat = logits.view(-1, part)
        rows = flat.size(0)
        valid = None
        if total_vocab < part * world:
            valid = torch.arange(start, start + part, device=logits.device) < total_vocab
        tgt = target.reshape(-1)
        outside = (tgt < start) | (tgt >= start + part)
        local_target = (tgt - start).masked_fill(outside, 0)

        logits_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for lo, hi in _row_chunks(rows, part):
            x = flat[lo:hi].to(torch.float32, copy=True)
            if valid is not None:
                x = x.masked_fill_(~valid, float("-inf"))
            logits_max[lo:hi] = x.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        predicted = torch.empty(rows, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(predicted)
        sum_logits = torch.empty_like(predicted) if label_smoothing > 0 else None
        for lo, hi in _row_chunks(rows, part):
            x = flat[lo:hi].to(torch.float32, copy=True).sub_(logits_max[lo:hi, None])
            if valid is not None:
                x = x.masked_fill_(~valid, float("-inf"))
            predicted[lo:hi] = x.gather(-1, local_target[lo:hi, None]).squeeze(-1).masked_fill_(outside[lo:hi], 0.0)
            if sum_logits is not None:
                sum_logits[lo:hi] = (x if valid is None else x.masked_fill(~valid, 0.0)).sum(dim=-1)
            sum_exp[lo:hi] = x.exp_().sum(dim=-1)
        stats = [predicted, sum_exp] + ([sum_logits] if sum_logits is not None else [])
        loss, sum_exp, smoothing = loss_from_local_stats(stats, group, world, label_smoothing, total_vocab)
        ctx.save_for_backward(logits, local_target, outside, logits_max, sum_exp, valid)
        ctx.smoothing, ctx.total_vocab = smoothing, total_vocab
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, outside, logits_max, sum_exp, valid = ctx.saved_tensors
        part = logits.size(-1)
        grad = logits.view(-1, part)  # overwritten in place, chunk by chunk
        g = grad_loss.reshape(-1).float()
        hit = (~outside).float() * (1.0 - ctx.smoothing)
        delta = ctx.smoothing / ctx.total_vocab
        for lo, hi in _row_chunks(grad.size(0), part):
            x = grad[lo:hi].float().sub_(logits_max[lo:hi, None])
            if valid is not None:
                x = x.masked_fill_(~valid, float("-inf"))
            p = x.exp_().div_(sum_exp[lo:hi, None])
            p.scatter_add_(-1, local_target[lo:hi, None], -hit[lo:hi, None])
            if delta:
                p -= delta if valid is None else delta * valid.float()
            grad[lo:hi] = p.mul_(g[lo:hi, None])
        return logits, None, None, None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                       label_smoothing: float = 0.0, vocab_size: int | None = None,
                                       group=None) -> torch.Tensor:
    """:func:`vocab_parallel_cross_entropy`'s loss and gradient without holding the fp32 softmax between forward
    and backward (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native``): plain PyTorch, any device.
    The logits' memory receives their gradient in backward."""
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size, group)
