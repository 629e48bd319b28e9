"""The ``--input`` formats of ``megatronish-preprocess-data`` besides plain JSON lines: compressed streams
(``.gz``, ``.zst``), plain text (``.txt``: a document per line or per file), Parquet files and the Arrow files of a
``datasets.save_to_disk`` directory. Parquet and Arrow are read with pyarrow, ``.zst`` with zstandard (both optional:
the ``data`` extra); each is read a piece at a time (record batches of about a task's size), never a whole file:
Arrow files by the main process, Parquet row ranges (planned from the file's metadata) by the worker they go to."""
from __future__ import annotations

import gzip
import io
import json
import os
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy

from ...errors import UserError

JSONL, TEXT, PARQUET, ARROW = "jsonl", "text", "parquet", "arrow"
TEXT_DOCUMENT_PER = ("line", "file")  # --text-document-per
EXTRA = "data"  # the pyproject extra that installs the optional readers


class PreprocessError(UserError):
    """An input problem reported to the user without a traceback."""


def compression(path: str) -> Optional[str]:
    """"gz", "zst" or None, from the file name."""
    if path.endswith(".gz"):
        return "gz"
    if path.endswith((".zst", ".zstd")):
        return "zst"
    return None


def input_format(path: str) -> str:
    """JSONL, TEXT, PARQUET or ARROW, from the file name (a compression suffix aside); anything else is JSON lines."""
    name = path[:path.rindex(".")] if compression(path) else path
    if name.endswith(".txt"):
        return TEXT
    if name.endswith((".parquet", ".pq")):
        return PARQUET
    if name.endswith(".arrow"):
        return ARROW
    return JSONL


def by_units(path: str, text_per: str) -> bool:
    """Whether the file is cut into units (lines, rows, or the whole file as one document) rather than byte ranges:
    compressed, Arrow, and text files with a document per file (the main process reads them and hands the workers
    their units), and Parquet (row ranges from its metadata, each read by the worker it goes to)."""
    fmt = input_format(path)
    return compression(path) is not None or fmt in (PARQUET, ARROW) or (fmt == TEXT and text_per == "file")


def unit_noun(path: str, text_per: str) -> str:
    """What a message about one input unit of ``path`` calls it: "line", "row" or "file"."""
    fmt = input_format(path)
    if fmt in (PARQUET, ARROW):
        return "row"
    return "file" if fmt == TEXT and text_per == "file" else "line"


def require(module: str, package: str, path: str):
    """``module`` imported, or one error line naming the package and the extra that installs it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise PreprocessError(f"reading --input file '{path}' needs the '{package}' package: pip install "
                          f"'megatronish[{EXTRA}]' (or pip install {package})") from None


def open_binary(path: str):
    """``path`` opened for reading bytes, decompressed as its name says (a stream: no seeking)."""
    kind = compression(path)
    if kind == "gz":
        return gzip.open(path, "rb")
    if kind == "zst":
        zstandard = require("zstandard", "zstandard", path)
        raw = open(path, "rb")
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        except BaseException:
            raw.close()
            raise
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb")


# ------------------------------------------------------------------------------- save_to_disk
def dataset_files(directory: str) -> List[str]:
    """The Arrow files of a ``datasets.save_to_disk`` directory, in order (``state.json``'s ``_data_files``)."""
    state = os.path.join(directory, "state.json")
    if not os.path.isfile(state):
        if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
            with open(os.path.join(directory, "dataset_dict.json"), encoding="utf-8") as f:
                splits = json.load(f).get("splits", [])
            raise PreprocessError(f"--input '{directory}' holds several splits ({', '.join(splits)}): give one split's "
                              f"directory, e.g. {os.path.join(directory, splits[0] if splits else 'train')}")
        raise PreprocessError(f"--input '{directory}' is a directory without state.json (not a datasets.save_to_disk "
                          "directory)")
    try:
        with open(state, encoding="utf-8") as f:
            names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PreprocessError(f"cannot read the data files of '{state}': {err}") from None
    files = [os.path.join(directory, n) for n in names]
    for path in files:
        if not os.path.isfile(path):
            raise PreprocessError(f"'{state}' lists '{path}', which does not exist")
    return files


# ------------------------------------------------------------------------------------ records
class Records(NamedTuple):
    """Rows of a Parquet or Arrow file: each ``--json-keys`` column's values (Python objects, as JSON would give
    them: str, list of str, None, numbers, ...) and the UTF-8 bytes of their text (for progress)."""

    columns: Dict[str, list]
    nbytes: int


def _arrow_batches(path: str) -> Iterator:
    """An Arrow file's record batches, read one at a time (not memory-mapped: the pages read do not stay resident):
    the streaming format ``datasets`` writes, or the file format."""
    pa = require("pyarrow", "pyarrow", path)
    source = pa.OSFile(path)
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _schema_names(path: str) -> List[str]:
    if input_format(path) == PARQUET:
        return require("pyarrow.parquet", "pyarrow", path).ParquetFile(path).schema_arrow.names
    pa = require("pyarrow", "pyarrow", path)
    source = pa.OSFile(path)
    try:
        return pa.ipc.open_stream(source).schema.names
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).schema.names


def check_inputs(files: Sequence[str], keys: Sequence[str]) -> None:
    """Every optional package the files need is installed, and every Parquet/Arrow file has the ``--json-keys``
    columns (else one error line naming the file and the column); text files take one key (the output's name)."""
    texts = [p for p in files if input_format(p) == TEXT]
    if texts and len(keys) != 1:
        raise PreprocessError(f"--input file '{texts[0]}' is text (one document per line or file): give one "
                              f"--json-keys, the output's name (got {' '.join(keys)})")
    for path in files:
        if compression(path) == "zst":
            require("zstandard", "zstandard", path)
        if input_format(path) not in (PARQUET, ARROW):
            continue
        require("pyarrow", "pyarrow", path)
        try:
            names = _schema_names(path)
        except Exception as err:  # pyarrow's errors for a file that is not what its name says
            raise PreprocessError(f"cannot read --input file '{path}': {err}") from None
        missing = [k for k in keys if k not in names]
        if missing:
            raise PreprocessError(f"--input file '{path}' has no column {missing[0]!r} (--json-keys {' '.join(keys)}; "
                              f"its columns: {', '.join(names)})")


def count_rows(path: str) -> int:
    if input_format(path) == PARQUET:
        return require("pyarrow.parquet", "pyarrow", path).ParquetFile(path).metadata.num_rows
    return sum(b.num_rows for b in _arrow_batches(path))


class RowRange(NamedTuple):
    """Rows [start, stop) (0-based, within the row group) of row group ``group`` of a Parquet file: a task that
    the worker reads itself (:class:`ParquetRows`); ``batch``: the rows of the group's ranges (the last may have
    fewer), the batch size its rows are decoded in."""

    group: int
    start: int
    stop: int
    batch: int


def parquet_ranges(path: str, start: int, stop: Optional[int], keys: Sequence[str],
                   chunk_bytes: int) -> Iterator[Tuple[int, RowRange]]:
    """(0-based index in the file of the first row, :class:`RowRange`) for rows [start, stop) of a Parquet file,
    planned from its metadata alone: each row group cut into ranges of about ``chunk_bytes`` of uncompressed
    ``keys`` column data (the row group's own sizes say how many rows that is; a range never crosses a row group)."""
    md = require("pyarrow.parquet", "pyarrow", path).ParquetFile(path).metadata
    first = 0  # rows of the file before the current row group
    for rg in range(md.num_row_groups):
        group = md.row_group(rg)
        lo, hi = max(start - first, 0), group.num_rows if stop is None else min(stop - first, group.num_rows)
        if lo < hi:
            size = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                       if group.column(c).path_in_schema.split(".")[0] in keys)
            rows = max(1, min(group.num_rows, chunk_bytes * group.num_rows // max(size, 1)))
            while lo < hi:  # ranges at multiples of ``rows`` in the group: one decoded batch each
                end = min((lo // rows + 1) * rows, hi)
                yield first + lo, RowRange(rg, lo, end, rows)
                lo = end
        first += group.num_rows
        if stop is not None and first >= stop:
            return


class ParquetRows:
    """Reads the row ranges of Parquet files that a process is handed, in bounded memory: the file stays open
    between ranges, and a range further on in the row group of the previous one continues that row group's batch
    iterator (the rows in between, another process's, are decoded and dropped, never turned into Python objects),
    so a process decodes each row group it reads from at most once when its ranges come in order. Only the
    ``keys`` columns are read, a range's worth of rows at a time, pages streamed through a 1 MiB buffer.

    ``on_read(path, group, start, stop)``, if given, is called for every batch decoded (rows [start, stop) of the
    row group): a test hook."""

    BUFFER_BYTES = 1 << 20

    def __init__(self, on_read: Optional[Callable[[str, int, int, int], None]] = None) -> None:
        self.on_read = on_read
        self.path: Optional[str] = None
        self.file = None
        self.group = -1
        self.batches: Optional[Iterator] = None
        self.batch = None  # the last batch decoded, not yet used up, and the row (in the group) it starts at
        self.at = 0

    def read(self, path: str, rows: RowRange, keys: Sequence[str]) -> Records:
        """The ``keys`` columns of rows ``rows`` of the Parquet file ``path``."""
        if path != self.path:
            self.file = require("pyarrow.parquet", "pyarrow", path).ParquetFile(
                path, buffer_size=self.BUFFER_BYTES)
            self.path, self.group = path, -1
        if rows.group != self.group or rows.start < self.at:
            self.batches = self.file.iter_batches(batch_size=rows.batch, row_groups=[rows.group],
                                                  columns=list(keys), use_threads=False)
            self.group, self.batch, self.at = rows.group, None, 0
        parts = []
        while True:
            if self.batch is None:
                self.batch = next(self.batches, None)
                if self.batch is None:
                    raise PreprocessError(f"--input file '{path}' changed while it was read")
                if self.on_read is not None:
                    self.on_read(path, rows.group, self.at, self.at + self.batch.num_rows)
            end = self.at + self.batch.num_rows
            lo, hi = max(rows.start, self.at), min(rows.stop, end)
            if lo < hi:
                parts.append(self.batch.slice(lo - self.at, hi - lo))
            if end <= rows.stop:
                self.batch, self.at = None, end  # used up
            if end >= rows.stop:
                return _records(parts, keys, sum(int(_row_bytes(p, keys).sum()) for p in parts))


def _row_bytes(batch, keys: Sequence[str]):
    """The UTF-8 bytes of each row's text in ``keys`` (strings, lists of strings; anything else counts 0)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = numpy.zeros(batch.num_rows, numpy.int64)
    for key in keys:
        col = batch.column(key)
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            total += pc.binary_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(numpy.int64)
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
                pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)):
            lengths = pc.binary_length(pc.list_flatten(col)).fill_null(0).to_numpy(zero_copy_only=False)
            parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
            total += numpy.bincount(parents, weights=lengths, minlength=batch.num_rows).astype(numpy.int64)
    return total


def record_chunks(path: str, start: int, stop: Optional[int], keys: Sequence[str],
                  chunk_bytes: int) -> Iterator[Tuple[int, Records]]:
    """(0-based index of the first row, :class:`Records`) for rows [start, stop) of an Arrow file, each about
    ``chunk_bytes`` of text (a row is never split; every row counts at least a byte)."""
    batches = (b.select(list(keys)) for b in _arrow_batches(path))
    parts: List = []
    nbytes = text = 0
    row = first = start
    offset = 0  # rows of the file before the current batch
    for batch in batches:
        lo, hi = max(start - offset, 0), batch.num_rows if stop is None else min(stop - offset, batch.num_rows)
        offset += batch.num_rows
        if hi <= lo:
            if stop is not None and offset >= stop:
                break
            continue
        batch = batch.slice(lo, hi - lo)
        sizes = _row_bytes(batch, keys)
        cum = numpy.cumsum(sizes + 1)
        done = 0
        while done < batch.num_rows:
            base = int(cum[done - 1]) if done else 0
            end = int(numpy.searchsorted(cum, base + chunk_bytes - nbytes)) + 1  # rows [done, end) fill the chunk
            end = min(end, batch.num_rows)
            parts.append(batch.slice(done, end - done))
            nbytes += int(cum[end - 1]) - base
            text += int(sizes[done:end].sum())
            row += end - done
            done = end
            if nbytes >= chunk_bytes:
                yield first, _records(parts, keys, text)
                parts, nbytes, text, first = [], 0, 0, row
        if stop is not None and offset >= stop:
            break
    if parts:
        yield first, _records(parts, keys, text)


def _records(parts: Sequence, keys: Sequence[str], nbytes: int) -> Records:
    columns: Dict[str, list] = {k: [] for k in keys}
    for part in parts:
        for key in keys:
            columns[key].extend(part.column(key).to_pylist())
    return Records(columns, nbytes)
