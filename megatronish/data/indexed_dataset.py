"""Indexed dataset: Megatron-LM's ``.bin``/``.idx`` token files, read zero-copy and written in C++.

``.idx`` (little endian)::

    offset 0   9 bytes   b"MMIDIDX\\x00\\x00"
    offset 9   <Q        version = 1
    offset 17  <B        dtype code (uint8=1 int8=2 int16=3 int32=4 int64=5 float64=6 float32=7 uint16=8)
    offset 18  <Q        sequence count N
    offset 26  <Q        document count D (document indices, leading 0 included)
    offset 34  int32[N]  sequence lengths
               int64[N]  byte pointers into .bin
               int64[D]  document indices (sequence index where each document ends)

``.bin`` is the raw concatenation of the sequences in that dtype.
"""
from __future__ import annotations

import os
import struct
from typing import Optional, Sequence, Type, Union

import numpy

from megatronish.errors import IndexedDatasetError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_SIZE = 34

__all__ = [
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "get_bin_path",
    "get_idx_path",
]


class DType:
    """Dtype codes of the .idx header (Megatron-LM's table)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    _CODE_TO_DTYPE = {
        1: numpy.uint8,
        2: numpy.int8,
        3: numpy.int16,
        4: numpy.int32,
        5: numpy.int64,
        6: numpy.float64,
        7: numpy.float32,
        8: numpy.uint16,
    }

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        dt = numpy.dtype(dtype).type
        for code, value in cls._CODE_TO_DTYPE.items():
            if value == dt:
                return code
        raise ValueError(
            f"dtype {numpy.dtype(dtype)} cannot be stored in an indexed dataset; use one of "
            f"{', '.join(numpy.dtype(t).name for t in cls._CODE_TO_DTYPE.values())}"
        )

    @classmethod
    def dtype_from_code(cls, code: int) -> Type[numpy.number]:
        try:
            return cls._CODE_TO_DTYPE[code]
        except KeyError:
            raise ValueError(f"unknown dtype code {code} (known codes: 1..8)") from None

    @staticmethod
    def size(key) -> int:
        if isinstance(key, int) and not isinstance(key, bool):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 when the vocabulary is smaller than 65500 tokens, else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _IndexReader:
    """Parses and validates an .idx file; the arrays are views into one read-only memmap."""

    def __init__(self, idx_path: str, bin_size: Optional[int] = None) -> None:
        self.idx_path = idx_path
        try:
            file_size = os.path.getsize(idx_path)
        except OSError:
            raise IndexedDatasetError(
                f"index file '{idx_path}' does not exist; pass the path prefix without the "
                f".bin/.idx suffix, of a dataset written by tools/preprocess_data.py"
            ) from None
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER_SIZE)
        if len(head) < 9 or head[:9] != _INDEX_HEADER:
            raise IndexedDatasetError(
                f"'{idx_path}' is not an indexed dataset index: its first bytes {head[:9]!r} are not "
                f"{_INDEX_HEADER!r} (was it written by an old or foreign tool?)"
            )
        if len(head) < _HEADER_SIZE:
            raise IndexedDatasetError(
                f"'{idx_path}' is truncated: {file_size} bytes, shorter than the {_HEADER_SIZE}-byte header"
            )
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise IndexedDatasetError(
                f"'{idx_path}' has index version {version}; only version 1 is supported"
            )
        (code,) = struct.unpack("<B", head[17:18])
        if code not in DType._CODE_TO_DTYPE:
            raise IndexedDatasetError(f"'{idx_path}' has unknown dtype code {code} (known codes: 1..8)")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = numpy.dtype(self.dtype).itemsize
        (self.sequence_count,) = struct.unpack("<Q", head[18:26])
        (self.document_count,) = struct.unpack("<Q", head[26:34])
        n, d = self.sequence_count, self.document_count
        expected = _HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if file_size < expected:
            raise IndexedDatasetError(
                f"'{idx_path}' is truncated: its header announces {n} sequences and {d} document "
                f"indices ({expected} bytes) but the file has {file_size} bytes"
            )
        if file_size > expected:
            raise IndexedDatasetError(
                f"'{idx_path}' has {file_size - expected} trailing bytes after {n} sequences and {d} "
                f"document indices (multimodal indices are not supported)"
            )
        if d < 1:
            raise IndexedDatasetError(f"'{idx_path}' has no document indices (needs at least the leading 0)")
        self._mmap = numpy.memmap(idx_path, mode="r", order="C") if file_size > 0 else None
        buf = memoryview(self._mmap) if self._mmap is not None else b""
        off = _HEADER_SIZE
        self.sequence_lengths = numpy.frombuffer(buf, dtype=numpy.int32, count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = numpy.frombuffer(buf, dtype=numpy.int64, count=n, offset=off)
        off += 8 * n
        self.document_indices = numpy.frombuffer(buf, dtype=numpy.int64, count=d, offset=off)
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexedDatasetError(
                f"'{idx_path}' is inconsistent: document indices must run from 0 to the sequence "
                f"count {n}, got {int(self.document_indices[0])} .. {int(self.document_indices[-1])}"
            )
        self._check_arrays()
        if bin_size is not None:
            needed = 0
            if n:
                needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size
            if bin_size != needed:
                bin_path = idx_path[: -len(".idx")] + ".bin" if idx_path.endswith(".idx") else "the .bin file"
                raise IndexedDatasetError(
                    f"'{bin_path}' has {bin_size} bytes but '{idx_path}' describes {needed} bytes "
                    f"({n} sequences of {numpy.dtype(self.dtype).name}); the pair is truncated or mismatched"
                )

    def _check_arrays(self, chunk: int = 1 << 22) -> None:
        """Every sequence a non-negative length at the pointer right after its predecessor's bytes (the layout the
        writer produces), document indices non-decreasing: a damaged index never reads outside the .bin file."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n, size = len(lengths), self.dtype_size
        if n and pointers[0] != 0:
            raise IndexedDatasetError(f"'{self.idx_path}' is inconsistent: the first sequence starts at byte "
                                      f"{int(pointers[0])}, not 0")
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            ln = lengths[lo:hi]
            if (ln < 0).any():
                i = lo + int(numpy.argmax(ln < 0))
                raise IndexedDatasetError(f"'{self.idx_path}' is inconsistent: sequence {i} has length "
                                          f"{int(lengths[i])}")
            if hi - lo > 1:
                gap = pointers[lo + 1:hi] - pointers[lo:hi - 1] != ln[:-1].astype(numpy.int64) * size
                if gap.any():
                    i = lo + 1 + int(numpy.argmax(gap))
                    raise IndexedDatasetError(f"'{self.idx_path}' is inconsistent: sequence {i} starts at byte "
                                              f"{int(pointers[i])}, not right after sequence {i - 1}")
            if lo and pointers[lo] - pointers[lo - 1] != int(lengths[lo - 1]) * size:
                raise IndexedDatasetError(f"'{self.idx_path}' is inconsistent: sequence {lo} starts at byte "
                                          f"{int(pointers[lo])}, not right after sequence {lo - 1}")
        if len(docs) > 1 and (numpy.diff(docs) < 0).any():
            raise IndexedDatasetError(f"'{self.idx_path}' is inconsistent: document indices decrease")

    def __len__(self) -> int:
        return self.sequence_count


class IndexedDataset:
    """Read-only view of a ``{path_prefix}.bin``/``.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy array (a zero-copy view of the memory-mapped .bin);
    ``ds.get(i, offset, length)`` is a sub-span of it. Pickling reopens the files, so the dataset
    travels to DataLoader workers.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        if multimodal:
            raise IndexedDatasetError(
                f"multimodal indexed datasets are not supported ('{path_prefix}')"
            )
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        bin_path, idx_path = get_bin_path(path_prefix), get_idx_path(path_prefix)
        if not os.path.isfile(bin_path):
            hint = " (found the .idx: the run that wrote it was interrupted or the .bin was moved)" \
                if os.path.isfile(idx_path) else ""
            raise IndexedDatasetError(
                f"data file '{bin_path}' does not exist{hint}; --data-path takes path prefixes "
                f"without the .bin/.idx suffix"
            )
        bin_size = os.path.getsize(bin_path)
        self.index = _IndexReader(idx_path, bin_size)
        self._reader = None  # the C++ sample reader, made on the first gather
        self._bin_size = bin_size
        if bin_size > 0:
            self._bin_mmap = numpy.memmap(bin_path, mode="r", order="C")
            self._bin_buffer = memoryview(self._bin_mmap)
        else:
            self._bin_mmap = None
            self._bin_buffer = b""

    def __getstate__(self):
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, pointer: int, count: int) -> numpy.ndarray:
        return numpy.frombuffer(self._bin_buffer, dtype=self.index.dtype, count=count, offset=pointer)

    def __getitem__(self, idx: Union[int, numpy.integer, slice]) -> Union[numpy.ndarray, list]:
        if isinstance(idx, (int, numpy.integer)):
            n = len(self.index)
            i = int(idx)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"index {int(idx)} out of range for {n} sequences")
            return self._read(int(self.index.sequence_pointers[i]), int(self.index.sequence_lengths[i]))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                return []
            total = int(numpy.sum(lengths, dtype=numpy.int64))
            flat = self._read(int(self.index.sequence_pointers[start]), total)
            return numpy.split(flat, numpy.cumsum(lengths[:-1], dtype=numpy.int64))
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        index = self.index
        seq_len = int(index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"span [{offset}, {offset + length}) is outside sequence {idx} of length {seq_len}"
            )
        pointer = int(index.sequence_pointers[idx]) + int(offset) * index.dtype_size
        return numpy.frombuffer(self._bin_buffer, dtype=index.dtype, count=int(length), offset=pointer)

    def gather(self, documents: numpy.ndarray, bounds: numpy.ndarray, extra: int, pad: int,
               out: numpy.ndarray) -> numpy.ndarray:
        """Copies token spans into the rows of ``out`` (``[b, want]`` int64), one copy per sequence span.

        Row ``k`` of ``bounds`` (``[b, 4]`` int64) is ``(beg, off_beg, end, off_end)``: the row holds
        sequence ``documents[beg]`` from token ``off_beg``, the sequences ``documents[beg + 1 .. end - 1]``
        whole, and sequence ``documents[end]`` up to token ``off_end + extra`` (exclusive); a single
        sequence when ``beg == end``. Tokens past ``want`` are dropped, a shorter row is filled with ``pad``.
        Returns the number of real tokens of each row. Runs in C++ without the GIL.
        """
        if self._reader is None:
            from megatronish import _C

            index = self.index
            binary = self._bin_mmap if self._bin_mmap is not None else numpy.zeros(0, numpy.uint8)
            self._reader = _C.SampleReader(binary, DType.code_from_dtype(index.dtype), index.sequence_pointers,
                                           index.sequence_lengths)
        return self._reader.gather(documents, bounds, int(extra), int(pad), out)

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> numpy.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self):
        return None

    @property
    def dtype(self):
        return self.index.dtype

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` file as sequences arrive and its ``.idx`` on :meth:`finalize`.

    The byte writing, the index bookkeeping and the .bin copying of :meth:`add_index` happen in
    C++ (``megatronish._C.IndexedWriter``); the .idx is written to a temporary name and renamed, so
    an interrupted run leaves no .idx that looks valid.
    """

    def __init__(self, bin_path: str, dtype=numpy.int32, multimodal: bool = False) -> None:
        if multimodal:
            raise ValueError("multimodal indexed datasets are not supported")
        from megatronish import _C

        self.dtype = numpy.dtype(dtype).type
        self._code = DType.code_from_dtype(self.dtype)
        self.bin_path = bin_path
        self._writer = _C.IndexedWriter(bin_path, self._code)

    def _as_tokens(self, tokens) -> numpy.ndarray:
        if hasattr(tokens, "numpy") and not isinstance(tokens, numpy.ndarray):  # torch.Tensor
            tokens = tokens.detach().cpu().numpy()
        arr = numpy.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and numpy.issubdtype(arr.dtype, numpy.integer) and numpy.issubdtype(self.dtype, numpy.integer):
                info = numpy.iinfo(self.dtype)
                lo, hi = arr.min(), arr.max()
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"token id {int(hi) if hi > info.max else int(lo)} does not fit the dataset dtype "
                        f"{numpy.dtype(self.dtype).name} of '{self.bin_path}'; build it with a wider dtype "
                        f"(int32 for vocabularies of 65500 tokens or more)"
                    )
            arr = arr.astype(self.dtype)
        return numpy.ascontiguousarray(arr.reshape(-1))

    def add_item(self, tokens, mode: int = 0) -> None:
        """Appends one sequence."""
        self._writer.add_item(self._as_tokens(tokens))

    def end_document(self) -> None:
        """Marks the sequences added since the last call as one document."""
        self._writer.end_document()

    def add_document(self, tokens, lengths: Sequence[int], modes=None) -> None:
        """Appends a whole document: ``tokens`` split into sequences of ``lengths``, then ends it."""
        self._writer.add_items(self._as_tokens(tokens), numpy.asarray(lengths, dtype=numpy.int64))
        self._writer.end_document()

    def add_documents(self, tokens, lengths: Sequence[int], document_lengths: Sequence[int]) -> None:
        """Appends many documents: all sequences concatenated in ``tokens`` with their ``lengths``;
        ``document_lengths`` gives the number of sequences of each document."""
        self._writer.add_documents(
            self._as_tokens(tokens),
            numpy.asarray(lengths, dtype=numpy.int64),
            numpy.asarray(document_lengths, dtype=numpy.int64),
        )

    def add_index(self, path_prefix: str) -> None:
        """Appends the whole dataset at ``path_prefix`` (same dtype) after what was written so far."""
        index = _IndexReader(get_idx_path(path_prefix), os.path.getsize(get_bin_path(path_prefix))
                             if os.path.isfile(get_bin_path(path_prefix)) else None)
        if index.dtype != self.dtype:
            raise ValueError(
                f"cannot merge '{path_prefix}' ({numpy.dtype(index.dtype).name}) into '{self.bin_path}' "
                f"({numpy.dtype(self.dtype).name}); datasets must share a dtype"
            )
        if not os.path.isfile(get_bin_path(path_prefix)):
            raise IndexedDatasetError(f"data file '{get_bin_path(path_prefix)}' does not exist")
        self._writer.append_dataset(index.sequence_lengths, index.document_indices, get_bin_path(path_prefix))

    def finalize(self, idx_path: str) -> None:
        """Closes the .bin and writes the .idx (atomically, through a temporary file)."""
        self._writer.finalize(idx_path)

    @property
    def num_sequences(self) -> int:
        return self._writer.num_sequences

    @property
    def num_documents(self) -> int:
        return self._writer.num_documents
