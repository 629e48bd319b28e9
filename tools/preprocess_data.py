#!/usr/bin/env python
"""Tokenize JSON-lines text into indexed datasets: ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.

Same flags as Megatron-LM's tools/preprocess_data.py. Each input file is cut into chunks of about
``CHUNK_BYTES`` that end at line ends (found by seeking, without a pass over the file); ``--workers``
processes (fork) each read their chunk themselves, parse and tokenize it straight into arrays of the
output dtype, and the main process only appends the results, in input order, to the .bin/.idx
builders. Each chunk goes over a pipe to the worker with the fewest unread results, and its result comes back
over another, read in order (no pool threads competing with the main process for the GIL). When the main process
has a core of its own and feeds few workers (``--workers 1`` on two cores), it reads and parses the chunks itself
and the workers only encode. The output is therefore the same for every worker and partition count. ``--partitions N``
splits the input bytes into N contiguous ranges (at line starts) processed side by side, each with
``--workers / N`` workers, and merges them in order. Compressed (.gz) inputs cannot be seeked: the main
process reads their lines and hands the workers chunks of them, and partitions over them are line ranges.

A line that is not JSON, not an object, or lacks a ``--json-keys`` key stops the run with its file
and line number (``--skip-bad-lines`` skips such lines instead). The .idx is written last and
atomically: an interrupted run never leaves an .idx that looks valid.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import sys
import threading
import time
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy

try:  # several times faster than json at parsing the lines; optional (see Encoder._parse)
    from orjson import loads as _FAST_LOADS
except ImportError:
    _FAST_LOADS = None

from megatronish.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatronish.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatronish.errors import EXIT_USER_ERROR, CommandLineParser, TokenizerError, UserError

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


def _read_error(path: str, err: BaseException) -> PreprocessError:
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
            raise _read_error(path, err) from None


def count_lines(files: Sequence[str]) -> int:
    total = 0
    for path in files:
        with _open(path) as f:
            for _ in f:
                total += 1
    return total


def _newlines_before(path: str, offset: int) -> int:
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
            raise _read_error(seg.path, err) from None


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


def _segment_bytes(segments: Sequence[Segment]) -> Optional[int]:
    """Bytes the progress bar counts to (None with a compressed file: its text size is unknown)."""
    if any(seg.lines for seg in segments):
        return None
    return sum(seg.stop - seg.start for seg in segments)


# ------------------------------------------------------------------------------- sentences
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str, keep_newlines: bool) -> List[str]:
    """Sentences of ``text`` whose concatenation is ``text`` (whitespace stays with the sentence
    before it). Breaks after . ! ? followed by space and a capital/digit, and at blank lines."""
    pieces: List[str] = []
    for para in re.split(r"(?<=\n\n)", text):
        start = 0
        for m in _SENTENCE_END.finditer(para):
            pieces.append(para[start:m.end()])
            start = m.end()
        if start < len(para):
            pieces.append(para[start:])
    if not keep_newlines:
        pieces = [p.replace("\n", " ") for p in pieces]
    return [p for p in pieces if p]


# --------------------------------------------------------------------------------- encoding
class Encoder:
    """Turns a task (a chunk of whole lines) into token arrays per key (runs in the worker processes)."""

    tokenizer = None

    def __init__(self, args) -> None:
        self.args = args

    def initializer(self) -> None:
        # forked workers inherit the tokenizer built by the parent; build it only where missing
        if Encoder.tokenizer is None or getattr(Encoder, "_built_for", None) is not self.args:
            Encoder.tokenizer = make_tokenizer(self.args)
            Encoder._built_for = self.args
        Encoder.dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)

    @staticmethod
    def read(task: Task) -> bytes:
        if task.data is not None:
            return task.data
        try:
            with open(task.path, "rb") as f:
                f.seek(task.start)
                data = f.read(task.stop - task.start)
        except OSError as err:
            raise _read_error(task.path, err) from None
        if len(data) != task.stop - task.start:
            raise PreprocessError(f"--input file '{task.path}' changed while it was read")
        return data

    def encode_task(self, task: Task) -> dict:
        """{"lines", "bytes", "docs", "skipped": [(line index in the task, message)], "keys": {key: (tokens,
        sequence lengths, sequences per document)}} or, for a bad line without --skip-bad-lines,
        {"lines", "bytes", "error": (line index, message)}."""
        return self.tokenize_task(*self.parse_columns(task))

    def parse_columns(self, task: Task) -> Tuple[dict, Dict[str, List[List[str]]]]:
        """:meth:`parse_task` with the documents as one column per key: {key: [each document's sentences]}."""
        out, docs = self.parse_task(task)
        return out, {key: [doc[key] for doc in docs] for key in self.args.json_keys}

    def tokenize_task(self, out: dict, columns: Dict[str, List[List[str]]]) -> dict:
        """The second half of :meth:`encode_task`: the parsed documents' token arrays added to ``out``."""
        if "error" not in out:
            out["keys"] = {key: self._tokenize(columns[key]) for key in self.args.json_keys}
        return out

    def parse_task(self, task: Task) -> Tuple[dict, List[Dict[str, List[str]]]]:
        """The first half of :meth:`encode_task`: its dict without "keys", and the parsed documents."""
        args = self.args
        data = self.read(task)
        lines = data.split(b"\n")  # each line parsed from its bytes: no decode of the whole task to str first
        if not lines[-1]:
            lines.pop()  # the text after the last newline (empty unless the file ends without one)
        bad: List[Tuple[int, str]] = []
        docs: List[Dict[str, List[str]]] = []
        for i, line in enumerate(lines):
            msg = self._parse(line, docs)
            if msg is None:
                continue
            if msg.startswith("invalid JSON"):  # the message as for the line's bytes with their newline (positions)
                raw = line if isinstance(line, bytes) else line.encode("utf-8")
                msg = self._parse(raw + b"\n" if i < len(lines) - 1 or data.endswith(b"\n") else raw, [])
            if not args.skip_bad_lines:
                return {"lines": len(lines), "bytes": len(data), "error": (i, msg)}, []
            bad.append((i, msg))
        return {"lines": len(lines), "bytes": len(data), "docs": len(docs), "skipped": bad}, docs

    def _parse(self, line: Union[str, bytes], docs: List[Dict[str, List[str]]]) -> Optional[str]:
        """Appends the line's document to ``docs``; returns what is wrong with the line instead, if anything.

        Lines are parsed by ``orjson`` where it is installed; a line it refuses (it is stricter: NaN, lone
        surrogates, a BOM) or whose document is not what we need is parsed again by ``json``, so what is accepted,
        what is stored and every message are ``json``'s."""
        if _FAST_LOADS is not None:
            try:
                data = _FAST_LOADS(line)
            except Exception:
                data = None
            if isinstance(data, dict) and self._add(data, docs) is None:
                return None
        if not (line.strip(" \t\n\r\x0b\x0c") if isinstance(line, str) else line.strip()):  # ASCII space only
            return "empty line (expected a JSON object)"
        if isinstance(line, str) and (line[:1] == "\ufeff" or "\x00" in line[:4]):
            line = line.encode("utf-8")  # json's own encoding detection (a BOM, UTF-16/32) works on the bytes
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deeply
            return f"invalid JSON ({err})"
        return self._add(data, docs)

    def _add(self, data, docs: List[Dict[str, List[str]]]) -> Optional[str]:
        """Appends the parsed line's document to ``docs``, or returns what is wrong with it."""
        args = self.args
        if not isinstance(data, dict):
            return f"expected a JSON object, got {type(data).__name__}"
        missing = [k for k in args.json_keys if k not in data]
        if missing:
            return f"missing key(s) {missing} (--json-keys {' '.join(args.json_keys)})"
        doc: Dict[str, List[str]] = {}
        for key in args.json_keys:
            value = data[key]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                doc[key] = value
            elif isinstance(value, str):
                doc[key] = split_sentences(value, args.keep_newlines) if args.split_sentences else [value]
            else:
                return f"key '{key}' holds {type(value).__name__}, expected text"
        docs.append(doc)
        return None

    def _tokenize(self, doc_sentences: List[List[str]]):
        """(tokens in the output dtype, sequence lengths, sequences per document) for the documents' sentences:
        empty sentences dropped, eod appended to each non-empty document with --append-eod."""
        per_doc = numpy.fromiter(map(len, doc_sentences), dtype=numpy.int64, count=len(doc_sentences))
        sentences = [s for doc in doc_sentences for s in doc]
        if sentences:
            flat, lengths = Encoder.tokenizer.tokenize_batch_flat(sentences)
        else:
            flat, lengths = numpy.zeros(0, numpy.int64), numpy.zeros(0, numpy.int64)
        kept = lengths > 0
        doc_of = numpy.repeat(numpy.arange(len(doc_sentences)), per_doc)
        doc_counts = numpy.bincount(doc_of[kept], minlength=len(doc_sentences)).astype(numpy.int64)
        lengths = lengths[kept]
        if self.args.append_eod and lengths.size:
            last = numpy.cumsum(doc_counts)[doc_counts > 0] - 1  # each document's last sequence
            flat = numpy.insert(flat, numpy.cumsum(lengths)[last], Encoder.tokenizer.eod)
            lengths[last] += 1
        return flat.astype(Encoder.dtype), lengths, doc_counts


def _worker_main(encoder: Encoder, tasks_in, results_out) -> None:
    """A forked worker: tokenizes each task it receives — a :class:`Task` it reads and parses itself, or one the
    main process parsed, ``(out, columns)`` — and sends the result back in the order the tasks came; an exception
    goes back in place of its task's result. A second thread only receives (so the main process can always hand
    over the next task, even while this one waits to send a result); parsing stays on this thread: tiktoken
    releases the GIL for each text it encodes, and a parsing thread would make every encode wait to get it back."""
    received: queue.Queue = queue.Queue()

    def receive() -> None:
        while True:
            try:
                item = tasks_in.recv()
            except (EOFError, OSError):  # the main process is gone
                item = None
            received.put(item)
            if item is None:
                return

    threading.Thread(target=receive, name="preprocess-receive", daemon=True).start()
    while True:
        item = received.get()
        if item is None:
            return
        try:
            result = encoder.tokenize_task(*(encoder.parse_columns(item) if isinstance(item, Task) else item))
        except BaseException as err:  # handed to the main process in place of the task's result
            result = err
        results_out.send(result)


PIPE_BYTES = 1 << 20  # the pipes' kernel buffer where Linux allows it (its default, 64 KiB, is a quarter of a task)


def _pipe_bytes() -> Optional[int]:
    """:data:`PIPE_BYTES`, or the system's maximum if that is less; None where pipes cannot be resized (not Linux)."""
    try:
        import fcntl
    except ImportError:
        return None
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return None
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            return min(PIPE_BYTES, int(f.read()))
    except (OSError, ValueError):
        return None


def _widen(conn, size: Optional[int]) -> None:
    """Give the pipe under ``conn`` a kernel buffer of ``size`` bytes (:func:`_pipe_bytes`; None, or a refusal,
    leaves it as it is). A worker's result (a chunk's token array) then fits in the pipe whole: the worker sends it
    and goes on encoding while the main process is still parsing the next chunk, instead of waiting in its send
    until the main process reads."""
    if size is not None:
        import fcntl

        try:
            fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
        except OSError:
            pass


class _Workers:
    """``n`` forked worker processes, each with a task pipe and a result pipe; task ``i`` goes to the worker with
    the fewest tasks whose results are still unread (ties: in turn, from worker ``i % n``), and its result is read
    back from that worker in task order (no pool threads in this process). A worker on a slower core (another
    process on it, a busy host) is then handed fewer tasks instead of holding the others up by a fixed share."""

    def __init__(self, encoder: Encoder, n: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.procs, self.tasks, self.results = [], [], []
        pipe_bytes = _pipe_bytes()
        for _ in range(n):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            _widen(task_w, pipe_bytes)
            _widen(res_w, pipe_bytes)
            proc = ctx.Process(target=_worker_main, args=(encoder, task_r, res_w), daemon=True)
            proc.start()
            task_r.close()
            res_w.close()
            self.procs.append(proc)
            self.tasks.append(task_w)
            self.results.append(res_r)
        self.ready: List[collections.deque] = [collections.deque() for _ in range(n)]  # results read, in order
        self.dead: set = set()
        self.unread = [0] * n  # per worker: tasks sent whose results have not been read yet
        self.worker_of: Dict[int, int] = {}  # task -> the worker it went to, until its result is taken

    def send(self, i: int, item) -> None:
        """Task ``i``: a :class:`Task`, or what :meth:`Encoder.parse_columns` made of it. The results that have
        arrived are read first, so the counts are those of now."""
        n = len(self.procs)
        if n > 1:
            self._read_arrived(timeout=0)
        live = [k for k in range(n) if k not in self.dead] or [0]  # none left: the send below reports it
        w = min(live, key=lambda k: (self.unread[k], (k - i) % n))
        self.worker_of[i] = w
        self.unread[w] += 1
        try:
            self.tasks[w].send(item)
        except OSError:  # the worker is gone (its end of the pipe is closed)
            self.procs[w].join(1)
            raise self._died(w) from None

    def receive(self, i: int) -> dict:
        """Task ``i``'s result. While it waits, every other worker's finished results are read too (and kept for
        their turn): a worker that is ahead never stops in its send for want of a reader."""
        w = self.worker_of.pop(i)
        while not self.ready[w]:
            self._read_arrived(timeout=None)
        res = self.ready[w].popleft()
        if isinstance(res, BaseException):
            raise res
        return res

    def _read_arrived(self, timeout: Optional[float]) -> None:
        """Read every result that has arrived, kept for its turn, waiting up to ``timeout`` seconds for one (None:
        until one arrives). A worker that died leaves its error in its place."""
        waiting = [conn for k, conn in enumerate(self.results) if k not in self.dead]
        for conn in multiprocessing.connection.wait(waiting, timeout):
            k = self.results.index(conn)
            try:
                self.ready[k].append(conn.recv())
                self.unread[k] -= 1
            except EOFError:
                self.dead.add(k)
                self.procs[k].join(1)
                self.ready[k].append(self._died(k))

    def _died(self, k: int) -> PreprocessError:
        return PreprocessError(f"a tokenizer worker process died (exit code {self.procs[k].exitcode}); nothing was "
                               "written")

    def close(self, finished: bool) -> None:
        """``finished``: every result was read, the workers wait for their next task and exit on None; else
        they are stopped (they may be blocked sending results nobody reads)."""
        for conn in self.tasks:
            if finished:
                conn.send(None)
            conn.close()
        for proc in self.procs:
            if not finished:
                proc.terminate()
            proc.join()
        for conn in self.results:
            conn.close()


def make_tokenizer(args):
    return build_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        vocab_extra_ids=args.vocab_extra_ids,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
    )


def output_prefix_for(prefix: str, key: str, level: str) -> str:
    return f"{prefix}_{key}_{level}"


class _Progress:
    """A tqdm bar over the input bytes (done, rate, ETA) on a terminal; without one, a log line every
    ``interval`` documents. The summary line (documents, docs/s, tokens/s, MB/s) is printed at the end."""

    def __init__(self, interval: int, label: str = "", total_bytes: Optional[int] = None,
                 position: Optional[int] = None) -> None:
        self.interval = max(1, interval)
        self.label = label
        self.start = time.time()
        self.docs = self.tokens = self.bytes = 0
        self.next_report = self.interval
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                            desc=label.strip() or "preprocess", dynamic_ncols=True, position=position)

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(docs=self.docs, refresh=False)
        elif self.docs >= self.next_report:
            self.next_report = (self.docs // self.interval + 1) * self.interval
            self.report()

    def report(self, final: bool = False) -> None:
        if final and self.bar is not None:
            self.bar.close()
        dt = max(time.time() - self.start, 1e-9)
        print(f"{self.label}processed {self.docs} documents ({self.docs / dt:.1f} docs/s, "
              f"{self.tokens / dt:.0f} tokens/s, {self.bytes / dt / 1024 / 1024:.2f} MB/s)", file=sys.stderr,
              flush=True)


class _LineNumbers:
    """The 1-based line number of each task's first line. Results arrive in input order, so a task that starts
    where the previous one ended continues its count; a byte range elsewhere (a partition's first) counts the
    newlines before it, only when a message needs a line number."""

    def __init__(self) -> None:
        self.at: Optional[Tuple[str, int, int]] = None  # (path, byte offset, line number there)

    def first_line(self, task: Task) -> int:
        if task.data is not None:
            return task.start
        if self.at is None or self.at[:2] != (task.path, task.start):
            self.at = (task.path, task.start, 1 + _newlines_before(task.path, task.start))
        return self.at[2]

    def advance(self, task: Task, lines: int) -> None:
        if task.data is None:
            if task.start == 0:
                self.at = (task.path, 0, 1)
            if self.at is not None and self.at[:2] == (task.path, task.start):
                self.at = (task.path, task.stop, self.at[2] + lines)


MAIN_PARSES_UP_TO = 4  # workers the main process parses for (bench_data's stages: JSON ~1/20 of the encode time)


def _main_parses(workers: int, partitions: int = 1) -> bool:
    """Whether this process reads and parses the tasks itself and hands the workers only the texts to encode:
    when it has a core of its own (every partition's main process and workers together fit the cores; it would
    otherwise only wait and write) and feeds few enough workers to keep up with them. The output is the same
    either way."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return partitions * (workers + 1) <= cpus and workers <= MAIN_PARSES_UP_TO


def process_segments(args, segments: Sequence[Segment], prefix: str, workers: int, label: str = "",
                     position: Optional[int] = None) -> int:
    """Tokenize ``segments`` into ``{prefix}_{key}_{level}`` with ``workers`` worker processes while this process
    appends their results in order; returns the documents written."""
    encoder = Encoder(args)
    encoder.initializer()
    level = "sentence" if args.split_sentences else "document"
    builders: Dict[str, IndexedDatasetBuilder] = {}
    out_prefixes = {k: output_prefix_for(prefix, k, level) for k in args.json_keys}
    for key, p in out_prefixes.items():
        if os.path.exists(get_idx_path(p)):
            os.remove(get_idx_path(p))  # a stale .idx must never pair with the new .bin
        builders[key] = IndexedDatasetBuilder(get_bin_path(p), dtype=Encoder.dtype)
    progress = _Progress(args.log_interval, label, _segment_bytes(segments), position)  # a bar per partition
    numbers = _LineNumbers()
    skipped = 0
    pool = None

    def take(task: Task, res: dict) -> None:
        nonlocal skipped
        if "error" in res:
            i, msg = res["error"]
            raise PreprocessError(f"{task.path}:{numbers.first_line(task) + i}: {msg}; fix the line or pass "
                                  "--skip-bad-lines")
        for i, msg in res["skipped"]:
            print(f"warning: skipped {task.path}:{numbers.first_line(task) + i}: {msg}", file=sys.stderr)
        skipped += len(res["skipped"])
        numbers.advance(task, res["lines"])
        ntok = 0
        for key, (tokens, lengths, doc_counts) in res["keys"].items():
            builders[key].add_documents(tokens, lengths, doc_counts)
            ntok += tokens.shape[0]
        progress.update(res["docs"], ntok, res["bytes"])

    finished = False
    try:
        pool = _Workers(encoder, workers)
        pending: collections.deque = collections.deque()
        window = 3 * workers  # tasks in flight: each worker has the next ones at hand while it encodes one
        parse_here = _main_parses(workers, args.partitions)
        for i, task in enumerate(iter_tasks(segments)):
            pool.send(i, encoder.parse_columns(task) if parse_here else task)
            pending.append((i, task))
            if len(pending) >= window:
                j, done = pending.popleft()
                take(done, pool.receive(j))
        while pending:
            j, done = pending.popleft()
            take(done, pool.receive(j))
        finished = True
        for key, p in out_prefixes.items():
            builders[key].finalize(get_idx_path(p))
        progress.report(final=True)
        if skipped:
            print(f"warning: skipped {skipped} bad line(s)", file=sys.stderr)
        return progress.docs
    except BaseException:
        for p in out_prefixes.values():  # leave nothing that looks like a dataset
            for path in (get_bin_path(p), get_idx_path(p)):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.close(finished)


def _partition_main(args, segments, prefix, workers, index, errors) -> None:
    try:
        process_segments(args, segments, prefix, workers, label=f"[partition {index}] ", position=index)
        return
    except KeyboardInterrupt:
        os._exit(130)
    except PreprocessError as err:
        msg = str(err)
    except Exception as err:  # surfaced by the parent
        msg = f"{type(err).__name__}: {err}"
    errors.put((index, msg))
    errors.close()
    errors.join_thread()  # the message is in the pipe before the process ends
    os._exit(1)


def run(args) -> None:
    files = expand_inputs(args.input)
    try:
        Encoder(args).initializer()  # fail fast, before any worker starts; workers inherit it
    except TokenizerError as err:
        raise PreprocessError(str(err)) from None
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix directory '{out_dir}' does not exist")
    parts = plan_segments(files, args.partitions)
    if args.partitions == 1:
        process_segments(args, parts[0], args.output_prefix, args.workers)
        return
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = []
    part_prefixes = [f"{args.output_prefix}_{i}" for i in range(args.partitions)]
    for i in range(args.partitions):
        p = ctx.Process(target=_partition_main, args=(args, parts[i], part_prefixes[i],
                                                      args.workers // args.partitions, i, errors))
        p.start()
        procs.append(p)
    level = "sentence" if args.split_sentences else "document"
    try:
        for p in procs:
            p.join()
        failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            reported = {}
            for _ in failed:
                try:
                    index, msg = errors.get(timeout=5)
                except queue.Empty:
                    break
                reported[index] = msg
            # the earliest partition's problem: the first bad line of the input, as without partitions
            raise PreprocessError(reported[min(reported)] if reported else f"partition {failed[0]} failed")
        for key in args.json_keys:
            final = output_prefix_for(args.output_prefix, key, level)
            if os.path.exists(get_idx_path(final)):
                os.remove(get_idx_path(final))
            builder = IndexedDatasetBuilder(get_bin_path(final), dtype=Encoder.dtype)
            for pp in part_prefixes:
                builder.add_index(output_prefix_for(pp, key, level))
            builder.finalize(get_idx_path(final))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for pp in part_prefixes:
            for key in args.json_keys:
                part = output_prefix_for(pp, key, level)
                for path in (get_bin_path(part), get_idx_path(part)):
                    if os.path.exists(path):
                        os.remove(path)


def get_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True, help="JSON-lines file (.gz allowed) or glob")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines when splitting sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip lines that are not JSON objects with the keys (default: stop with an error)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", type=str, default=None)
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument("--tiktoken-pattern", type=str, default="v2")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--append-eod", action="store_true", help="append the eod token to each document")
    group.add_argument("--lang", type=str, default="english", help="accepted for compatibility")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1, help="input partitions processed side by side")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress reports")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted for compatibility: partitions are always contiguous, in order")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        if args.workers < 1:
            raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
        if args.partitions < 1:
            raise PreprocessError(f"--partitions must be >= 1, got {args.partitions}")
        if args.workers % args.partitions != 0:
            raise PreprocessError(f"--workers {args.workers} must be a multiple of --partitions {args.partitions}")
        if args.log_interval < 1:
            raise PreprocessError("--log-interval must be >= 1")
        run(args)
    except UserError as err:  # an input or tokenizer problem: one line, exit 2 like a flag error
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted: no index was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
