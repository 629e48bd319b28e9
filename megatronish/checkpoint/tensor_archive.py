"""``torch.save`` of one CPU tensor, byte for byte, without its CPU cost.

A DCP shard file holds one ``torch.save`` archive per tensor. ``torch.save`` computes each record's CRC-32 with
a table-driven loop while holding the GIL; with several ranks sharing the cores, that checksum was a large part of a
save's CPU time. :func:`write` writes the same archive (an uncompressed zip, ``archive/`` prefix, records
padded to the storage alignment with an ``FB`` extra field, sizes in a data descriptor after each record's data,
zip64 end records, ``.data/serialization_id`` from the record names and CRCs) with the data checksummed by
``checkpoint.crc.crc32`` (ISA-L's where installed, else zlib's), faster and releasing the GIL. The tensor's data is
handed to the output as a view of its memory.

The records themselves (``data.pkl`` and the small ones) come from ``torch.serialization._save``, the function
``torch.save`` runs inside its zip writer. The zip layout is checked once per process (and per CRC and alignment
setting) against ``torch.save`` on probe tensors; where it differs (another PyTorch version's format) or an
archive needs zip64 sizes, :func:`write` returns False and the caller uses ``torch.save``.
"""
from __future__ import annotations

import io
import pickle
import struct
import threading
import zipfile

import torch

from .crc import crc32

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_DESCRIPTOR = struct.Struct("<4sIII")  # data descriptor (32-bit sizes)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory header
_END64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator
_END = struct.Struct("<4sHHHHIIH")  # end of central directory record
_UTF8 = 0x0800  # UTF-8 names
_FLAGS = _UTF8 | 0x0008  # and sizes in a data descriptor
_LIMIT = 0xFFFFFFFF - (1 << 20)  # at or above this an archive needs zip64 sizes: left to torch.save
_MASK = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit ``size_t``, as the serialization id folds the records' CRCs."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)


class _Records:
    """Stands in for the zip writer ``torch.serialization._save`` writes into: keeps the records in order."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.records: list[tuple[str, object]] = []

    def write_record(self, name: str, data, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif isinstance(data, (torch.UntypedStorage, torch.TypedStorage)):
            data = _tensor_bytes(self.tensor, nbytes)
        if len(data) != nbytes:
            raise ValueError(f"record {name}: {len(data)} bytes, {nbytes} announced")
        self.records.append((name, data))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        raise ValueError("metadata-only records are not reproduced")


def _tensor_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The tensor's storage as bytes (a view): the caller saves only tensors that fill their storage exactly."""
    if tensor.untyped_storage().nbytes() != nbytes or tensor.storage_offset() != 0 or not tensor.is_contiguous():
        raise ValueError("the tensor does not fill its storage")
    if nbytes == 0:
        return memoryview(b"")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class _Format:
    """What an archive needs beyond its records: torch.save's trailing records and the name-hash half of the
    serialization id, both read off a probe archive."""

    def __init__(self, alignment: int, trailing: list[tuple[str, bytes]], name_hash: bytes):
        self.alignment = alignment
        self.trailing = trailing
        self.name_hash = name_hash

    def pieces(self, records: list[tuple[str, object]]):
        """The archive as a list of byte strings and data views, and its length."""
        out: list = []
        central: list[bytes] = []
        pos, combined = 0, 0
        names = {name for name, _ in records}
        tail = [(n, d) for n, d in self.trailing if n not in names]
        for name, data in records + tail + [(".data/serialization_id", None)]:
            if data is None:
                data = self.name_hash + b"%020d" % combined
            full = ("archive/" + name).encode()
            size = len(data)
            if size >= _LIMIT or pos >= _LIMIT:
                return None, 0
            offset = pos
            start = pos + _LOCAL.size + len(full) + 4
            pad = -start % self.alignment
            extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            # an empty record has no data descriptor (its local header's zero sizes and CRC are final), and only
            # descriptors feed the serialization id
            flags = _FLAGS if size else _UTF8
            crc = crc32(data) if size else 0
            out.append(_LOCAL.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
            pos = start + pad
            if size:
                combined = _hash_combine(combined, crc)
                out.append(data)
                out.append(_DESCRIPTOR.pack(b"PK\x07\x08", crc, size, size))
                pos += size + _DESCRIPTOR.size
            central.append(_CENTRAL.pack(b"PK\x01\x02", 0, 0, flags, 0, 0, 0, crc, size, size, len(full), 0, 0, 0,
                                         0, 0, offset) + full)
        directory = b"".join(central)
        n = len(central)
        end64 = _END64.pack(b"PK\x06\x06", _END64.size - 12, 0x031E, 0x2D, 0, 0, n, n, len(directory), pos)
        locator = _LOCATOR.pack(b"PK\x06\x07", 0, pos + len(directory), 1)
        end = _END.pack(b"PK\x05\x06", 0, 0, n, n, len(directory), pos, 0)
        out.append(directory + end64 + locator + end)
        return out, pos + len(directory) + len(end64) + len(locator) + len(end)


def _records(tensor: torch.Tensor) -> list[tuple[str, object]]:
    sink = _Records(tensor)
    torch.serialization._save(tensor, sink, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    return sink.records


def _settings() -> tuple:
    """The torch.save settings an archive's bytes depend on."""
    s = torch.serialization
    crc = s.get_crc32_options() if hasattr(s, "get_crc32_options") else True
    align = s._get_storage_alignment() if hasattr(s, "_get_storage_alignment") else 64
    return bool(crc), int(align)


def _reference(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


_PROBES = (lambda: torch.arange(10, dtype=torch.float32), lambda: torch.ones(3, 5, dtype=torch.bfloat16),
           lambda: torch.arange(7, dtype=torch.int64).reshape(7, 1), lambda: torch.empty(0, 4))
_FORMATS: dict[tuple, _Format | None] = {}
_LOCK = threading.Lock()


def _learn(settings: tuple) -> _Format | None:
    """The archive format under ``settings``, checked on every probe against ``torch.save``; None where any probe
    differs (or ``torch.serialization._save`` is not what this module expects)."""
    crc_on, alignment = settings
    if not crc_on:
        return None
    try:
        first = _reference(_PROBES[0]())
        with zipfile.ZipFile(io.BytesIO(first)) as z:
            names = [i.filename.removeprefix("archive/") for i in z.infolist()]
            sid = z.read("archive/.data/serialization_id")
            stored = {n: z.read("archive/" + n) for n in names}
        written = {n for n, _ in _records(_PROBES[0]())}
        trailing = [(n, stored[n]) for n in names if n not in written and n != ".data/serialization_id"]
        fmt = _Format(alignment, trailing, sid[:20])
        for make in _PROBES:
            t = make()
            pieces, length = fmt.pieces(_records(t))
            if pieces is None:
                return None
            ours = b"".join(bytes(p) for p in pieces)
            if len(ours) != length or ours != _reference(t):
                return None
        return fmt
    except Exception:
        return None


def _format() -> _Format | None:
    settings = _settings()
    with _LOCK:
        if settings not in _FORMATS:
            _FORMATS[settings] = _learn(settings)
        return _FORMATS[settings]


def write(out, tensor: torch.Tensor) -> bool:
    """Write ``torch.save(tensor)``'s bytes to ``out`` (a file-like object with ``write``): the small records as
    bytes, the data as one view of the tensor's memory. ``tensor``: a contiguous CPU tensor that fills its storage
    exactly. False (nothing written) where this archive cannot be reproduced; then use ``torch.save``."""
    fmt = _format()
    if fmt is None or tensor.device.type != "cpu":
        return False
    try:
        records = _records(tensor)
    except ValueError:
        return False
    pieces, _ = fmt.pieces(records)
    if pieces is None:
        return False
    small = bytearray()
    for p in pieces:
        if isinstance(p, bytes):
            small += p
            continue
        if small:
            out.write(small)
            small = bytearray()
        out.write(p)
    if small:
        out.write(small)
    return True
