"""Process groups built from :class:`ParallelDims`, on every rank, in one fixed order.

``torch.distributed.new_group`` is collective over the whole world: every rank must create every group
(even those it is not in) in the same order. We do that once in :func:`initialize_model_parallel` and keep
this rank's group of each kind, with its rank list, for the accessors below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from .dims import ParallelDims

# Creation order (fixed; every rank walks it identically). dp-cp first as Megatron does.
_GROUP_KINDS = ("dp_cp", "dp", "cp", "mp", "tp", "pp", "embedding", "position_embedding", "tp_dp_cp",
                "tp_dp", "tp_cp", "ep")


@dataclass
class _State:
    dims: ParallelDims
    rank: int
    groups: dict = field(default_factory=dict)  # kind -> ProcessGroup (or None when world size is 1)
    ranks: dict = field(default_factory=dict)  # kind -> list of global ranks of this rank's group


_STATE: _State | None = None


def _group_lists(dims: ParallelDims, kind: str) -> list[list[int]]:
    return getattr(dims, f"{kind}_groups")()


def initialize_model_parallel(dims: ParallelDims, timeout_minutes: float = 10.0, backend: str | None = None) -> None:
    """Create every group of every kind (collective); ``torch.distributed`` must be initialized."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(f"ParallelDims.world_size={dims.world_size} but the process group has "
                           f"{dist.get_world_size()} ranks")
    rank = dist.get_rank()
    state = _State(dims=dims, rank=rank)
    timeout = timedelta(minutes=timeout_minutes)
    for kind in _GROUP_KINDS:
        for ranks in _group_lists(dims, kind):
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                state.groups[kind] = group
                state.ranks[kind] = list(ranks)
        # The embedding groups only cover pipeline ends; other ranks keep no group of that kind.
    _STATE = state


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


def is_initialized() -> bool:
    return _STATE is not None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("model-parallel groups are not initialized; call initialize_model_parallel()")
    return _STATE


def get_dims() -> ParallelDims:
    return _state().dims


def get_group(kind: str):
    """This rank's process group of ``kind`` (one of the creation-order kinds), or None if not a member."""
    return _state().groups.get(kind)


def get_group_ranks(kind: str) -> list[int]:
    return _state().ranks.get(kind, [])


def _rank_in(kind: str) -> int:
    s = _state()
    return s.ranks[kind].index(s.rank)


# ---- accessors with Megatron's names -----------------------------------------------------------
def get_tensor_model_parallel_group():
    return get_group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _state().dims.tp if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _rank_in("tp") if _STATE is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    return get_group_ranks("tp")[0]


def get_pipeline_model_parallel_group():
    return get_group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _state().dims.pp if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in("pp") if _STATE is not None else 0


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = get_group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = get_group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_data_parallel_group(with_context_parallel: bool = False):
    return get_group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if _STATE is None:
        return 1
    return len(get_group_ranks("dp_cp" if with_context_parallel else "dp"))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank_in("dp_cp" if with_context_parallel else "dp") if _STATE is not None else 0


def get_context_parallel_group():
    return get_group("cp")


def get_context_parallel_world_size() -> int:
    return _state().dims.cp if _STATE is not None else 1


def get_model_parallel_group():
    return get_group("mp")


def get_embedding_group():
    return get_group("embedding")


def is_rank_in_embedding_group() -> bool:
    return _state().rank in get_group_ranks("embedding")


def get_position_embedding_group():
    return get_group("position_embedding")


def get_amax_reduction_group(with_context_parallel: bool = False):
    """Tensor+data group over which FP8 amax histories are reduced."""
    return get_group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_expert_model_parallel_group():
    return get_group("ep")
