"""What a rank hands to the storage layer: :class:`Sharded` tensors (a global shape and the rank's
:class:`Piece` s of it) and :class:`Obj` JSON values; block arithmetic on them; the index file's name; the
garbage collector paused around a save or load."""
from __future__ import annotations

import contextlib
import gc
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CheckpointError

METADATA_FILE = ".metadata"


@contextlib.contextmanager
def gc_paused():
    """Python's automatic garbage collection off for the block, on the main thread (a no-op elsewhere, and where it
    is already off, e.g. ``--manual-gc``). A save or load allocates thousands of short-lived, acyclic objects (the
    index, plans, read and write items) that refcounting frees; with the collector on they trip a full collection
    of the whole heap (a training process's hundreds of thousands of objects) now and then, and in a collective
    save or load that one rank's pause holds up every rank."""
    if threading.current_thread() is not threading.main_thread() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()



@dataclass
class Piece:
    """``tensor`` is the block of the global tensor starting at ``offsets``. On load, ``aliases`` (same shape)
    receive the same data (a tensor held twice by one rank, e.g. a tied weight)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    aliases: list = field(default_factory=list)


@dataclass
class Sharded:
    """A global tensor of ``global_shape``, of which this rank holds ``pieces``.

    ``resizable_rows``: dim 0 is a padded vocabulary; on load a checkpoint with another row count is
    accepted (rows past the stored ones stay zero, stored rows past ours are dropped).
    """

    global_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    resizable_rows: bool = False

    @classmethod
    def whole(cls, tensor: torch.Tensor, resizable_rows: bool = False) -> "Sharded":
        return cls(tuple(tensor.shape), [Piece(tensor, (0,) * tensor.dim())], resizable_rows)


@dataclass
class Obj:
    """A JSON-able value (tensors, numpy arrays and tuples inside are encoded exactly, see :func:`encode`)."""

    value: Any = None


def narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The block of ``tensor`` starting at ``offsets`` with ``lengths`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def check_shape(key: str, stored: tuple[int, ...], entry: Sharded) -> None:
    want = tuple(entry.global_shape)
    if stored == want:
        return
    if entry.resizable_rows and len(stored) == len(want) and stored[1:] == want[1:]:
        return
    raise CheckpointError(f"checkpoint tensor {key!r} has global shape {list(stored)}, this run's model needs "
                          f"{list(want)}; the checkpoint is from a different model shape")
