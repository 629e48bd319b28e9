"""The storage layer: rectangular pieces of global tensors in and out of ``torch.distributed.checkpoint``.

Every rank describes what it holds as :class:`Sharded` entries — a global shape plus a list of
:class:`Piece` s, each a local tensor and its offsets in the global tensor — and JSON-able :class:`Obj`
entries. DCP plans the writes (a piece held by several ranks, e.g. a DP replica, is written once: DCP's
dedup keys on ``(name, offsets)``) and, on load, computes which stored chunks overlap each requested
piece, so any layout reads any other.

A tensor-parallel split with ``partition_stride > 1`` (fused ``[gate; up]``) gives a rank ``stride``
separate blocks along the split dimension; each is its own piece.

Loading is weights-only: tensors are read with ``torch.load(weights_only=True)`` (or, for a plain contiguous chunk,
its ``data.pkl`` is unpickled weights-only onto the meta device and the data read straight into the destination),
JSON entries are decoded as JSON, and DCP's ``.metadata`` index is unpickled with an allow-list of DCP's own
classes.

Files are DCP's (``__<rank>_0.distcp``, byte for byte what ``FileSystemWriter`` writes): :class:`Writer` writes each
rank's file with large sequential writes straight from tensor memory on a background thread and one fsync;
:class:`Reader` reads chunks with one ``preadv`` into the destination where the layout allows.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import gc
import io
import json
import logging
import math
import mmap
import os
import pickle
import queue
import signal
import struct
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch import _weights_only_unpickler
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _create_file_view
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError
from ..parallel import comm_log as comm
from . import tensor_archive

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


# ---------------------------------------------------------------------------------------------------------------
# What a rank hands to DCP
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# JSON with exact tensors
# ---------------------------------------------------------------------------------------------------------------
def _tensor_bytes(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()


def encode(x):
    """JSON-able form of ``x``: tensors, numpy arrays, tuples, bytes and non-string-keyed dicts are tagged."""
    if isinstance(x, torch.Tensor):
        return {"__tensor__": str(x.dtype).removeprefix("torch."), "shape": list(x.shape), "b64": _tensor_bytes(x)}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": str(x.dtype), "shape": list(x.shape),
                "b64": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v) for v in x]}
    if isinstance(x, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: encode(v) for k, v in x.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot store a {type(x).__name__} in a checkpoint's JSON state")


def decode(x):
    """Inverse of :func:`encode`."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        dtype = getattr(torch, x["__tensor__"])
        raw = bytearray(base64.b64decode(x["b64"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(x["shape"]).clone()
    if "__ndarray__" in x:
        return np.frombuffer(base64.b64decode(x["b64"]), dtype=np.dtype(x["__ndarray__"])).reshape(x["shape"]).copy()
    if "__tuple__" in x:
        return tuple(decode(v) for v in x["__tuple__"])
    if "__bytes__" in x:
        return base64.b64decode(x["__bytes__"])
    if "__items__" in x:
        return {decode(k): decode(v) for k, v in x["__items__"]}
    return {k: decode(v) for k, v in x.items()}


def dumps(value) -> bytes:
    return json.dumps(encode(value), separators=(",", ":")).encode()


def loads(raw: bytes, what: str):
    try:
        return decode(json.loads(raw.decode()))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON ({e}); the checkpoint file is damaged") from None


# ---------------------------------------------------------------------------------------------------------------
# Planners
# ---------------------------------------------------------------------------------------------------------------
def _storage_ok(t: torch.Tensor) -> torch.Tensor:
    """What DCP writes: ``torch.save`` of a view stores its whole storage, so copy views of larger tensors."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()  # a fresh storage of exactly this size
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


class SavePlanner(DefaultSavePlanner):
    """Write items for our :class:`Sharded` / :class:`Obj` entries (plain tensors count as whole pieces)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._pieces: dict[MetadataIndex, torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, entry in self.state_dict.items():
            if isinstance(entry, torch.Tensor):
                entry = Sharded.whole(entry)
            if isinstance(entry, Obj):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            if not isinstance(entry, Sharded):
                raise TypeError(f"{key}: unsupported checkpoint entry {type(entry).__name__}")
            for piece in entry.pieces:
                index = MetadataIndex(key, torch.Size(piece.offsets))
                self._pieces[index] = piece.tensor
                items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.size()),
                        properties=TensorProperties(dtype=piece.tensor.dtype),
                        size=torch.Size(entry.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return self.state_dict[index.fqn]
        return self._pieces[MetadataIndex(index.fqn, index.offset)]

    def transform_object(self, write_item: WriteItem, obj):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(dumps(obj.value))
        return _storage_ok(obj)


class LoadPlanner(DefaultLoadPlanner):
    """Read items for our entries: each :class:`Piece` is filled in place from every stored chunk it
    overlaps; :class:`Obj` entries are decoded into :attr:`objects`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._pieces: dict[tuple, torch.Tensor] = {}
        self._aliases: dict[tuple, list] = {}

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for key, entry in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise CheckpointError(f"the checkpoint has no entry {key!r}")
            if isinstance(entry, Obj):
                requests.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
                continue
            if isinstance(entry, torch.Tensor):
                entry = Sharded.whole(entry)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint entry {key!r} is not a tensor")
            check_shape(key, tuple(md.size), entry)
            chunks = []
            for piece in entry.pieces:
                if entry.resizable_rows and md.size[0] < piece.offsets[0] + piece.tensor.size(0):
                    with torch.no_grad():  # rows the checkpoint does not have: padding, zero
                        start = max(0, md.size[0] - piece.offsets[0])
                        for t in [piece.tensor, *piece.aliases]:
                            t[start:].zero_()
                # the widest destination is read into and the others copied from it: an fp32 master copy loaded
                # alongside its bf16 model parameter gets the stored fp32 values, not their bf16 rounding
                targets = sorted([piece.tensor, *piece.aliases], key=lambda t: -t.element_size())
                self._pieces[(key, tuple(piece.offsets))] = targets[0]
                if piece.aliases:
                    self._aliases[(key, tuple(piece.offsets))] = targets[1:]
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.size()))
            requests += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.objects[key] = loads(value.getvalue(), f"checkpoint entry {key!r}")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(index.fqn, tuple(index.offset))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        index = read_item.dest_index
        for alias in self._aliases.get((index.fqn, tuple(index.offset)), ()):
            self.transform_tensor(read_item, alias).copy_(tensor)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor):
        # narrow to the overlap; the reader copies the stored data into this view
        return narrow(tensor, read_item.dest_offsets, read_item.lengths)


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


# ---------------------------------------------------------------------------------------------------------------
# Reading the index safely and checking the files it names
# ---------------------------------------------------------------------------------------------------------------
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension",
                    "torch.distributed.checkpoint._storage_utils")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
                    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _IndexUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` holds only DCP dataclasses, sizes, dtypes and layouts: refuse anything else."""

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name) if (
            module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                 torch.memory_format)))) else None
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint index")
        return obj


def read_index(iter_dir: str) -> Metadata:
    """The DCP index (``.metadata``) of a checkpoint directory, unpickled with an allow-list."""
    path = os.path.join(iter_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{iter_dir} is not a complete torch_dist checkpoint: it has no {METADATA_FILE} "
                              "index (the save did not finish, or this is not a checkpoint directory)")
    try:
        with open(path, "rb") as f:
            md = _IndexUnpickler(f).load()
    except (Exception, MemoryError, RecursionError) as e:  # allow-listed classes only: any failure is damage
        raise CheckpointError(f"cannot read the checkpoint index {path}: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint index")
    problem = _index_problem(md)
    if problem:
        raise CheckpointError(f"the checkpoint index {path} is damaged: {problem}")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(xs, n: int | None = None) -> bool:
    """A tuple, list or Size of ``n`` (any number when None) non-negative ints (not bools)."""
    if not isinstance(xs, (tuple, list)) or (n is not None and len(xs) != n):
        return False
    for v in xs:
        if not _is_int(v) or v < 0:
            return False
    return True


def _index_problem(md: Metadata) -> str | None:
    """What in an unpickled index is not a DCP index's structure (a damaged file can unpickle into anything), or
    None: every tensor's chunks lie inside its shape and have a storage record, every record a file range."""
    entries = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "no entry table or storage table"
    for info in storage.values():
        if not (isinstance(getattr(info, "relative_path", None), str) and _is_int(getattr(info, "offset", None))
                and _is_int(getattr(info, "length", None)) and info.offset >= 0 and info.length >= 0
                and os.sep not in info.relative_path and info.relative_path not in ("", ".", "..")):
            return "a storage record that is not a file range"
    # the records' (name, chunk offsets), as a MetadataIndex compares them (one pass instead of one
    # MetadataIndex per chunk)
    records = {(k.fqn, k.offset if k.offset is None else tuple(k.offset)) for k in storage
               if type(k) is MetadataIndex and (k.offset is None or isinstance(k.offset, tuple))}
    for key, entry in entries.items():
        if not isinstance(key, str):
            return "an entry without a name"
        if isinstance(entry, BytesStorageMetadata):
            if (key, None) not in records:
                return f"entry {key!r} has no storage record"
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"entry {key!r} is neither a tensor nor bytes"
        props, size, chunks = (getattr(entry, a, None) for a in ("properties", "size", "chunks"))
        if not isinstance(getattr(props, "dtype", None), torch.dtype) or not _ints(size) \
                or not isinstance(chunks, list):
            return f"tensor {key!r} has no dtype, shape or chunk list"
        size = tuple(size)
        for c in chunks:
            offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (_ints(offsets, len(size)) and _ints(sizes, len(size))
                    and all(o + n <= d for o, n, d in zip(offsets, sizes, size))):
                return f"tensor {key!r} has a chunk outside its shape {size}"
            if (key, tuple(offsets)) not in records:
                return f"tensor {key!r} has a chunk without a storage record"
    return None


def check_files(iter_dir: str, md: Metadata) -> None:
    """Every data file the index names exists and is long enough; else one error naming the file."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint shard {path} is missing (the index {METADATA_FILE} lists it); "
                                  "copy the whole checkpoint directory or load an earlier iteration")
        have = os.path.getsize(path)
        if have < size:
            raise CheckpointError(f"checkpoint shard {path} is truncated: {have} bytes, the index needs at least "
                                  f"{size}; the file was damaged or only partly copied")


class Reader(FileSystemReader):
    """File reader using :func:`read_index` (allow-listed unpickling) and checking the shard files first.

    Tensor chunks are read straight into their destination: each stored item is a ``torch.save`` archive whose
    one data record holds the contiguous chunk, so a request that covers a contiguous byte range of it (the whole
    chunk, or a block of leading-dimension rows) into a contiguous CPU destination is one ``preadv`` into the
    destination's memory (no temporary tensor, no second copy). Anything else (a column block, a non-contiguous
    or device destination, stream transforms) takes DCP's path: ``torch.load`` of the item, then a copy.
    """

    def __init__(self, path: str, index: Metadata | None = None):
        super().__init__(path)
        self._index = index  # already read and checked by the caller

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = self._index
        if md is None:
            md = read_index(str(self.path))
            check_files(str(self.path), md)
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner) -> torch.futures.Future:
        if any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda r: self.storage_data[r.storage_index].offset)  # one forward pass over the file
            with open(os.path.join(str(self.path), relative_path), "rb", buffering=0) as f:
                ahead = _ReadAhead(f.fileno(), [self.storage_data[r.storage_index] for r in items])
                for item in items:
                    info = self.storage_data[item.storage_index]
                    ahead.advance(info.offset)
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(_pread_exact(f.fileno(), info.offset, info.length)))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    if not _read_into(f, info, item, target):
                        stored = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                            weights_only=True)
                        target.copy_(narrow(stored, item.storage_offsets, item.lengths))
                    planner.commit_tensor(item, target)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class _ReadAhead:
    """Asks the kernel to read the byte ranges of ``infos`` (sorted by offset) in the background, at most about
    ``window`` bytes ahead of the reads (``POSIX_FADV_WILLNEED`` on runs of adjacent ranges, cut into pieces of at
    most a window; a shard that fits in one is asked for with one call per run before the first read): the disk
    works ahead of the copies and the per-item bookkeeping, and a rank's shard of any size never asks for more than
    two windows of page cache ahead of its reads."""

    def __init__(self, fd: int, infos, window: int = 256 << 20) -> None:
        self.fd, self.window, self.pieces = fd, window, []
        self.asked: list[tuple[int, int]] = []  # (offset, length) of each request made
        self.advise = getattr(os, "posix_fadvise", None)  # absent on some platforms: no read-ahead request
        start = end = None
        for info in [*infos, None]:
            if info is not None and end is not None and info.offset <= end:
                end = max(end, info.offset + info.length)
                continue
            if end is not None:
                self.pieces += [(o, min(window, end - o)) for o in range(start, end, window)]  # none when empty
            if info is not None:
                start, end = info.offset, info.offset + info.length
        self.pieces.reverse()  # popped from the end, lowest offset first
        self.advance(self.pieces[-1][0] if self.pieces else 0)

    def advance(self, offset: int) -> None:
        """The reads have reached ``offset``: ask for every piece that starts less than a window beyond it."""
        while self.pieces and self.pieces[-1][0] < offset + self.window:
            start, length = self.pieces.pop()
            if self.advise is None:
                continue
            try:
                self.advise(self.fd, start, length, os.POSIX_FADV_WILLNEED)  # length > 0 (0 means "to the end")
            except OSError:
                self.pieces.clear()
                return
            self.asked.append((start, length))


def read_ahead_own_shard(iter_dir: str, md: Metadata, rank: int, wanted) -> int:
    """Ask the kernel to start reading, in the background, the records of ``wanted(name)`` entries in the data file
    that rank ``rank`` wrote (``__{rank}_0.distcp``), as far as :class:`_ReadAhead` asks before the first read
    (about one read-ahead window). For a load into the layout that saved the checkpoint: each rank reads back exactly
    the pieces it wrote, so the disk can work while the rank plans its load (the reads ask for the same ranges
    again; pages already read are not read twice). Returns the bytes asked for; 0 where the file is not in the
    index or the platform has no ``posix_fadvise``."""
    name = f"__{rank}_0.distcp"
    infos = sorted((info for index, info in md.storage_data.items()
                    if info.relative_path == name and wanted(index.fqn)), key=lambda info: info.offset)
    if not infos:
        return 0
    try:
        fd = os.open(os.path.join(iter_dir, name), os.O_RDONLY)
    except OSError:
        return 0  # the load reports a missing file itself
    try:
        ahead = _ReadAhead(fd, infos)
        return sum(length for _, length in ahead.asked)
    finally:
        os.close(fd)


_LAYOUTS: dict[bytes, tuple | None] = {}


def _stored_layout(pickled: bytes):
    """``(dtype, shape, storage key)`` of the tensor an item's ``data.pkl`` describes when it is contiguous, starts
    at offset 0 and fills its one storage exactly; else None. Unpickled weights-only onto the meta device (no data
    read)."""
    if pickled in _LAYOUTS:
        return _LAYOUTS[pickled]
    sizes, keys = [], []

    def persistent_load(saved_id):
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        sizes.append(numel * dtype.itemsize)
        keys.append(str(key))
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(numel * dtype.itemsize, device="meta"),
                                          dtype=dtype, _internal=True)

    layout = None
    try:
        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        t = unpickler.load()
        if isinstance(t, torch.Tensor) and len(sizes) == 1 and t.is_contiguous() and t.storage_offset() == 0 \
                and sizes[0] == t.numel() * t.element_size():
            layout = (t.dtype, tuple(t.shape), keys[0])
    except Exception:
        layout = None
    _LAYOUTS[pickled] = layout
    return layout


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
_DESCRIPTOR = struct.Struct("<4sIII")  # the data descriptor after a record whose local header has no sizes


def _head_records(head: bytes) -> dict[str, tuple[int, int | None]]:
    """``{name: (data offset, size or None)}`` of the stored zip records whose local headers lie in ``head``, the
    first bytes of a ``torch.save`` archive, walked in order. ``torch.save`` puts each record's sizes in a data
    descriptor after its data; a descriptor is taken only where its sizes equal the distance from the data and its
    CRC-32 matches the bytes (so a chance ``PK\\x07\\x08`` inside the data is skipped). The size is None for the
    record whose descriptor lies past ``head`` (the walk stops there). Empty for a compressed record."""
    out, pos = {}, 0
    while pos + _LOCAL_HEADER.size <= len(head):
        sig, _ver, flags, method, _t, _d, _crc, csize, _usize, nlen, elen = _LOCAL_HEADER.unpack_from(head, pos)
        if sig != b"PK\x03\x04":
            break
        if method != 0:
            return {}
        start = pos + _LOCAL_HEADER.size
        name = head[start:start + nlen].decode("utf-8", "replace")
        data = start + nlen + elen
        if data > len(head):
            break
        if not flags & 0x08:  # sizes in the local header
            out[name] = (data, csize)
            pos = data + csize
            continue
        q = head.find(b"PK\x07\x08", data)
        while q >= 0 and q + _DESCRIPTOR.size <= len(head):
            _, crc, csize, usize = _DESCRIPTOR.unpack_from(head, q)
            if csize == usize == q - data and zlib.crc32(head[data:q]) == crc:
                break
            q = head.find(b"PK\x07\x08", q + 1)
        else:
            out[name] = (data, None)
            break
        out[name] = (data, q - data)
        pos = q + _DESCRIPTOR.size
    return out


def _read_into(f, info, item: ReadItem, target: torch.Tensor) -> bool:
    """Read the requested block of a stored chunk straight into ``target``; False when it is not one contiguous
    byte range of a plain contiguous chunk (the caller then takes the general path). The archive's records are
    found from its first 4 KiB (its local headers) when they are all there, so the file is read front to back;
    else from its central directory at the end."""
    if target.device.type != "cpu" or not target.is_contiguous():
        return False
    head = _pread_exact(f.fileno(), info.offset, min(info.length, _EndsView.END))
    found = _from_head(head, info.length)
    if found is None:
        found = _from_directory(_EndsView(f.fileno(), info.offset, info.length, head))
    if found is None:
        return False
    layout, data_offset, data_size = found
    if layout[0] != target.dtype or data_size != math.prod(layout[1]) * target.element_size():
        return False
    shape, starts, lengths = layout[1], list(item.storage_offsets), list(item.lengths)
    if len(shape) != len(lengths) or tuple(lengths) != tuple(target.shape):
        return False
    # one contiguous byte range: length 1 before some dim k, any length at k, whole dims after k
    k = next((d for d in range(len(shape)) if lengths[d] != 1), len(shape))
    if any(starts[d] != 0 or lengths[d] != shape[d] for d in range(k + 1, len(shape))):
        return False
    first = sum(starts[d] * math.prod(shape[d + 1:]) for d in range(len(shape)))
    nbytes = target.numel() * target.element_size()
    if nbytes:
        offset = info.offset + data_offset + first * target.element_size()
        _preadv_exact(f.fileno(), memoryview(target.reshape(-1).view(torch.uint8).numpy()), offset)
    return True


def _from_head(head: bytes, length: int):
    """``(layout, data offset, data size)`` from the archive's local headers in ``head`` (see :func:`_read_into`),
    or None."""
    records = _head_records(head)
    pickles = [n for n in records if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        return None
    start, size = records[pickles[0]]
    if size is None:
        return None
    layout = _stored_layout(head[start:start + size])
    if layout is None:
        return None
    data = records.get(pickles[0][:-len("data.pkl")] + "data/" + layout[2])
    nbytes = math.prod(layout[1]) * layout[0].itemsize
    if data is None or data[1] not in (None, nbytes) or data[0] + nbytes > length:
        return None
    return layout, data[0], nbytes


def _from_directory(view: "_EndsView"):
    """``(layout, data offset, data size)`` through the archive's central directory, or None."""
    archive = torch._C.PyTorchFileReader(view)
    records = [r for r in archive.get_all_records() if r.startswith("data/")]
    if len(records) != 1 or not archive.has_record("data.pkl"):
        return None
    layout = _stored_layout(archive.get_record("data.pkl"))
    if layout is None:
        return None
    return layout, archive.get_record_offset(records[0]), archive.get_record_size(records[0])


class _EndsView(io.RawIOBase):
    """One stored item as a seekable file whose first and last 4 KiB (the zip records ``torch.load`` parses) are
    read with one read each; other ranges are read from the file when asked."""

    END = 4096

    def __init__(self, fd: int, offset: int, length: int, head: bytes | None = None):
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0
        n = min(length, self.END)
        self.head = _pread_exact(fd, offset, n) if head is None else head
        self.tail_start = length - n
        self.tail = _pread_exact(fd, offset + self.tail_start, n)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        end = self.pos + n
        if end <= len(self.head):
            buf[:n] = self.head[self.pos:end]
        elif self.pos >= self.tail_start:
            buf[:n] = self.tail[self.pos - self.tail_start:end - self.tail_start]
        else:
            _preadv_exact(self.fd, memoryview(buf)[:n], self.offset + self.pos)
        self.pos = end
        return n


def _preadv_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint shard (fd {fd}) ended {len(buf) - done} bytes early")
        done += n


def _pread_exact(fd: int, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    _preadv_exact(fd, memoryview(buf), offset)
    return bytes(buf)


class Writer(FileSystemWriter):
    """DCP's file writer, one ``__<rank>_0.distcp`` file per rank, in DCP's format and item order (each tensor a
    ``torch.save`` archive, JSON entries as raw bytes), written through :class:`_OrderedFile`: the small zip records
    are gathered into large writes, each tensor's data is written straight from its memory by a background thread
    (which releases the GIL in ``write``) while ``torch.save`` checksums the next bytes, and the file is fsync'd
    once at the end."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)

    def write_data(self, plan: SavePlan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results: list = []
        fault = _test_fault(str(self.path))
        plain = not self.transforms.extensions and self.serialization_format == dcp_fs.SerializationFormat.TORCH_SAVE
        with _OrderedFile(os.path.join(str(self.path), name)) as out:
            # DCP's order: the byte entries, then the tensors in plan order
            for i, item in enumerate(sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)):
                if fault is not None and i == len(plan.items) // 2:
                    out.sync()  # half of this rank's file is on disk
                    _inject_fault(fault)
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = data.detach() if data.device.type == "cpu" else data.detach().cpu()
                    out.lend(data)
                    if plain:  # torch.save's bytes, checksummed without holding the GIL
                        offset = out.tell()
                        if tensor_archive.write(out, data):
                            length = out.tell() - offset
                            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                                       storage_data=dcp_fs._StorageInfo(name, offset, length)))
                            continue
                # DCP's own item writer (torch.save of the tensor, or the raw bytes) into our file
                results.append(dcp_fs._write_item(self.transforms, out, data, item, name, self.serialization_format))
            out.sync()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut


SAVE_FAULT_ENV = "MEGATRONISH_TEST_SAVE_FAULT"


def _test_fault(iter_dir: str) -> str | None:
    """Test hook: ``MEGATRONISH_TEST_SAVE_FAULT=<kill|enospc>:<iteration directory name>[:<rank>]`` makes this
    rank's write of that directory stop half-way: SIGKILL to the process, or an ENOSPC write error."""
    spec = os.environ.get(SAVE_FAULT_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if os.path.basename(os.path.normpath(iter_dir)) != parts[1] or (len(parts) > 2 and int(parts[2]) != rank):
        return None
    return parts[0]


def _inject_fault(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


DIRECT_IO = True  # write checkpoint files with O_DIRECT where the file system allows it (tests turn it off)
_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of this


class _BouncePool:
    """Page-aligned host blocks that O_DIRECT writes go out of, allocated on first use and kept for every later
    save of the process (their pages stay resident: a first touch of fresh memory costs a page fault per page, and
    in a virtual machine that returns freed memory to its host, one on the host as well). A process forked later
    shares them copy-on-write, which costs one fault per page of these 16 MiB at the first save after the fork
    (marking them ``MADV_DONTFORK`` instead would leave a forked child with pool objects whose memory it does not
    have)."""

    COUNT = 4

    def __init__(self, block: int = 4 << 20):
        self.block = block  # a multiple of _ALIGN
        self.lock = threading.Lock()
        self.free: list[mmap.mmap] = []

    def take(self, n: int) -> list:
        with self.lock:
            got, self.free = self.free[:n], self.free[n:]
        while len(got) < n:
            # private: a forked process gets its own copy of a page when either side writes it
            block = mmap.mmap(-1, self.block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            block.write(bytes(self.block))  # resident now, not in the middle of a save
            got.append(block)
        return got

    def give(self, blocks: list) -> None:
        with self.lock:
            self.free.extend(blocks)


_BOUNCE = _BouncePool()


def _open_direct(path: str) -> int | None:
    """A second descriptor of ``path`` opened with ``O_DIRECT``, or None where that is off, unknown to the OS, or
    refused by the file system (tmpfs, some FUSE and network mounts)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not DIRECT_IO or not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n}")
        done += n


class _OrderedFile:
    """A write-only file whose bytes reach the disk in order on background threads, with one fsync at the end.

    Writes of at least ``LENT`` bytes that lie inside a tensor handed to :meth:`lend` are queued as they are (no
    copy; the tensor is kept until :meth:`sync`); smaller writes are gathered into ``GATHER``-byte blocks. Where
    the file system takes ``O_DIRECT``, one thread copies the queued bytes into page-aligned blocks
    (:class:`_BouncePool`) and a second writes each full block with ``O_DIRECT`` (the disk reads it by DMA; no
    page-cache page is allocated or copied into); the last partial block's unaligned tail goes through the page
    cache. Elsewhere one thread writes the queued bytes through the page cache. The copy into a block takes the
    place of the kernel's copy into the page cache: no byte is copied more often than with plain writes."""

    LENT = 1 << 18
    GATHER = 1 << 22

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd = _open_direct(path)
        self.pos = 0
        self.small = bytearray()
        self.lent: list[torch.Tensor] = []
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        if self.direct_fd is None:
            self.threads = [threading.Thread(target=self._drain, name="checkpoint-file-writer", daemon=True)]
        else:
            self.pool = _BOUNCE
            self.blocks = self.pool.take(_BouncePool.COUNT)
            self.empty: queue.Queue = queue.Queue()
            for block in self.blocks:
                self.empty.put(block)
            self.full: queue.Queue = queue.Queue()
            self.threads = [threading.Thread(target=self._fill, name="checkpoint-file-copier", daemon=True),
                            threading.Thread(target=self._write_blocks, name="checkpoint-file-writer",
                                             daemon=True)]
        for t in self.threads:
            t.start()

    def _drain(self) -> None:
        """Page-cache writes of the queued bytes, in order."""
        offset = 0
        while True:
            buf = self.queue.get()
            if buf is None:
                return
            view = memoryview(buf).cast("B")
            if self.error is None:
                try:
                    _pwrite_all(self.fd, view, offset)
                except BaseException as e:
                    self.error = e
            offset += len(view)

    def _fill(self) -> None:
        """Copy the queued bytes into aligned blocks, in order; hand each full block (and the last) to the
        writer thread."""
        block, fill, offset, size = None, 0, 0, 0
        while True:
            buf = self.queue.get()
            if buf is None:
                break
            src = np.frombuffer(buf, dtype=np.uint8)
            i = 0
            while i < len(src) and self.error is None:
                if block is None:
                    block, fill = self.empty.get(), 0
                    dst = np.frombuffer(block, dtype=np.uint8)
                    size = len(dst)
                n = min(size - fill, len(src) - i)
                dst[fill:fill + n] = src[i:i + n]
                fill, i = fill + n, i + n
                if fill == size:
                    self.full.put((block, size, offset))
                    offset += size
                    block = None
        if block is not None:
            self.full.put((block, fill, offset))
        self.full.put(None)

    def _write_blocks(self) -> None:
        """``O_DIRECT`` writes of the full blocks; a block's unaligned tail (only the last block has one) through
        the page cache. A file system that refuses an ``O_DIRECT`` write gets this and every later block through
        the page cache."""
        while True:
            item = self.full.get()
            if item is None:
                return
            block, n, offset = item
            try:
                if self.error is None:
                    view = memoryview(block)[:n]
                    done = 0
                    if self.direct_fd is not None:
                        try:
                            _pwrite_all(self.direct_fd, view[: n - n % _ALIGN], offset)
                            done = n - n % _ALIGN
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            os.close(self.direct_fd)
                            self.direct_fd = None
                    _pwrite_all(self.fd, view[done:], offset + done)
            except BaseException as e:
                self.error = e
            finally:
                self.empty.put(block)

    def lend(self, tensor: torch.Tensor) -> None:
        self.lent.append(tensor)

    def _inside_lent(self, view: memoryview) -> bool:
        if not self.lent or len(view) == 0:
            return False
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data
        t = self.lent[-1]
        base = t.untyped_storage().data_ptr()
        return base <= start and start + len(view) <= base + t.untyped_storage().nbytes()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n >= self.LENT and self._inside_lent(view):
            self._flush_small()
            self.queue.put(view)
        else:
            self.small += view
            if len(self.small) >= self.GATHER:
                self._flush_small()
        self.pos += n
        return n

    def _flush_small(self) -> None:
        if self.small:
            self.queue.put(self.small)
            self.small = bytearray()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        """Called by ``torch.save`` after each archive; small records keep gathering across archives."""

    def _stop(self) -> None:
        self.queue.put(None)
        for t in self.threads:
            t.join()

    def sync(self) -> None:
        """Write everything, fsync, and raise the first write error."""
        self._flush_small()
        self._stop()
        if self.error is not None:
            raise self.error
        os.fsync(self.fd)  # the inode: data written either way, and the metadata

    def __enter__(self) -> "_OrderedFile":
        return self

    def __exit__(self, *exc) -> None:
        if any(t.is_alive() for t in self.threads):  # an exception before sync(): stop the threads, keep the error
            self.small = bytearray()
            self.error = self.error or CheckpointError("write abandoned")
            self._stop()
        self.lent.clear()
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        if hasattr(self, "blocks"):
            self.pool.give(self.blocks)
        os.close(self.fd)


def read_bytes_entry(iter_dir: str, md: Metadata, key: str):
    """Decode one JSON entry straight from its shard file (no collectives)."""
    info = (md.storage_data or {}).get(MetadataIndex(key))
    if info is None or not isinstance(md.state_dict_metadata.get(key), BytesStorageMetadata):
        raise CheckpointError(f"checkpoint {iter_dir} has no {key!r} entry; it was not written by this program "
                              "or the save did not finish")
    raw, path = _read_range(iter_dir, info, key)
    return loads(raw, f"entry {key!r} in {path}")


def _read_range(iter_dir: str, info, key: str) -> tuple[bytes, str]:
    """The bytes of one stored item (``info``: its storage record) and the shard path they came from."""
    path = os.path.join(iter_dir, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    if len(raw) != info.length:
        raise CheckpointError(f"checkpoint shard {path} is truncated (entry {key!r})")
    return raw, path


def read_tensor(iter_dir: str, md: Metadata, key: str) -> torch.Tensor:
    """Assemble one global tensor from its stored chunks (weights-only reads, no collectives)."""
    tmd = md.state_dict_metadata.get(key)
    if not isinstance(tmd, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint {iter_dir} has no tensor {key!r}")
    out = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    for chunk in tmd.chunks:
        info = md.storage_data[MetadataIndex(key, chunk.offsets)]
        if info.transform_descriptors:
            raise CheckpointError(f"{key!r} in {iter_dir} uses storage transforms {info.transform_descriptors}, "
                                  "which this reader does not support")
        raw, path = _read_range(iter_dir, info, key)
        try:
            part = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # any decoding failure is a damaged file
            raise CheckpointError(f"cannot read {key!r} from checkpoint shard {path}: {e}") from None
        narrow(out, chunk.offsets, chunk.sizes).copy_(part)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------------------------
def _skip_discarded_dcp_records() -> None:
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


def save(state: dict, iter_dir: str, process_group=None, no_dist: bool = False) -> None:
    """Write ``state`` (entries as above) to ``iter_dir``; collective over ``process_group`` unless ``no_dist``."""
    _skip_discarded_dcp_records()
    os.makedirs(iter_dir, exist_ok=True)
    writer = Writer(iter_dir)
    try:
        with warnings.catch_warnings(), gc_paused():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                     no_dist=no_dist)
    except dcp.api.CheckpointException as e:
        raise CheckpointError(_first_failure(e, iter_dir, "saving")) from None


def load(state: dict, iter_dir: str, process_group=None, no_dist: bool = False, index: Metadata | None = None) -> dict:
    """Fill every :class:`Sharded` piece of ``state`` in place; return the decoded :class:`Obj` entries. ``index``:
    the directory's index when the caller has already read it with :func:`read_index` and :func:`check_files`.

    Each rank plans and reads its own pieces (a load plan depends only on the rank's entries and the index; DCP's
    gather and scatter of every rank's plan would add nothing): DCP runs per rank, and over ``process_group`` the
    ranks then agree in one small all-reduce whether every rank succeeded. On failure every rank raises the same
    error, the lowest failing rank's."""
    _skip_discarded_dcp_records()
    planner = LoadPlanner()
    error = None
    try:
        with warnings.catch_warnings(), gc_paused():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=Reader(iter_dir, index), planner=planner, no_dist=True)
    except dcp.api.CheckpointException as e:
        error = _first_failure(e, iter_dir, "loading")
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


def _first_failure(e, iter_dir: str, what: str) -> str:
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
