"""One preprocessing run: the workers' results appended in input order to the ``.bin/.idx`` builders, progress,
line numbers for messages, and ``--partitions`` processed side by side and merged."""
from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from ...errors import TokenizerError
from ..indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from .encoder import Encoder
from .formats import check_inputs, unit_noun
from .inputs import (
    PreprocessError,
    Segment,
    Task,
    expand_inputs,
    iter_tasks,
    newlines_before,
    plan_segments,
    segment_bytes,
)
from .workers import Workers


def output_prefix_for(prefix: str, key: str, level: str) -> str:
    return f"{prefix}_{key}_{level}"


class Progress:
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


class LineNumbers:
    """The 1-based line number of each task's first line. Results arrive in input order, so a task that starts
    where the previous one ended continues its count; a byte range elsewhere (a partition's first) counts the
    newlines before it, only when a message needs a line number."""

    def __init__(self) -> None:
        self.at: Optional[Tuple[str, int, int]] = None  # (path, byte offset, line number there)

    def first_line(self, task: Task) -> int:
        if task.data is not None:
            return task.start
        if self.at is None or self.at[:2] != (task.path, task.start):
            self.at = (task.path, task.start, 1 + newlines_before(task.path, task.start))
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
                     position: Optional[int] = None, on_read: Optional[Callable] = None) -> int:
    """Tokenize ``segments`` into ``{prefix}_{key}_{level}`` with ``workers`` worker processes while this process
    appends their results in order; returns the documents written. ``on_read``: :class:`Encoder`'s test hook."""
    encoder = Encoder(args, on_read)
    encoder.initializer()
    level = "sentence" if args.split_sentences else "document"
    builders: Dict[str, IndexedDatasetBuilder] = {}
    out_prefixes = {k: output_prefix_for(prefix, k, level) for k in args.json_keys}
    for key, p in out_prefixes.items():
        if os.path.exists(get_idx_path(p)):
            os.remove(get_idx_path(p))  # a stale .idx must never pair with the new .bin
        builders[key] = IndexedDatasetBuilder(get_bin_path(p), dtype=Encoder.dtype)
    progress = Progress(args.log_interval, label, segment_bytes(segments), position)  # a bar per partition
    numbers = LineNumbers()
    skipped = 0
    pool = None

    def take(task: Task, res: dict) -> None:
        nonlocal skipped
        noun = unit_noun(task.path, args.text_document_per)

        def where(i: int) -> str:  # FILE:LINE, FILE:ROW (1-based), or FILE for a text file that is one document
            return task.path if noun == "file" else f"{task.path}:{numbers.first_line(task) + i}"

        if "error" in res:
            i, msg = res["error"]
            raise PreprocessError(f"{where(i)}: {msg}; fix the {noun} or pass --skip-bad-lines")
        for i, msg in res["skipped"]:
            print(f"warning: skipped {where(i)}: {msg}", file=sys.stderr)
        skipped += len(res["skipped"])
        numbers.advance(task, res["lines"])
        ntok = 0
        for key, (tokens, lengths, doc_counts) in res["keys"].items():
            builders[key].add_documents(tokens, lengths, doc_counts)
            ntok += tokens.shape[0]
        progress.update(res["docs"], ntok, res["bytes"])

    finished = False
    try:
        pool = Workers(encoder, workers)
        pending: collections.deque = collections.deque()
        window = 3 * workers  # tasks in flight: each worker has the next ones at hand while it encodes one
        parse_here = _main_parses(workers, args.partitions)
        for i, task in enumerate(iter_tasks(segments, args.json_keys, args.text_document_per)):
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


def _partition_main(args, segments, prefix, workers, index, errors, on_read) -> None:
    try:
        process_segments(args, segments, prefix, workers, label=f"[partition {index}] ", position=index,
                         on_read=on_read)
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


def run(args, on_read: Optional[Callable[[str, int, int, int], None]] = None) -> None:
    """The tool's run after its flags are checked. ``on_read(path, row_group, start, stop)`` is called in the
    process that decodes each batch of Parquet rows (a test hook: who reads what)."""
    files = expand_inputs(args.input)
    check_inputs(files, args.json_keys)
    try:
        Encoder(args).initializer()  # fail fast, before any worker starts; workers inherit it
    except TokenizerError as err:
        raise PreprocessError(str(err)) from None
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix directory '{out_dir}' does not exist")
    parts = plan_segments(files, args.partitions, args.text_document_per)
    if args.partitions == 1:
        process_segments(args, parts[0], args.output_prefix, args.workers, on_read=on_read)
        return
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = []
    part_prefixes = [f"{args.output_prefix}_{i}" for i in range(args.partitions)]
    for i in range(args.partitions):
        p = ctx.Process(target=_partition_main, args=(args, parts[i], part_prefixes[i],
                                                      args.workers // args.partitions, i, errors, on_read))
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
