"""Autograd communication primitives of Megatron's tensor and sequence parallelism.

Each is a tiny ``autograd.Function`` whose docstring says what it does forward and backward. All take the
``group`` to communicate over (the tensor-parallel group, from the run's
:class:`~megatronish.parallel.context.ParallelContext`); ``None`` or a one-rank group makes them the identity.
Shapes: activations are ``[s, b, h]``, so "first dim" is the sequence and "last dim" the hidden/vocab.
"""
from __future__ import annotations

import torch

from . import comm_log as comm
from .context import group_rank as _rank
from .context import group_size as _world


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a fresh tensor (the input, autograd's, is left alone); identity for one rank."""
    if _world(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, group=group)
    return x


def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by the group size {world}")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


def _gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    comm.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.size(0) % world:
        raise ValueError(f"sequence dimension {x.size(0)} is not divisible by the tensor-parallel size {world}")
    out = torch.empty((x.size(0) // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce of the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, -1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: keep this rank's chunk of the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the first (sequence) dim. Backward: all-gather along the first dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, 0, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the first dim. Backward: reduce-scatter along the first dim when the
    consumer is tensor-parallel (each rank holds a partial gradient), else keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_along(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along the first dim. Backward: all-gather along the first dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, 0, ctx.group), None


def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group=None):
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group=None):
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group=None):
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=None):
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


# ---------------------------------------------------------------------------------------------------------------
# Token exchange of the mixture-of-experts dispatchers: rows of ``[tokens, h]`` with per-rank counts.
# ---------------------------------------------------------------------------------------------------------------
def _all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(output_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_to_all_single(out, x.contiguous(), output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all of rows (``input_splits[r]`` rows to rank ``r``, ``output_splits[r]`` from it).
    Backward: the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather of rows with a different count per rank (``counts``, in group order) — one
    all-to-all, as gloo has no uneven all-gather. Backward: reduce-scatter of the rows (each rank gets the sum of
    every rank's gradient of its own rows)."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        world = len(counts)
        return _all_to_all_rows(x.repeat(world, *([1] * (x.dim() - 1))), counts, [x.size(0)] * world, group)

    @staticmethod
    def backward(ctx, grad):
        counts, me = ctx.counts, _rank(ctx.group)
        parts = _all_to_all_rows(grad, [counts[me]] * len(counts), counts, ctx.group)
        return parts.view(len(counts), counts[me], *grad.shape[1:]).sum(0), None, None


def all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Rows of ``x`` exchanged over ``group``: ``input_splits[r]`` consecutive rows go to rank ``r``; the result
    holds ``output_splits[r]`` rows from each rank ``r``, in rank order."""
    if _world(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def gather_rows(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Every rank's rows of ``x`` concatenated in rank order; ``counts[r]`` is rank ``r``'s row count."""
    if _world(group) == 1:
        return x
    return _GatherRows.apply(x, group, list(counts))


def all_gather_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (same shape everywhere; no autograd)."""
    if _world(group) == 1:
        return x.unsqueeze(0)
    out = torch.empty((_world(group) * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(_world(group), *x.shape)


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: reduce-scatter of rows with a different count per rank (``counts``, in group order): rank
    ``r`` gets the sum over ranks of rows ``counts[:r].sum() ...``. Backward: the uneven all-gather."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        me = _rank(group)
        parts = _all_to_all_rows(x, [counts[me]] * len(counts), counts, group)
        return parts.view(len(counts), counts[me], *x.shape[1:]).sum(0)

    @staticmethod
    def backward(ctx, grad):
        counts = ctx.counts
        world = len(counts)
        out = _all_to_all_rows(grad.repeat(world, *([1] * (grad.dim() - 1))), counts, [grad.size(0)] * world,
                               ctx.group)
        return out, None, None


def reduce_scatter_rows(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """Inverse of :func:`gather_rows`: the sum over ranks of ``x``, this rank keeping its ``counts[rank]`` rows."""
    if _world(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, group, list(counts))
