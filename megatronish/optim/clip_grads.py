"""Global gradient norm across TP, PP and DP, counting every parameter of the global model once."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel import comm_log as comm
from ..parallel.context import ParallelContext


def grad_of(p):
    """The gradient a step reads for ``p``: its DDP buffer (``main_grad``), else ``p.grad``."""
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def is_expert(p) -> bool:
    """An expert weight (its replicas are the expert-DP group, not DP; its pieces are unique over expert-TP x EP
    x PP)."""
    desc = getattr(p, "desc", None)
    return bool(desc is not None and desc.expert)


def counts_once(p, parallel: ParallelContext) -> bool:
    """False for copies: a TP-replicated parameter off TP rank 0, and the tied word embedding's copy in the
    output layer of a later stage (``embedding_copy``; the embedding itself is counted). Expert weights always
    count: no two ranks of an expert model-parallel group hold the same piece."""
    if is_expert(p):
        return True
    if getattr(p, "shared_embedding", False) and (getattr(p, "embedding_copy", False)
                                                  or not parallel.is_first_stage):
        return False
    tp_rank = parallel.tp_rank
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


def local_sum_of_squares(tensors) -> torch.Tensor:
    """``sum(t**2)`` over this rank's ``tensors`` (one fused pass, no temporaries of the tensors' size); an fp32
    scalar."""
    tensors = [t for t in tensors if t is not None]
    device = tensors[0].device if tensors else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        norms = torch._foreach_norm([t.detach() for t in tensors])
        sq += torch.stack([n.float() for n in norms]).pow(2).sum()
    return sq


def reduce_sums(terms, async_op: bool = False):
    """Sum each ``(local sum, group)`` of ``terms`` over its group, in place (``async_op``: started, not waited
    for); returns the collectives' handles (none without ``async_op`` or where a group has one rank)."""
    works = []
    for sq, group in terms:
        if group is not None and dist.get_world_size(group) > 1:
            work = comm.all_reduce(sq, group=group, async_op=async_op)
            if async_op:
                works.append(work)
    return works


def total_of(terms) -> torch.Tensor:
    """The sum of the (reduced) terms' tensors, in their order, as one fp32 scalar."""
    total = terms[0][0]
    for sq, _ in terms[1:]:
        total = total + sq
    return total


def sum_of_squares(tensors, group=None) -> torch.Tensor:
    """``sum(t**2)`` over ``tensors`` (:func:`local_sum_of_squares`), summed over ``group``; an fp32 scalar."""
    sq = local_sum_of_squares(tensors)
    reduce_sums([(sq, group)])
    return sq


def model_sum_of_squares_terms(tensors_of, params, parallel: ParallelContext,
                               experts: bool) -> list[tuple[torch.Tensor, object]]:
    """The terms of :func:`model_sum_of_squares` before their collectives: ``[(this rank's sum, the group it is
    summed over)]``."""
    from ..parallel.fsdp import is_sharded

    params = list(params)
    counted = [p for p in params if counts_once(p, parallel)]
    if any(is_sharded(p) for p in params):  # FSDP2: the DP ranks hold disjoint shards, summed over the world
        shards = [tensors_of(p) for p in counted]
        world = dist.group.WORLD if parallel.world_size > 1 else None
        return [(local_sum_of_squares([t.to_local() if is_sharded(t) else t for t in shards if t is not None]),
                 world)]
    terms = [(local_sum_of_squares([tensors_of(p) for p in counted if not is_expert(p)]), parallel.mp_group)]
    if experts:
        terms.append((local_sum_of_squares([tensors_of(p) for p in counted if is_expert(p)]),
                      parallel.expert_mp_group))
    return terms


def model_sum_of_squares(tensors_of, params, parallel: ParallelContext, experts: bool) -> torch.Tensor:
    """``sum(t**2)`` of ``tensors_of(p)`` over the whole model, each piece counted once: the dense parameters' sum
    runs over the model-parallel group (TP x PP), and with ``experts`` (every rank of a mixture-of-experts model
    passes True) the expert weights' over the expert model-parallel group (expert-TP x EP x PP)."""
    terms = model_sum_of_squares_terms(tensors_of, params, parallel, experts)
    reduce_sums(terms)
    return total_of(terms)


def global_norm(params, use_grad: bool = True, parallel: ParallelContext | None = None,
                experts: bool = False) -> float:
    """L2 norm over the whole model of the grads (or the values) of ``params`` (this rank's share under
    ``parallel``; default one process). Grads are DP-identical after the reduction, so the sum runs over the
    model-parallel groups only (``experts``: see :func:`model_sum_of_squares`)."""
    parallel = parallel or ParallelContext.single()
    return math.sqrt(model_sum_of_squares(grad_of if use_grad else (lambda p: p), params, parallel, experts).item())


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """Megatron's ``max_norm / (norm + 1e-6)`` when it is < 1 (else None: no clipping)."""
    if max_norm > 0 and math.isfinite(norm):
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            return coeff
    return None


def clip_grad_norm(params, max_norm: float, parallel: ParallelContext | None = None, experts: bool = False) -> float:
    """Scale every grad by ``max_norm / (norm + 1e-6)`` when the global norm exceeds ``max_norm``; returns
    the norm before clipping."""
    params = list(params)
    norm = global_norm(params, parallel=parallel, experts=experts)
    coeff = clip_coefficient(norm, max_norm)
    if coeff is not None:
        grads = [g for g in map(grad_of, params) if g is not None]
        if grads:
            torch._foreach_mul_(grads, coeff)
    return norm
