"""The input side of ``megatronish-preprocess-data``: the ``--input`` files (JSON lines or text, plain or
compressed; Parquet; the Arrow files of a ``datasets.save_to_disk`` directory: :mod:`.formats`), the byte (or unit)
ranges of each partition, and the tasks (chunks of whole lines, or of rows) handed to the workers."""
from __future__ import annotations

import glob
import os
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from .formats import (
    ARROW,
    PARQUET,
    TEXT,
    PreprocessError,
    Records,
    RowRange,
    by_units,
    count_rows,
    dataset_files,
    input_format,
    open_binary,
    parquet_ranges,
    record_chunks,
)

CHUNK_BYTES = 1 << 18  # input bytes per worker task (a chunk always ends at a line end)
_READ_BYTES = 1 << 22  # read size when counting newlines


# ------------------------------------------------------------------------------------- input
def expand_inputs(pattern: str) -> List[str]:
    """The files of ``--input``: a file, a ``datasets.save_to_disk`` directory (its Arrow files), or a glob of
    them (sorted)."""
    matches = [pattern] if os.path.exists(pattern) else sorted(glob.glob(pattern))
    files: List[str] = []
    for path in matches:
        if os.path.isdir(path):
            if len(matches) == 1 or os.path.isfile(os.path.join(path, "state.json")):
                files.extend(dataset_files(path))
        elif os.path.isfile(path):
            files.append(path)
    if not files:
        raise PreprocessError(f"--input '{pattern}' matches no file (give a .jsonl, .txt or .parquet path, "
                              "optionally .gz/.zst, a datasets.save_to_disk directory, or a glob)")
    return files


def _open(path: str):
    return open_binary(path)


def read_error(path: str, err: BaseException) -> PreprocessError:
    return PreprocessError(f"cannot read --input file '{path}': {err}")


def iter_lines(files: Sequence[str], start: int = 0, stop: Optional[int] = None) -> Iterator[Tuple[str, int, bytes]]:
    """(file, 1-based line number, raw line) for global line numbers [start, stop)."""
    n = 0
    for path in files:
        try:
            with _open(path) as f:
                for lineno, line in enumerate(f, 1):
                    if stop is not None and n >= stop:
                        return
                    if n >= start:
                        yield path, lineno, line
                    n += 1
        except (OSError, EOFError) as err:
            raise read_error(path, err) from None


def count_lines(files: Sequence[str]) -> int:
    total = 0
    for path in files:
        try:
            with _open(path) as f:
                for _ in f:
                    total += 1
        except (OSError, EOFError) as err:
            raise read_error(path, err) from None
    return total


def count_units(path: str, text_per: str = "line") -> int:
    """The units a partition boundary may fall between: rows (Parquet, Arrow), 1 (a text file that is one
    document), lines (anything else)."""
    fmt = input_format(path)
    if fmt == TEXT and text_per == "file":
        return 1
    if fmt in (PARQUET, ARROW):
        return count_rows(path)
    return count_lines([path])


def newlines_before(path: str, offset: int) -> int:
    """Number of b'\n' in the first ``offset`` bytes of a plain file."""
    n = 0
    with open(path, "rb") as f:
        while offset > 0:
            data = f.read(min(_READ_BYTES, offset))
            if not data:
                break
            n += data.count(b"\n")
            offset -= len(data)
    return n


def _line_start_at_or_after(f, pos: int, size: int) -> int:
    """The first line start >= ``pos`` in the open plain file ``f`` (``size`` at the end)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    f.readline()
    return min(f.tell(), size)


class Segment(NamedTuple):
    """A contiguous piece of one input file: bytes [start, stop) of a plain file (``lines`` False), or units
    (:func:`count_units`: lines, rows, or the one document of a text file) [start, stop) (0-based, ``stop`` None
    = to the end) of any file."""

    path: str
    start: int
    stop: Optional[int]
    lines: bool


def plan_segments(files: Sequence[str], partitions: int, text_per: str = "line") -> List[List[Segment]]:
    """The input cut into ``partitions`` contiguous parts, in order, each a list of segments. Plain JSON-lines and
    text files are cut by bytes at line starts (a seek and one line read per cut); when a file is read by units
    (:func:`formats.by_units`: compressed, Parquet, Arrow, a document per text file), the cuts are unit ranges over
    all files (one counting pass for compressed files, which cannot be seeked; Parquet's metadata)."""
    if partitions == 1:
        return [[Segment(p, 0, None, True) if by_units(p, text_per) else Segment(p, 0, os.path.getsize(p), False)
                 for p in files]]
    if any(by_units(p, text_per) for p in files):
        counts = [count_units(path, text_per) for path in files]
        bounds = [sum(counts) * i // partitions for i in range(partitions + 1)]
        parts: List[List[Segment]] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            segs, first = [], 0
            for path, n in zip(files, counts):
                lo, hi = max(a, first), min(b, first + n)
                if lo < hi:
                    segs.append(Segment(path, lo - first, hi - first, True))
                first += n
            parts.append(segs)
        return parts
    sizes = [os.path.getsize(p) for p in files]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    total = offsets[-1]
    cuts = [0]
    for i in range(1, partitions):
        g = max(total * i // partitions, cuts[-1])
        k = max(j for j in range(len(files)) if offsets[j] <= g) if g < total else len(files) - 1
        with open(files[k], "rb") as f:
            cuts.append(offsets[k] + _line_start_at_or_after(f, g - offsets[k], sizes[k]))
    cuts.append(total)
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        segs = []
        for path, lo_f, size in zip(files, offsets, sizes):
            lo, hi = max(a, lo_f), min(b, lo_f + size)
            if lo < hi:
                segs.append(Segment(path, lo - lo_f, hi - lo_f, False))
        parts.append(segs)
    return parts


class Task(NamedTuple):
    """One worker's input: bytes [start, stop) of the plain file ``path`` (``data`` None: the worker reads
    them), or ``data``: whole lines of ``path`` whose first is line ``start`` (1-based), the rows [start, stop)
    (1-based, in the file) of a Parquet file that the worker reads (:class:`formats.RowRange`: where they are in
    their row group) or of an Arrow file (:class:`formats.Records`: read by the main process), or the whole text of
    a text file that is one document (``start`` 1)."""

    path: str
    start: int
    stop: int
    data: Optional[Union[bytes, Records, RowRange]]


def iter_tasks(segments: Sequence[Segment], keys: Sequence[str] = ("text",), text_per: str = "line") -> Iterator[Task]:
    """The segments cut into tasks of about ``CHUNK_BYTES`` that end at line ends (or row ends), in order; a text
    file that is one document is one task. ``keys``: the columns read from Parquet and Arrow files."""
    for seg in segments:
        if seg.lines:
            fmt = input_format(seg.path)
            if fmt == TEXT and text_per == "file":
                yield _whole_file_task(seg.path)
            elif fmt == PARQUET:
                for first, rows in parquet_ranges(seg.path, seg.start, seg.stop, keys, CHUNK_BYTES):
                    yield Task(seg.path, first + 1, first + 1 + rows.stop - rows.start, rows)
            elif fmt == ARROW:
                for first, records in record_chunks(seg.path, seg.start, seg.stop, keys, CHUNK_BYTES):
                    yield Task(seg.path, first + 1, first + 1 + len(records.columns[keys[0]]), records)
            else:
                yield from _line_tasks(seg)
            continue
        try:
            with open(seg.path, "rb") as f:
                pos = seg.start
                while pos < seg.stop:
                    nxt = seg.stop
                    if pos + CHUNK_BYTES < seg.stop:
                        nxt = _line_start_at_or_after(f, pos + CHUNK_BYTES, seg.stop)
                    yield Task(seg.path, pos, nxt, None)
                    pos = nxt
        except OSError as err:
            raise read_error(seg.path, err) from None


def _line_tasks(seg: Segment) -> Iterator[Task]:
    lines: List[bytes] = []
    nbytes = 0
    first = seg.start + 1
    for _, lineno, line in iter_lines([seg.path], seg.start, seg.stop):
        if not lines:
            first = lineno
        lines.append(line)
        nbytes += len(line)
        if nbytes >= CHUNK_BYTES:
            yield Task(seg.path, first, first + len(lines), b"".join(lines))
            lines, nbytes = [], 0
    if lines:
        yield Task(seg.path, first, first + len(lines), b"".join(lines))


def _whole_file_task(path: str) -> Task:
    try:
        with _open(path) as f:
            return Task(path, 1, 2, f.read())
    except (OSError, EOFError) as err:
        raise read_error(path, err) from None


def segment_bytes(segments: Sequence[Segment]) -> Optional[int]:
    """Bytes the progress bar counts to (None with a file read by units: the size of its text is unknown)."""
    if any(seg.lines for seg in segments):
        return None
    return sum(seg.stop - seg.start for seg in segments)
