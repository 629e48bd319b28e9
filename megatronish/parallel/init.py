"""Layout-invariant initialization: a parameter's global value is a function of ``(seed, global name)`` only.

Every parameter carries a :class:`TensorDesc` — its global shape, the dimension tensor parallelism splits
(``partition_dim``; ``None`` when replicated), the split's stride, and how it is initialized. The global
tensor is defined as a sequence of row chunks (rows along dim 0; a chunk has a fixed number of rows that
depends only on the row length), chunk ``k`` drawn from a CPU generator seeded by ``hash(seed, name, k)``.
Each rank generates only the chunks it needs and keeps its slice, so memory stays O(local + one chunk),
and TP=1, TP=2, any PP split and any device start from the same numbers.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 22  # elements per generated chunk (16 MiB in fp32)


@dataclass(frozen=True)
class TensorDesc:
    """One global description of a parameter."""

    global_shape: tuple[int, ...]
    partition_dim: int | None = None  # dim split over tensor-parallel ranks, None if replicated
    partition_stride: int = 1  # >1: the dim is `stride` blocks, each split over the ranks (e.g. [gate; up])
    init: str = "normal"  # "normal" | "zeros" | "ones"
    std: float = 0.02
    valid_rows: int | None = None  # rows >= this along dim 0 are padding: initialized to zero
    sequence_parallel: bool = False  # replicated over TP but fed sequence-sharded inputs: grad needs TP all-reduce
    # An expert weight: dim 0 is the (global) expert index, split into contiguous blocks over expert parallelism
    # (EP rank e holds experts e*E/EP ...); partition_dim then splits over *expert* tensor parallelism.
    expert: bool = False

    @property
    def tensor_parallel(self) -> bool:
        return self.partition_dim is not None


def local_indices(desc: TensorDesc, rank: int, world: int) -> torch.Tensor | None:
    """Global indices along ``partition_dim`` that ``rank`` holds (None if replicated)."""
    if desc.partition_dim is None or world == 1:
        return None
    size = desc.global_shape[desc.partition_dim]
    stride = desc.partition_stride
    if size % (stride * world):
        raise ValueError(f"dimension of size {size} is not divisible by stride {stride} x TP {world}")
    block = size // stride
    part = block // world
    return torch.cat([torch.arange(k * block + rank * part, k * block + (rank + 1) * part) for k in range(stride)])


def local_shape(desc: TensorDesc, world: int, ep: int = 1) -> tuple[int, ...]:
    shape = list(desc.global_shape)
    if desc.partition_dim is not None:
        shape[desc.partition_dim] //= world
    if desc.expert:
        shape[0] //= ep
    return tuple(shape)


def expert_range(desc: TensorDesc, ep_rank: int, ep: int) -> tuple[int, int]:
    """``[lo, hi)`` of the global experts (dim 0) that EP rank ``ep_rank`` holds; all rows if not an expert."""
    n = desc.global_shape[0]
    if not desc.expert or ep == 1:
        return 0, n
    if n % ep:
        raise ValueError(f"{n} experts are not divisible by expert-parallel size {ep}")
    return ep_rank * n // ep, (ep_rank + 1) * n // ep


def split_ranks(desc: TensorDesc, parallel) -> tuple[int, int, int, int]:
    """``(rank, world, ep_rank, ep)`` of the splits of ``desc`` under ``parallel`` (a ParallelContext): the
    tensor-parallel split, or for an expert weight the expert-TP split and the expert-parallel one."""
    if desc.expert:
        return parallel.etp_rank, parallel.etp_size, parallel.ep_rank, parallel.ep_size
    return parallel.tp_rank, parallel.tp_size, 0, 1


def split_global(desc: TensorDesc, full: torch.Tensor, rank: int, world: int, ep_rank: int = 0,
                 ep: int = 1) -> torch.Tensor:
    """This rank's slice of a full (global) tensor."""
    lo, hi = expert_range(desc, ep_rank, ep)
    if (lo, hi) != (0, full.shape[0]):
        full = full[lo:hi]
    idx = local_indices(desc, rank, world)
    return full if idx is None else full.index_select(desc.partition_dim, idx.to(full.device))


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}|{name}|{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _rows_per_chunk(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(row, 1))


def _generate_rows(desc: TensorDesc, seed: int, name: str, start: int, stop: int) -> torch.Tensor:
    """Global rows [start, stop) as fp32 on CPU."""
    shape = desc.global_shape
    rows = _rows_per_chunk(shape)
    pieces = []
    for k in range(start // rows, (stop - 1) // rows + 1):
        lo, hi = k * rows, min((k + 1) * rows, shape[0])
        gen = torch.Generator().manual_seed(_chunk_seed(seed, name, k))
        chunk = torch.randn((hi - lo, *shape[1:]), generator=gen) * desc.std
        pieces.append(chunk[max(start, lo) - lo: min(stop, hi) - lo])
    out = torch.cat(pieces)
    if desc.valid_rows is not None and stop > desc.valid_rows:
        out[max(desc.valid_rows - start, 0):] = 0
    return out


def initialize_slice(param: torch.Tensor, desc: TensorDesc, seed: int, name: str, rank: int, world: int,
                     ep_rank: int = 0, ep: int = 1) -> None:
    """Fill ``param`` (this rank's slice) with its part of the global value of ``name``."""
    with torch.no_grad():
        if desc.init == "zeros":
            param.zero_()
            return
        if desc.init == "ones":
            param.fill_(1.0)
            return
        if desc.init != "normal":
            raise ValueError(f"unknown init {desc.init!r} for {name}")
        idx = local_indices(desc, rank, world)
        if desc.expert:  # this EP rank's experts (rows of dim 0), then the expert-TP slice of each
            lo, hi = expert_range(desc, ep_rank, ep)
            rows = _rows_per_chunk(desc.global_shape)
            out = []
            for start in range(lo, hi, rows):
                block = _generate_rows(desc, seed, name, start, min(start + rows, hi))
                out.append(block if idx is None else block.index_select(desc.partition_dim, idx))
            param.copy_(torch.cat(out))
        elif idx is None:
            param.copy_(_generate_rows(desc, seed, name, 0, desc.global_shape[0]))
        elif desc.partition_dim == 0:
            # Runs of consecutive rows (one per stride block), each generated on its own.
            block = len(idx) // desc.partition_stride
            runs = [_generate_rows(desc, seed, name, int(idx[i]), int(idx[i]) + block)
                    for i in range(0, len(idx), block)]
            param.copy_(torch.cat(runs))
        else:
            rows = _rows_per_chunk(desc.global_shape)
            out_rows = []
            for lo in range(0, desc.global_shape[0], rows):
                hi = min(lo + rows, desc.global_shape[0])
                out_rows.append(_generate_rows(desc, seed, name, lo, hi).index_select(desc.partition_dim, idx))
            param.copy_(torch.cat(out_rows))


def set_desc(param: torch.nn.Parameter, desc: TensorDesc) -> torch.nn.Parameter:
    """Attach the description (and Megatron's attribute names) to a parameter."""
    param.desc = desc
    param.tensor_model_parallel = desc.tensor_parallel
    param.partition_dim = desc.partition_dim if desc.partition_dim is not None else -1
    param.partition_stride = desc.partition_stride
    param.sequence_parallel = desc.sequence_parallel
    param.allreduce = not desc.expert  # Megatron's mark: expert weights reduce over expert-DP, not DP
    return param


def gather_to_global(local: torch.Tensor, desc: TensorDesc, group=None) -> torch.Tensor:
    """Reassemble the global tensor from every TP rank's slice (all-gather; for tests and export)."""
    import torch.distributed as dist

    from . import comm_log as comm

    world = 1 if group is None else dist.get_world_size(group)
    if desc.partition_dim is None or world == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(world)]
    comm.all_gather(parts, local.detach().contiguous(), group=group)
    full = torch.empty(desc.global_shape, dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        full.index_copy_(desc.partition_dim, local_indices(desc, r, world).to(local.device), part)
    return full
