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

from . import comm_log as comm


def loss_from_local_stats(stats: list, group, world: int, label_smoothing: float, total_vocab: int):
    """The one all-reduce of the per-token statistics of this rank's vocabulary slice, and the loss from it.

    ``stats``: ``[predicted, sum_exp]`` (the target's shifted logit where this slice holds the target, else 0;
    this slice's sum of ``exp(logit - global max)``), plus, with label smoothing, the sum of this slice's shifted
    true logits. Returns ``(loss, sum_exp, smoothing)``: the per-token loss, the global sum of exponentials and
    the weight ``alpha * V / (V - 1)`` that the backward spreads over the vocabulary (0 without smoothing)."""
    stats = torch.stack(stats)
    if world > 1:
        comm.all_reduce(stats, group=group)
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


_CACHE_BYTES = 1 << 22  # a row chunk of the softmax buffer that stays in cache between its passes (4 MiB)


def _row_chunks(rows: int, part: int, elements: int):
    """Row ranges of at most ``elements`` logits each (at least one row; one range under ``torch.compile``:
    inductor fuses the passes itself, and a Python loop would be unrolled into the graph)."""
    step = rows if torch.compiler.is_compiling() else max(1, elements // max(part, 1))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward fills one fp32 buffer with ``exp(logit - max)`` a cache-sized chunk of tokens at a time (shift, target
    logit, exponent and sums while the chunk is in cache; padded entries hold 0) and keeps it with the per-token sum
    of exponentials; backward turns the buffer into the gradient in place: ``exp * (grad / sum_exp)``, minus the
    target (and smoothing) terms. Nothing vocabulary-sized is allocated besides that one buffer."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, group, logits_owned):
        world, part, start, total_vocab = vocab_partition(logits, vocab_size, group)
        if label_smoothing > 0 and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in (0, 1), got {label_smoothing}")
        flat = logits.reshape(-1, part)
        rows = flat.size(0)
        # the entries of this slice below the true vocabulary are a prefix of it: padding is a column slice
        n_valid = max(0, min(part, total_vocab - start))
        tgt = target.reshape(-1)
        outside = (tgt < start) | (tgt >= start + n_valid)
        local_target = (tgt - start).masked_fill(outside, 0)

        if logits_owned and logits.dtype == torch.float32 and logits.is_contiguous():
            exp = flat  # Megatron's in-place softmax: the caller's logits become the buffer (no new allocation)
        else:
            exp = torch.empty(rows, part, dtype=torch.float32, device=logits.device)
        if n_valid < part:
            exp[:, n_valid:] = 0.0  # exp(-inf): padded entries are never predicted
        logits_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
        if world > 1 and n_valid > 0:  # the max is global: one pass before the chunks
            logits_max.copy_(flat[:, :n_valid].amax(dim=-1))
        if world > 1:
            comm.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        predicted = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        sum_exp = torch.zeros_like(predicted)
        sum_logits = torch.zeros_like(predicted) if label_smoothing > 0 else None
        if n_valid > 0:
            for lo, hi in _row_chunks(rows, part, _CACHE_BYTES // 4):
                x, buf, m = flat[lo:hi, :n_valid], exp[lo:hi, :n_valid], logits_max[lo:hi]
                if world == 1:
                    m.copy_(x.amax(dim=-1))
                torch.sub(x, m.unsqueeze(-1), out=buf)
                predicted[lo:hi] = buf.gather(-1, local_target[lo:hi, None]).squeeze(-1)
                if sum_logits is not None:
                    torch.sum(buf, dim=-1, out=sum_logits[lo:hi])
                torch.sum(buf.exp_(), dim=-1, out=sum_exp[lo:hi])
            predicted.masked_fill_(outside, 0.0)
        stats = [predicted, sum_exp] + ([sum_logits] if sum_logits is not None else [])
        loss, sum_exp, smoothing = loss_from_local_stats(stats, group, world, label_smoothing, total_vocab)
        # the owned logits are saved as themselves (a view of them made here cannot be saved after the writes)
        ctx.save_for_backward(logits if exp is flat else exp, sum_exp, local_target, outside)
        ctx.smoothing, ctx.total_vocab, ctx.n_valid = smoothing, total_vocab, n_valid
        ctx.in_dtype, ctx.shape = logits.dtype, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_target, outside = ctx.saved_tensors
        exp = exp.view(-1, exp.size(-1))
        g = grad_loss.reshape(-1, 1).float()
        grad = exp.mul_(g / sum_exp.unsqueeze(-1))  # softmax * grad, over the saved buffer (backward runs once)
        hit = (~outside).unsqueeze(-1).float() * ((1.0 - ctx.smoothing) * g)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        if ctx.smoothing > 0:
            grad[:, :ctx.n_valid] -= (ctx.smoothing / ctx.total_vocab) * g
        return grad.view(ctx.shape).to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 group=None, *, logits_owned: bool = False) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (fp32) from logits ``[s, b, V/t]`` and targets ``[s, b]``.

    ``vocab_size`` is the true (unpadded) vocabulary; entries past it are never predicted. The gradient
    w.r.t. the logits is returned in their dtype. ``group``: the tensor-parallel group the vocabulary is split
    over (None: not split). ``logits_owned``: the caller never reads the logits again, so fp32 logits are
    overwritten with the exponentials (as Megatron's loss does) instead of filling a new vocabulary-sized buffer.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size, group,
                                            logits_owned)


# ---------------------------------------------------------------------------------------------------------------
# --cross-entropy-loss-fusion --cross-entropy-fusion-impl native: the same loss, fused in PyTorch (any device)
# ---------------------------------------------------------------------------------------------------------------
_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries per step: at most this many logits (16 MiB)


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
        for lo, hi in _row_chunks(rows, part, _CHUNK_ELEMENTS):
            x = flat[lo:hi].to(torch.float32, copy=True)
            if valid is not None:
                x = x.masked_fill_(~valid, float("-inf"))
            logits_max[lo:hi] = x.max(dim=-1).values
        if world > 1:
            comm.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        predicted = torch.empty(rows, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(predicted)
        sum_logits = torch.empty_like(predicted) if label_smoothing > 0 else None
        for lo, hi in _row_chunks(rows, part, _CHUNK_ELEMENTS):
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
        for lo, hi in _row_chunks(grad.size(0), part, _CHUNK_ELEMENTS):
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
