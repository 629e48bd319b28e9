"""The ``torch.save`` archive of one stored chunk, parsed without ``torch.load``: its zip records found from the
local headers at its start (or from its central directory at the end), its ``data.pkl`` unpickled weights-only
onto the meta device, and the requested block read with one ``preadv`` straight into the destination."""
from __future__ import annotations

import io
import math
import os
import struct

import torch
from torch import _weights_only_unpickler
from torch.distributed.checkpoint.planner import (
    ReadItem,
)

from ...errors import CheckpointError
from ..crc import crc32
from .verify import Checksums, damaged, stored_crc

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
            if csize == usize == q - data and crc32(head[data:q]) == crc:
                break
            q = head.find(b"PK\x07\x08", q + 1)
        else:
            out[name] = (data, None)
            break
        out[name] = (data, q - data)
        pos = q + _DESCRIPTOR.size
    return out


def read_into(f, info, item: ReadItem, target: torch.Tensor, verify: tuple[str, str] | None = None,
              checks: Checksums | None = None) -> bool:
    """Read the requested block of a stored chunk straight into ``target``; False when it is not one contiguous
    byte range of a plain contiguous chunk (the caller then takes the general path). The archive's records are
    found from its first 4 KiB (its local headers) when they are all there, so the file is read front to back;
    else from its central directory at the end.

    ``verify``: ``(shard path, item name)`` to check the data against its record's CRC-32 (on ``checks``' thread,
    beside the reads; the
    ``data.pkl`` record found in the first 4 KiB is checked by that search); a request for a block of the chunk
    reads the whole record to check it (the rest through a scratch chunk). Only archives whose records were all
    found in the first 4 KiB are read this way (else False: the caller reads and checks the item whole)."""
    if target.device.type != "cpu" or not target.is_contiguous():
        return False
    head = pread_exact(f.fileno(), info.offset, min(info.length, _EndsView.END))
    found = _from_head(head, info.length)
    if found is None and verify is None:
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
    if verify is not None:
        _read_verified(f.fileno(), info.offset + data_offset, data_size, first * target.element_size(), target,
                       checks, verify)
        return True
    if nbytes:
        offset = info.offset + data_offset + first * target.element_size()
        preadv_exact(f.fileno(), memoryview(target.reshape(-1).view(torch.uint8).numpy()), offset)
    return True


def _read_verified(fd: int, offset: int, size: int, start: int, target: torch.Tensor, checks: Checksums,
                   where: tuple[str, str]) -> None:
    """Read the whole ``size``-byte data record at ``offset``, its bytes ``[start, start + target's size)`` into
    ``target``, checked against the CRC-32 in the record's data descriptor (an empty record has none, and nothing
    to check)."""
    if not size:
        return
    expected = stored_crc(fd, offset + size, size)
    if expected is None:
        raise damaged(*where, "has no intact data descriptor after its data")
    checks.read(fd, memoryview(target.reshape(-1).view(torch.uint8).numpy()), offset, size, start, expected, where)


def _from_head(head: bytes, length: int):
    """``(layout, data offset, data size)`` from the archive's local headers in ``head`` (see :func:`read_into`),
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
        self.head = pread_exact(fd, offset, n) if head is None else head
        self.tail_start = length - n
        self.tail = pread_exact(fd, offset + self.tail_start, n)

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
            preadv_exact(self.fd, memoryview(buf)[:n], self.offset + self.pos)
        self.pos = end
        return n


def preadv_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint shard (fd {fd}) ended {len(buf) - done} bytes early")
        done += n


def pread_exact(fd: int, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    preadv_exact(fd, memoryview(buf), offset)
    return bytes(buf)
