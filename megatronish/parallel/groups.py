"""Building the process groups, and Megatron-named accessors for users' code.

:func:`initialize_model_parallel` builds every group on every rank in one fixed order and returns the run's
:class:`~megatronish.parallel.context.ParallelContext`; that object is what the package passes around.

The accessors below (``get_tensor_model_parallel_rank()`` and the rest, with Megatron-LM's names) exist for
code written against Megatron's ``parallel_state``: they read the context that the last
:func:`initialize_model_parallel` returned. The package itself never calls them (a test checks that), and
:func:`is_initialized` guards appear here only.
"""
from __future__ import annotations

from . import comm_log
from .context import ParallelContext
from .dims import ParallelDims

__all__ = ["initialize_model_parallel", "destroy_model_parallel", "is_initialized", "get_context"]

# The one reference the accessor layer keeps: the context most recently built on this process.
_current: list[ParallelContext] = []
# The process groups this process has made, by (kind, ranks, timeout, backend), with the world they were made in
# under "world": torch.distributed keeps every group (its connections and threads) until destroyed, so a context
# built again with the same ranks takes the same groups instead of making more.
_made: dict = {}


def initialize_model_parallel(dims: ParallelDims, timeout_minutes: float = 10.0, backend: str | None = None,
                              ) -> ParallelContext:
    """Create every group of every kind (collective; ``torch.distributed`` must be initialized) and return the
    context holding them. Each group is registered under its kind with :mod:`~megatronish.parallel.comm_log`. A
    group of the same kind, ranks, timeout and backend that an earlier call on this process made is taken again
    (every rank makes the same calls, so every rank takes the same groups)."""
    ctx = ParallelContext.build(dims, timeout_minutes=timeout_minutes, backend=backend, made=_made)
    for kind, group in ctx.group_map.items():  # the records of collectives name each group by its kind
        comm_log.register_group(group, kind, ctx.ranks(kind))
    _current[:] = [ctx]
    return ctx


def destroy_model_parallel() -> None:
    """Forget the accessors' context (the groups live as long as the context object that holds them)."""
    _current.clear()


def is_initialized() -> bool:
    return bool(_current)


def get_context() -> ParallelContext:
    if not _current:
        raise RuntimeError("model-parallel groups are not initialized; call initialize_model_parallel()")
    return _current[0]


def _ctx() -> ParallelContext:
    """The current context, or the one-process context before initialization (Megatron answers 1 / 0 there)."""
    return _current[0] if _current else ParallelContext.single()


# ---- accessors with Megatron's names -----------------------------------------------------------
def get_dims() -> ParallelDims:
    return get_context().dims


def get_group(kind: str):
    """This rank's process group of ``kind``, or None if not a member."""
    return get_context().group(kind)


def get_group_ranks(kind: str) -> list[int]:
    return list(get_context().ranks(kind))


def get_tensor_model_parallel_group():
    return get_context().tp_group


def get_tensor_model_parallel_world_size() -> int:
    return _ctx().tp_size


def get_tensor_model_parallel_rank() -> int:
    return _ctx().tp_rank


def get_pipeline_model_parallel_group():
    return get_context().pp_group


def get_pipeline_model_parallel_world_size() -> int:
    return _ctx().pp_size


def get_pipeline_model_parallel_rank() -> int:
    return _ctx().pp_rank


def is_pipeline_first_stage() -> bool:
    return _ctx().is_first_stage


def is_pipeline_last_stage() -> bool:
    return _ctx().is_last_stage


def get_pipeline_model_parallel_next_rank() -> int:
    return get_context().next_pp_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_context().prev_pp_rank


def get_data_parallel_group(with_context_parallel: bool = False):
    c = get_context()
    return c.dp_cp_group if with_context_parallel else c.dp_group


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    c = _ctx()
    return c.dp_cp_size if with_context_parallel else c.dp_size


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    c = _ctx()
    return c.dp_cp_rank if with_context_parallel else c.dp_rank


def get_context_parallel_group():
    return get_context().cp_group


def get_context_parallel_world_size() -> int:
    return _ctx().cp_size


def get_model_parallel_group():
    return get_context().mp_group


def get_embedding_group():
    return get_context().embedding_group


def is_rank_in_embedding_group() -> bool:
    c = get_context()
    return c.rank in c.embedding_ranks


def get_amax_reduction_group(with_context_parallel: bool = False):
    """Tensor+data group over which FP8 amax histories are reduced."""
    return get_context().amax_reduction_group(with_context_parallel)
