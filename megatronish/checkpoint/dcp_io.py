"""The storage layer: rectangular pieces of global tensors in and out of ``torch.distributed.checkpoint``.

Every rank describes what it holds as :class:`Sharded` entries — a global shape plus a list of
:class:`Piece` s, each a local tensor and its offsets in the global tensor — and JSON-able :class:`Obj`
entries. DCP plans the writes (a piece held by several ranks, e.g. a DP replica, is written once: DCP's
dedup keys on ``(name, offsets)``) and, on load, computes which stored chunks overlap each requested
piece, so any layout reads any other.

A tensor-parallel split with ``partition_stride > 1`` (fused ``[gate; up]``) gives a rank ``stride``
separate blocks along the split dimension; each is its own piece.

Loading is weights-only: tensors are read with ``torch.load(weights_only=True)``, JSON entries are
decoded as JSON, and DCP's ``.metadata`` index is unpickled with an allow-list of DCP's own classes.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list

from ..errors import ConfigError

METADATA_FILE = ".metadata"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: one line naming the file or field and the fix."""


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
                self._pieces[(key, tuple(piece.offsets))] = piece.tensor
                if piece.aliases:
                    self._aliases[(key, tuple(piece.offsets))] = piece.aliases
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
        # narrow to the overlap; DCP copies the stored data into this view
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
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
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read the checkpoint index {path}: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint index")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


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
    """File reader using :func:`read_index` (allow-listed unpickling) and checking the shard files first."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_index(str(self.path))
        md.storage_meta.load_id = self.load_id
        check_files(str(self.path), md)
        return md


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
        view = out
        for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
            view = view.narrow(dim, o, s)
        view.copy_(part)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------------------------
def save(state: dict, iter_dir: str, process_group=None, no_dist: bool = False) -> None:
    """Write ``state`` (entries as above) to ``iter_dir``; collective over ``process_group`` unless ``no_dist``."""
    os.makedirs(iter_dir, exist_ok=True)
    writer = FileSystemWriter(iter_dir, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                     no_dist=no_dist)
    except dcp.api.CheckpointException as e:
        raise CheckpointError(_first_failure(e, iter_dir, "saving")) from None


def load(state: dict, iter_dir: str, process_group=None, no_dist: bool = False) -> dict:
    """Fill every :class:`Sharded` piece of ``state`` in place; return the decoded :class:`Obj` entries."""
    planner = LoadPlanner()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=Reader(iter_dir), planner=planner, process_group=process_group,
                     no_dist=no_dist)
    except dcp.api.CheckpointException as e:
        raise CheckpointError(_first_failure(e, iter_dir, "loading")) from None
    return planner.objects


def _first_failure(e, iter_dir: str, what: str) -> str:
    """One line from DCP's per-rank failures (our own errors pass through unchanged)."""
    for rank, pair in sorted((e.failures or {}).items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, CheckpointError):
            return str(inner)
        text = str(inner).strip().splitlines()
        return f"{what} checkpoint {iter_dir} failed on rank {rank}: {type(inner).__name__}: " \
               f"{text[-1] if text else ''}"
    return f"{what} checkpoint {iter_dir} failed"
