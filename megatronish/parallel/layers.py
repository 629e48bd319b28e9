"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each parameter is allocated at its local shape and carries its global :class:`TensorDesc`; values are filled
later by :func:`megatronish.parallel.init.initialize_slice` from ``(seed, global name)``.
Activations are ``[s, b, h]``; under sequence parallelism the ``s`` of inputs/outputs outside the TP region
is this rank's ``s/t`` chunk. Each layer takes ``tp_group``, the tensor-parallel group it is split over (from
the run's :class:`~megatronish.parallel.context.ParallelContext`; ``None``: not split) and ``sequence_parallel``,
already resolved (the run's ``RunConfig.sequence_parallel``: off at TP 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm_log as comm
from .context import Shared, group_rank, group_size
from .init import TensorDesc, local_shape, set_desc
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .weight_grad import linear


class _TensorParallel(nn.Module):
    """A layer split over ``tp_group`` (kept shared by copies of the layer)."""

    # the split backward's store while a zero-bubble schedule runs (weight_grad.attached): the weight GEMM waits
    weight_grad_store = None

    @property
    def tp_group(self):
        return self._tp_group.value


def _new_param(desc: TensorDesc, tp: int, dtype, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(local_shape(desc, tp), dtype=dtype, device=device))
    return set_desc(p, desc)


class ColumnParallelLinear(_TensorParallel):
    """``Y = X A^T + b`` with ``A`` split along its output dim: weight ``[out/t, in]``, bias ``[out/t]``.

    Input is replicated over TP (or, with ``sequence_parallel``, sequence-sharded and all-gathered here);
    output is this rank's ``out/t`` columns unless ``gather_output``. ``stride > 1`` splits each of ``stride``
    equal output blocks separately (e.g. SwiGLU's ``[gate; up]``), so every rank holds a slice of each block.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 stride: int = 1, skip_weight_param_allocation: bool = False, params_dtype=torch.float32,
                 device=None, tp_group=None):
        super().__init__()
        self._tp_group = Shared(tp_group)
        tp = group_size(tp_group)
        if output_size % (tp * stride):
            raise ValueError(f"output size {output_size} is not divisible by stride {stride} x TP {tp}")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence parallelism")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = None if skip_weight_param_allocation else _new_param(
            TensorDesc((output_size, input_size), 0, stride, "normal", init_std), tp, params_dtype, device)
        self.bias = _new_param(TensorDesc((output_size,), 0, stride, "zeros"), tp, params_dtype, device) \
            if bias else None
        self.fp8 = None  # set by enable_fp8 / enable_te: callable (x, weight, bias, weight_grad_store) -> x W^T + b

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """``weight`` overrides the layer's own (a tied output layer passes the embedding's)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, True, self.tp_group)  # [s/t,b,h] -> [s,b,h]
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = linear(x, weight, bias, self.weight_grad_store) if self.fp8 is None \
            else self.fp8(x, weight, bias, self.weight_grad_store)  # [s, b, out/t]
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)  # [s, b, out]
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_TensorParallel):
    """``Y = X A^T + b`` with ``A`` split along its input dim: weight ``[out, in/t]``, bias ``[out]`` replicated.

    Partial products are all-reduced over TP (or reduce-scattered along ``s`` under sequence parallelism);
    the bias is added after the reduction. Under sequence parallelism the bias sees sequence-sharded outputs,
    so its gradient is all-reduced over TP by the caller (it is marked ``sequence_parallel``).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 params_dtype=torch.float32, device=None, tp_group=None):
        super().__init__()
        self._tp_group = Shared(tp_group)
        tp = group_size(tp_group)
        if input_size % tp:
            raise ValueError(f"input size {input_size} is not divisible by TP {tp}")
        self.sequence_parallel = sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.weight = _new_param(TensorDesc((output_size, input_size), 1, 1, "normal", init_std), tp,
                                 params_dtype, device)
        self.bias = _new_param(TensorDesc((output_size,), None, 1, "zeros",
                                          sequence_parallel=self.sequence_parallel), tp, params_dtype, device) \
            if bias else None
        self.fp8 = None  # set by enable_fp8 / enable_te: callable (x, weight, bias, weight_grad_store) -> x W^T + b

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        out = linear(x, self.weight, None, self.weight_grad_store) if self.fp8 is None \
            else self.fp8(x, self.weight, None, self.weight_grad_store)  # partial [s,b,out]
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/t, b, out]
        else:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class VocabParallelEmbedding(_TensorParallel):
    """Embedding with the (padded) vocabulary split over TP: this rank holds rows ``[r*V/t, (r+1)*V/t)``.

    Takes ids ``[b, s]`` and returns ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism: the partial
    lookups are reduce-scattered along ``s`` instead of all-reduced). Rows ``>= vocab_size`` are padding:
    zero at init and never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, vocab_size: int | None = None,
                 sequence_parallel: bool = False, init_std: float = 0.02, params_dtype=torch.float32, device=None,
                 tp_group=None):
        super().__init__()
        self._tp_group = Shared(tp_group)
        tp = group_size(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"padded vocabulary {num_embeddings} is not divisible by TP {tp}")
        self.num_embeddings, self.per_rank = num_embeddings, num_embeddings // tp
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(TensorDesc((num_embeddings, embedding_dim), 0, 1, "normal", init_std,
                                            valid_rows=vocab_size), tp, params_dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()  # [b, s] -> [s, b]
        if group_size(self.tp_group) > 1:
            start = group_rank(self.tp_group) * self.per_rank
            outside = (ids < start) | (ids >= start + self.per_rank)
            local = (ids - start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [s, b, h] partial
        else:
            return F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/t, b, h]
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group, grad_attr: str = "grad") -> None:
    """Sum over TP the gradients of parameters that are replicated across TP but see only this rank's
    sequence chunk under sequence parallelism (norm weights and biases, row-parallel biases): one
    all-reduce of a flat buffer. ``grad_attr="main_grad"`` reduces the DDP buffers instead of ``.grad``."""
    if group_size(tp_group) == 1:
        return
    grads = [getattr(p, grad_attr, None) for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
