"""Reading stored items: DCP's file reader with the allow-listed index and direct reads into the destination,
the kernel asked to read ahead, and single entries or whole tensors read without collectives."""
from __future__ import annotations

import io
import os

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
)

from ...errors import CheckpointError
from .archive import pread_exact, read_into
from .codec import loads
from .entries import narrow
from .index import check_files, read_index
from .verify import Checksums, archive_problem, damaged, item_name


class Reader(FileSystemReader):
    """File reader using :func:`read_index` (allow-listed unpickling) and checking the shard files first.

    Tensor chunks are read straight into their destination: each stored item is a ``torch.save`` archive whose
    one data record holds the contiguous chunk, so a request that covers a contiguous byte range of it (the whole
    chunk, or a block of leading-dimension rows) into a contiguous CPU destination is one ``preadv`` into the
    destination's memory (no temporary tensor, no second copy). Anything else (a column block, a non-contiguous
    or device destination) reads the item whole, ``torch.load`` (weights-only) of it, then a copy.

    ``verify`` (the default): every tensor item is checked against its archive's CRC-32s, the direct reads as the
    bytes arrive (:func:`~.archive.read_into`), any other item read whole and checked before it is decoded; a
    mismatch is one error naming the shard file and the item. Items with storage transforms (not written by this
    program) are read by DCP unchecked.
    """

    def __init__(self, path: str, index: Metadata | None = None, verify: bool = True):
        super().__init__(path)
        self._index = index  # already read and checked by the caller
        self.verify = verify

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
        checks = Checksums() if self.verify else None
        try:
            for relative_path, items in per_file.items():
                self._read_file(relative_path, items, planner, checks)
        except BaseException:
            if checks is not None:
                checks.pool.shutdown(wait=True)  # the read's own error is the one reported
            raise
        if checks is not None:
            checks.finish()  # the last checks, then the first mismatch if any
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _read_file(self, relative_path: str, items: list[ReadItem], planner, checks: Checksums | None) -> None:
        items.sort(key=lambda r: self.storage_data[r.storage_index].offset)  # one forward pass over the file
        with open(os.path.join(str(self.path), relative_path), "rb", buffering=0) as f:
            ahead = ReadAhead(f.fileno(), [self.storage_data[r.storage_index] for r in items])
            for item in items:
                info = self.storage_data[item.storage_index]
                ahead.advance(info.offset)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(pread_exact(f.fileno(), info.offset, info.length)))
                    continue
                target = planner.resolve_tensor(item).detach()
                where = (f.name, item_name(item.storage_index))
                if not read_into(f, info, item, target, where if self.verify else None, checks):
                    stored = load_item(pread_exact(f.fileno(), info.offset, info.length), *where, self.verify)
                    target.copy_(narrow(stored, item.storage_offsets, item.lengths))
                planner.commit_tensor(item, target)


class ReadAhead:
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
    that rank ``rank`` wrote (``__{rank}_0.distcp``), as far as :class:`ReadAhead` asks before the first read
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
        ahead = ReadAhead(fd, infos)
        return sum(length for _, length in ahead.asked)
    finally:
        os.close(fd)


def read_bytes_entry(iter_dir: str, md: Metadata, key: str):
    """Decode one JSON entry straight from its shard file (no collectives)."""
    info = (md.storage_data or {}).get(MetadataIndex(key))
    if info is None or not isinstance(md.state_dict_metadata.get(key), BytesStorageMetadata):
        raise CheckpointError(f"checkpoint {iter_dir} has no {key!r} entry; it was not written by this program "
                              "or the save did not finish")
    raw, path = read_range(iter_dir, info, key)
    return loads(raw, f"entry {key!r} in {path}")


def read_range(iter_dir: str, info, key: str) -> tuple[bytes, str]:
    """The bytes of one stored item (``info``: its storage record) and the shard path they came from."""
    path = os.path.join(iter_dir, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    if len(raw) != info.length:
        raise CheckpointError(f"checkpoint shard {path} is truncated (entry {key!r})")
    return raw, path


def load_item(raw: bytes, path: str, key: str, verify: bool = True) -> torch.Tensor:
    """One stored tensor item (``raw``: its ``torch.save`` archive from shard ``path``) decoded weights-only, its
    records checked against their CRC-32s first unless ``verify`` is False."""
    problem = archive_problem(raw) if verify else None
    if problem is not None:
        raise damaged(path, key, problem)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # any decoding failure is a damaged file
        raise CheckpointError(f"cannot read {key!r} from checkpoint shard {path}: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


def read_tensor(iter_dir: str, md: Metadata, key: str, verify: bool = True) -> torch.Tensor:
    """Assemble one global tensor from its stored chunks (weights-only reads, each checked against its CRC-32s
    unless ``verify`` is False; no collectives)."""
    tmd = md.state_dict_metadata.get(key)
    if not isinstance(tmd, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint {iter_dir} has no tensor {key!r}")
    out = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    for chunk in tmd.chunks:
        info = md.storage_data[MetadataIndex(key, chunk.offsets)]
        if info.transform_descriptors:
            raise CheckpointError(f"{key!r} in {iter_dir} uses storage transforms {info.transform_descriptors}, "
                                  "which this reader does not support")
        raw, path = read_range(iter_dir, info, key)
        part = load_item(raw, path, item_name(MetadataIndex(key, chunk.offsets)), verify)
        narrow(out, chunk.offsets, chunk.sizes).copy_(part)
    return out
