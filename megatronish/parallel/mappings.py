"""Autograd communication primitives of Megatron's tensor and sequence parallelism.

Each is a tiny ``autograd.Function`` whose docstring says what it does forward and backward. All take the
``group`` to communicate over (the tensor-parallel group, from the run's
:class:`~megatronish.parallel.context.ParallelContext`); ``None`` or a one-rank group makes them the identity.
Shapes: activations are ``[s, b, h]``, so "first dim" is the sequence and "last dim" the hidden/vocab.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .context import group_rank as _rank
from .context import group_size as _world


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a fresh tensor (the input, autograd's, is left alone); identity for one rank."""
    if _world(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
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
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.size(0) % world:
        raise ValueError(f"sequence dimension {x.size(0)} is not divisible by the tensor-parallel size {world}")
    out = torch.empty((x.size(0) // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
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
