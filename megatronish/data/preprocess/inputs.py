"""The input side of ``megatronish-preprocess-data``: the ``--input`` files (plain or ``.gz``), their lines,
the byte (or line) ranges of each partition, and the tasks (chunks of whole lines) handed to the workers."""
from __future__ import annotations

import glob
import gzip
import os
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ...errors import UserError

CHUNK_BYTES = 1 << 18  # input bytes per worker task (a chunk always ends at a line end)
_READ_BYTES = 1 << 22  # read size when counting newlines


class PreprocessError(UserError):
    """An input problem reported to the user without a traceback."""


# ------------------------------------------------------------------------------------- input
def expand_inputs(pattern: str) -> List[str]:
    if os.path.isfile(pattern):
        return [pattern]
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise PreprocessError(f"--input '{pattern}' matches no file (give a .jsonl/.json(.gz) path or a glob)")
    return files


def _compressed(path: str) -> bool:
    return path.endswith(".gz")


def _open(path: str):
    if _compressed(path):
        return gzip.open(path, "rb")
    return open(path, "rb")


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
        with _open(path) as f:
            for _ in f:
                total += 1
    return total


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
    """A contiguous piece of one input file: bytes [start, stop) of a plain file (``lines`` False), or lines
    [start, stop) (0-based, ``stop`` None = to the end) of any file."""

    path: str
    start: int
    stop: Optional[int]
    lines: bool


def plan_segments(files: Sequence[str], partitions: int) -> List[List[Segment]]:
    """The input cut into ``partitions`` contiguous parts, in order, each a list of segments. Plain files are cut
    by bytes at line starts (a seek and one line read per cut); when a file is compressed, the cuts are line
    ranges over all files (one counting pass, as compressed files cannot be seeked)."""
    if partitions == 1:
        return [[Segment(p, 0, None, True) if _compressed(p) else Segment(p, 0, os.path.getsize(p), False)
                 for p in files]]
    if any(_compressed(p) for p in files):
        counts = [count_lines([path]) for path in files]
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
    them), or ``data``, whole lines of ``path`` whose first is line ``start`` (1-based)."""

    path: str
    start: int
    stop: int
    data: Optional[bytes]


def iter_tasks(segments: Sequence[Segment]) -> Iterator[Task]:
    """The segments cut into tasks of about ``CHUNK_BYTES`` that end at line ends, in order."""
    for seg in segments:
        if seg.lines:
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


def segment_bytes(segments: Sequence[Segment]) -> Optional[int]:
    """Bytes the progress bar counts to (None with a compressed file: its text size is unknown)."""
    if any(seg.lines for seg in segments):
        return None
    return sum(seg.stop - seg.start for seg in segments)
