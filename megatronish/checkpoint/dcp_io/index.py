"""Reading a checkpoint's DCP index (``.metadata``) safely, with an allow-list of DCP's own classes and a check
of its structure, and checking the data files it names."""
from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import CheckpointError
from .entries import METADATA_FILE

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
