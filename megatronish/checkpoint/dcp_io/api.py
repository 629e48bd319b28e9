"""Save and load: one collective DCP save of a rank's entries, a per-rank DCP load with one agreement on
success, and one error line for a failure."""
from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from ...errors import CheckpointError
from ...parallel import comm_log as comm
from .buffers import BouncePool
from .entries import gc_paused
from .faults import WriteFault
from .planner import LoadPlanner, SavePlanner
from .reader import Reader
from .writer import Writer


def skip_discarded_dcp_records() -> None:
    """DCP logs a debug record at the start and end of every state-dict entry's ``state_dict()`` call (and of its
    own steps) to its logger, whose only handler by default is a ``NullHandler``: records built only to be
    discarded, two per entry. Raise that logger's level to INFO when nothing would see them (no other handler);
    a logger given a real handler is left alone."""
    try:
        from torch.distributed.checkpoint import logger as dcp_logger
    except ImportError:
        return
    lg = getattr(dcp_logger, "_dcp_logger", None)
    if isinstance(lg, logging.Logger) and lg.level <= logging.DEBUG and not lg.propagate and lg.handlers \
            and all(type(h) is logging.NullHandler for h in lg.handlers):
        lg.setLevel(logging.INFO)


def save(state: dict, iter_dir: str, process_group=None, no_dist: bool = False, *, direct_io: bool = True,
         pool: BouncePool | None = None, fault: WriteFault | None = None) -> None:
    """Write ``state`` (:class:`~.entries.Sharded` and :class:`~.entries.Obj` entries) to ``iter_dir``; collective
    over ``process_group`` unless ``no_dist``. ``direct_io``: write with ``O_DIRECT`` where the file system allows
    it; ``pool``: the aligned blocks those writes go out of (the process's own when None); ``fault``: a test's
    :class:`~.faults.WriteFault` (else the one the environment asks for, if any)."""
    skip_discarded_dcp_records()
    os.makedirs(iter_dir, exist_ok=True)
    writer = Writer(iter_dir, direct_io=direct_io, pool=pool,
                    fault=fault if fault is not None else WriteFault.from_environment())
    try:
        with warnings.catch_warnings(), gc_paused():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                     no_dist=no_dist)
    except dcp.api.CheckpointException as e:
        raise CheckpointError(first_failure(e, iter_dir, "saving")) from None


def load(state: dict, iter_dir: str, process_group=None, no_dist: bool = False, index: Metadata | None = None,
         verify: bool = True) -> dict:
    """Fill every :class:`Sharded` piece of ``state`` in place; return the decoded :class:`Obj` entries. ``index``:
    the directory's index when the caller has already read it with :func:`read_index` and :func:`check_files`;
    ``verify``: check every tensor item against its CRC-32s as it is read (:class:`~.reader.Reader`).

    Each rank plans and reads its own pieces (a load plan depends only on the rank's entries and the index; DCP's
    gather and scatter of every rank's plan would add nothing): DCP runs per rank, and over ``process_group`` the
    ranks then agree in one small all-reduce whether every rank succeeded. On failure every rank raises the same
    error, the lowest failing rank's."""
    skip_discarded_dcp_records()
    planner = LoadPlanner()
    error = None
    try:
        with warnings.catch_warnings(), gc_paused():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=Reader(iter_dir, index, verify), planner=planner, no_dist=True)
    except dcp.api.CheckpointException as e:
        error = first_failure(e, iter_dir, "loading")
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # anything else a rank hit is reported by every rank
        error = _failure_line("loading", iter_dir, dist.get_rank() if dist.is_initialized() else 0, e)
    if not no_dist and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        comm.all_reduce(failed, group=process_group)
        if failed.item():
            errors = [None] * dist.get_world_size(process_group)
            comm.all_gather_object(errors, error, group=process_group)
            error = next(e for e in errors if e is not None)
    if error is not None:
        raise CheckpointError(error)
    return planner.objects


def first_failure(e, iter_dir: str, what: str) -> str:
    """One line from DCP's per-rank failures (our own errors pass through unchanged)."""
    for rank, pair in sorted((e.failures or {}).items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, CheckpointError):
            return str(inner)
        return _failure_line(what, iter_dir, rank, inner)
    return f"{what} checkpoint {iter_dir} failed"


def _failure_line(what: str, iter_dir: str, rank: int, err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{what} checkpoint {iter_dir} failed on rank {rank}: {type(err).__name__}: {text[-1] if text else ''}"
