#!/usr/bin/env python
"""Tokenize JSON-lines text into indexed datasets: ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.

Same flags as Megatron-LM's tools/preprocess_data.py. Lines are read in order and tokenized in
batches by ``--workers`` processes (fork); results are written in input order, so the output is the
same for every worker and partition count. ``--partitions N`` splits the input into N contiguous
line ranges processed side by side and merged in order.

A line that is not JSON, not an object, or lacks a ``--json-keys`` key stops the run with its file
and line number (``--skip-bad-lines`` skips such lines instead). The .idx is written last and
atomically: an interrupted run never leaves an .idx that looks valid.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from megatronish.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatronish.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatronish.errors import EXIT_USER_ERROR, TokenizerError, UserError

_CHUNK_LINES = 256


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


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


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
            raise PreprocessError(f"cannot read --input file '{path}': {err}") from None


def count_lines(files: Sequence[str]) -> int:
    total = 0
    for path in files:
        with _open(path) as f:
            for _ in f:
                total += 1
    return total


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
    """Turns a chunk of raw lines into token arrays per key (runs in the worker processes)."""

    tokenizer = None

    def __init__(self, args) -> None:
        self.args = args

    def initializer(self) -> None:
        # forked workers inherit the tokenizer built by the parent; build it only where missing
        if Encoder.tokenizer is None or getattr(Encoder, "_built_for", None) is not self.args:
            Encoder.tokenizer = make_tokenizer(self.args)
            Encoder._built_for = self.args
        Encoder.dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)

    def encode_chunk(self, chunk: List[Tuple[str, int, bytes]]):
        args = self.args
        tok = Encoder.tokenizer
        nbytes = sum(len(line) for _, _, line in chunk)
        bad: List[str] = []
        docs: List[Dict[str, List[str]]] = []
        for path, lineno, line in chunk:
            if not line.strip():
                bad.append(f"{path}:{lineno}: empty line (expected a JSON object)")
                continue
            try:
                data = json.loads(line)
            except (ValueError, UnicodeDecodeError) as err:
                bad.append(f"{path}:{lineno}: invalid JSON ({err})")
                continue
            if not isinstance(data, dict):
                bad.append(f"{path}:{lineno}: expected a JSON object, got {type(data).__name__}")
                continue
            missing = [k for k in args.json_keys if k not in data]
            if missing:
                bad.append(f"{path}:{lineno}: missing key(s) {missing} (--json-keys {' '.join(args.json_keys)})")
                continue
            doc: Dict[str, List[str]] = {}
            for key in args.json_keys:
                value = data[key]
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    sentences = value
                elif isinstance(value, str):
                    sentences = split_sentences(value, args.keep_newlines) if args.split_sentences else [value]
                else:
                    bad.append(f"{path}:{lineno}: key '{key}' holds {type(value).__name__}, expected text")
                    break
                doc[key] = sentences
            else:
                docs.append(doc)
        if bad and not args.skip_bad_lines:
            return {"error": bad[0], "bytes": nbytes}
        out = {"bytes": nbytes, "docs": len(docs), "skipped": bad, "keys": {}}
        for key in args.json_keys:
            sentences = [s for doc in docs for s in doc[key]]
            per_doc = [len(doc[key]) for doc in docs]
            ids = tok.tokenize_batch(sentences) if sentences else []
            tokens: List[List[int]] = []
            lengths: List[int] = []
            doc_counts: List[int] = []
            k = 0
            for n in per_doc:
                count = 0
                for s_ids in ids[k:k + n]:
                    if len(s_ids) > 0:
                        tokens.append(s_ids)
                        lengths.append(len(s_ids))
                        count += 1
                k += n
                if count and args.append_eod:
                    tokens[-1] = list(tokens[-1]) + [tok.eod]
                    lengths[-1] += 1
                doc_counts.append(count)
            flat = numpy.fromiter(itertools.chain.from_iterable(tokens), dtype=numpy.int64, count=sum(lengths))
            out["keys"][key] = (flat.astype(Encoder.dtype), numpy.asarray(lengths, numpy.int64),
                                numpy.asarray(doc_counts, numpy.int64))
        return out


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


def _chunks(lines: Iterator[Tuple[str, int, bytes]], size: int):
    chunk = []
    for item in lines:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Progress:
    """A tqdm bar over the input bytes (done, rate, ETA) on a terminal; without one, a log line every
    ``interval`` documents. The summary line (documents, docs/s, tokens/s, MB/s) is printed at the end."""

    def __init__(self, interval: int, label: str = "", total_bytes: Optional[int] = None) -> None:
        self.interval = max(1, interval)
        self.label = label
        self.start = time.time()
        self.docs = self.tokens = self.bytes = 0
        self.next_report = self.interval
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                            desc=label.strip() or "preprocess", dynamic_ncols=True)

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


def _input_bytes(files: Sequence[str]) -> Optional[int]:
    """Bytes the progress bar counts to (None when a file is compressed: its text size is unknown)."""
    if any(f.endswith(".gz") for f in files):
        return None
    return sum(os.path.getsize(f) for f in files)


def process_range(args, files: Sequence[str], prefix: str, workers: int, start: int = 0,
                  stop: Optional[int] = None, label: str = "") -> int:
    """Tokenize lines [start, stop) of ``files`` into ``{prefix}_{key}_{level}``; returns docs written."""
    encoder = Encoder(args)
    encoder.initializer()
    level = "sentence" if args.split_sentences else "document"
    builders: Dict[str, IndexedDatasetBuilder] = {}
    out_prefixes = {k: output_prefix_for(prefix, k, level) for k in args.json_keys}
    for key, p in out_prefixes.items():
        if os.path.exists(get_idx_path(p)):
            os.remove(get_idx_path(p))  # a stale .idx must never pair with the new .bin
        builders[key] = IndexedDatasetBuilder(get_bin_path(p), dtype=Encoder.dtype)
    total = _input_bytes(files) if start == 0 and stop is None else None
    progress = _Progress(args.log_interval, label, total)
    pool = None
    try:
        chunks = _chunks(iter_lines(files, start, stop), _CHUNK_LINES)
        if workers > 1:
            ctx = multiprocessing.get_context("fork")
            pool = ctx.Pool(workers)
            results = pool.imap(encoder.encode_chunk, chunks, 1)
        else:
            results = map(encoder.encode_chunk, chunks)
        skipped = 0
        for res in results:
            if "error" in res:
                raise PreprocessError(res["error"] + "; fix the line or pass --skip-bad-lines")
            for msg in res["skipped"]:
                print(f"warning: skipped {msg}", file=sys.stderr)
            skipped += len(res["skipped"])
            ntok = 0
            for key, (tokens, lengths, doc_counts) in res["keys"].items():
                builders[key].add_documents(tokens, lengths, doc_counts)
                ntok += tokens.shape[0]
            progress.update(res["docs"], ntok, res["bytes"])
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
            pool.terminate()
            pool.join()


def _partition_main(args, files, prefix, workers, start, stop, index, errors) -> None:
    try:
        process_range(args, files, prefix, workers, start, stop, label=f"[partition {index}] ")
    except PreprocessError as err:
        errors.put(str(err))
        os._exit(1)
    except KeyboardInterrupt:
        os._exit(130)
    except Exception as err:  # surfaced by the parent
        errors.put(f"{type(err).__name__}: {err}")
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
    if args.partitions == 1:
        process_range(args, files, args.output_prefix, args.workers)
        return
    total = count_lines(files)
    bounds = [total * i // args.partitions for i in range(args.partitions + 1)]
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = []
    part_prefixes = [f"{args.output_prefix}_{i}" for i in range(args.partitions)]
    for i in range(args.partitions):
        p = ctx.Process(target=_partition_main, args=(args, files, part_prefixes[i], args.workers // args.partitions,
                                                      bounds[i], bounds[i + 1], i, errors))
        p.start()
        procs.append(p)
    level = "sentence" if args.split_sentences else "document"
    try:
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            msg = errors.get(timeout=5) if not errors.empty() else "a partition failed"
            raise PreprocessError(msg)
        tmp = Encoder(args)
        tmp.initializer()
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
