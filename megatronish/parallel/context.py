"""The explicit parallel context: the degrees of a run and this rank's process group of every kind.

A :class:`ParallelContext` is built once per run (:func:`megatronish.parallel.groups.initialize_model_parallel`
builds every group collectively, in one fixed order) and handed to whatever communicates: the model and its
layers, DDP, the optimizer, the schedules' point-to-point communicator, the checkpointer. Nothing in the package
reads process groups from a module global.

The same object can be made without ``torch.distributed`` (:meth:`ParallelContext.fake`): every degree, rank
and rank list comes from :class:`~megatronish.parallel.dims.ParallelDims` arithmetic and each group is a
:class:`FakeGroup` that knows its size and this rank's index but cannot communicate. Shapes, plans and layer
splits of any layout can then be built and checked in one process. :meth:`ParallelContext.single` is the
one-process context (every degree 1, no groups): what a model built without a context uses.

Adding a parallel dimension: give :class:`ParallelDims` its degree and axis, add its group kinds to
:data:`GROUP_KINDS` (creation order is part of the contract: every rank creates every group in this order), and
add the properties the new code needs here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from .dims import ParallelDims

__all__ = ["GROUP_KINDS", "FakeGroup", "ParallelContext", "Shared", "group_size", "group_rank"]

# The group kinds, in creation order (fixed; every rank walks it identically): ParallelDims' one list. "io" is
# a gloo group over the whole world, created last, that checkpoint I/O uses (its collectives may run from a
# background thread).
GROUP_KINDS = ParallelDims.GROUP_KINDS
_IO = "io"


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for a process group where none exists: ``size()`` and ``rank()`` as a ProcessGroup has them."""

    ranks: tuple[int, ...]
    member: int  # this rank's global rank

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(self.member)

    def __getattr__(self, name):  # what torch.distributed would call to communicate
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"a fake process group (ranks {list(self.ranks)}) cannot communicate ({name}); "
                           "ParallelContext.fake is for shapes and plans: build the real context with "
                           "groups.initialize_model_parallel to run collectives")


class Shared:
    """Holds an object that copies of a module share: ``copy.deepcopy`` of a model keeps its process groups
    (which cannot be copied) instead of failing."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


def group_size(group) -> int:
    """Members of ``group`` (a ProcessGroup or :class:`FakeGroup`); 1 for ``None`` (no peers)."""
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for ``None``."""
    return 0 if group is None else group.rank()


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """Degrees (``dims``), this rank's global rank, and its group of each kind with that group's global ranks.

    Groups of size one are kept as real groups in a real context (they communicate trivially); the
    one-process context has ``None`` for every group, which every communication helper treats as "no peers".
    """

    dims: ParallelDims
    rank: int
    group_map: dict = field(repr=False)  # kind -> ProcessGroup | FakeGroup | None
    rank_map: dict = field(repr=False)  # kind -> tuple of global ranks of this rank's group of that kind
    is_fake: bool = False  # made by ParallelContext.fake: no torch.distributed behind the groups
    # Point-to-point groups that have run their first collective (NCCL wants one before batched p2p).
    p2p_ready: set = field(default_factory=set, repr=False, compare=False)

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def build(cls, dims: ParallelDims, *, timeout_minutes: float = 10.0, backend: str | None = None,
              made: dict | None = None) -> "ParallelContext":
        """Create every group of every kind (collective over the world; ``torch.distributed`` initialized). The
        ``cp_inner``/``cp_outer`` kinds have groups only when ``dims.cp_inner`` is set. ``made``: the groups made
        before, by (kind, ranks, timeout, backend), with ``made["world"]`` the default group they were made under;
        a group found there is taken again, one not found is made and kept there (a new world empties it)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        if dist.get_world_size() != dims.world_size:
            raise RuntimeError(f"ParallelDims.world_size={dims.world_size} but the process group has "
                               f"{dist.get_world_size()} ranks")
        rank = dist.get_rank()
        timeout = timedelta(minutes=timeout_minutes)
        made = {} if made is None else made
        if made.get("world") is not dist.group.WORLD:
            made.clear()
            made["world"] = dist.group.WORLD

        def new_group(kind, ranks, backend):
            key = (kind, None if ranks is None else tuple(ranks), timeout, backend)
            if key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout, backend=backend)
            return made[key]

        group_map, rank_map = {}, {}
        for kind in GROUP_KINDS:
            for ranks in dims.groups(kind):
                group = new_group(kind, ranks, backend)
                if rank in ranks:  # the embedding kinds cover pipeline ends only: other ranks keep none
                    group_map[kind], rank_map[kind] = group, tuple(ranks)
        group_map[_IO] = new_group(_IO, None, "gloo")
        rank_map[_IO] = tuple(range(dims.world_size))
        return cls(dims, rank, group_map, rank_map)

    @classmethod
    def fake(cls, dims: ParallelDims | None = None, rank: int = 0) -> "ParallelContext":
        """The context ``rank`` would have under ``dims``, without ``torch.distributed``: sizes, ranks and rank
        lists are exact; groups are :class:`FakeGroup` (``None`` where a group has one member)."""
        dims = dims or ParallelDims(world_size=1)
        group_map, rank_map = {}, {}
        for kind in GROUP_KINDS + (_IO,):
            ranks = tuple(range(dims.world_size)) if kind == _IO else tuple(dims.group_of(kind, rank))
            if ranks:
                rank_map[kind] = ranks
                group_map[kind] = FakeGroup(ranks, rank) if len(ranks) > 1 else None
        return cls(dims, rank, group_map, rank_map, is_fake=True)

    @classmethod
    def single(cls) -> "ParallelContext":
        """One process: every degree 1, no groups."""
        return cls.fake(ParallelDims(world_size=1), 0)

    def __deepcopy__(self, memo):  # modules hold the context; a copied model shares its groups
        return self

    # ------------------------------------------------------------------------------------------ by kind
    def group(self, kind: str):
        """This rank's group of ``kind`` (a creation-order kind, or ``"io"``); None if not a member or alone."""
        return self.group_map.get(kind)

    def ranks(self, kind: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of ``kind`` (``()`` if not a member)."""
        return self.rank_map.get(kind, ())

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its group of ``kind``."""
        return self.rank_map[kind].index(self.rank)

    # ------------------------------------------------------------------------------------------ degrees
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def vp_size(self) -> int:
        return self.dims.vp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def holds_loss(self) -> bool:
        """This rank holds the last pipeline stage (output layer and loss): the last rank, or in a V (``zbv``)
        the first."""
        return self.pp_rank == self.dims.loss_pp_rank

    @property
    def loss_rank(self) -> int:
        """Global rank of this pipeline group's loss stage (see :attr:`holds_loss`)."""
        return self.ranks("pp")[self.dims.loss_pp_rank]

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (ring: the last stage's next is the first)."""
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the previous pipeline stage (ring: the first stage's previous is the last)."""
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank - 1) % len(ranks)]

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.rank_in("cp")

    @property
    def cp_group(self):
        return self.group("cp")

    @property
    def dp_size(self) -> int:
        """Data-parallel size without CP."""
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def dp_cp_size(self) -> int:
        """Data x context parallel size: the group gradients are reduced over."""
        return self.dims.dp * self.dims.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.rank_in("dp_cp")

    @property
    def dp_cp_group(self):
        return self.group("dp_cp")

    @property
    def mp_group(self):
        """Model-parallel group (TP x PP): where per-replica statistics such as the grad norm are summed."""
        return self.group("mp")

    @property
    def embedding_group(self):
        """First and last pipeline stage when embeddings are tied and PP > 1; None where this rank has none."""
        return self.group("embedding")

    @property
    def embedding_ranks(self) -> tuple[int, ...]:
        return self.ranks("embedding")

    # ---- the expert grid (mixture-of-experts layers; ParallelDims' etp-ep-edp layout)
    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def ep_rank(self) -> int:
        return self.rank_in("ep")

    @property
    def ep_group(self):
        return self.group("ep")

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size (``--expert-tensor-parallel-size``, default TP)."""
        return self.dims.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.rank_in("etp")

    @property
    def etp_group(self):
        return self.group("etp")

    @property
    def tp_ep_group(self):
        """Expert-TP x EP: the all-gather dispatcher's group; its rank is ``ep_rank * etp_size + etp_rank``."""
        return self.group("tp_ep")

    @property
    def expert_dp_group(self):
        """The replicas of this rank's expert shards: expert gradients are reduced over it."""
        return self.group("expert_dp")

    @property
    def expert_mp_group(self):
        """Expert-TP x EP x PP: where the expert weights' gradient norm is summed."""
        return self.group("expert_mp")

    def amax_reduction_group(self, with_context_parallel: bool = False):
        """Tensor x data (x context) group over which FP8 amax histories are reduced."""
        return self.group("tp_dp_cp" if with_context_parallel else "tp_dp")

    @property
    def io_group(self):
        """A gloo group over the whole world for checkpoint I/O (safe to use from a background thread)."""
        return self.group(_IO)

    def describe(self) -> str:
        return self.dims.describe()
