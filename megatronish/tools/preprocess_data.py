"""Tokenize JSON lines, text, Parquet or a datasets.save_to_disk directory into indexed datasets:
``{output_prefix}_{key}_{document|sentence}.bin/.idx``.

Same flags as Megatron-LM's tools/preprocess_data.py. Each input file is cut into chunks of about
``inputs.CHUNK_BYTES`` that end at line ends (found by seeking, without a pass over the file); ``--workers``
processes (fork) each read their chunk themselves, parse and tokenize it straight into arrays of the
output dtype, and the main process only appends the results, in input order, to the .bin/.idx
builders. Each chunk goes over a pipe to the worker with the fewest unread results, and its result comes back
over another, read in order (no pool threads competing with the main process for the GIL). When the main process
has a core of its own and feeds few workers (``--workers 1`` on two cores), it reads and parses the chunks itself
and the workers only encode. The output is therefore the same for every worker and partition count. ``--partitions N``
splits the input bytes into N contiguous ranges (at line starts) processed side by side, each with
``--workers / N`` workers, and merges them in order. Compressed (.gz, .zst) inputs cannot be seeked: the main
process reads their lines and hands the workers chunks of them, and partitions over them are line ranges; Arrow
rows (read a batch at a time, never a whole file) and whole text files go the same way. Parquet files are cut into
row ranges within row groups from their metadata, and each worker reads its own ranges' columns
(``megatronish/data/preprocess/formats.py``). Every format gives the bytes of JSON lines of the same documents.

A line that is not JSON, not an object, or lacks a ``--json-keys`` key stops the run with its file
and line number (``--skip-bad-lines`` skips such lines instead). The .idx is written last and
atomically: an interrupted run never leaves an .idx that looks valid.

The command line is here; the work is in ``megatronish/data/preprocess/`` (inputs and tasks, the encoder, the
worker processes, the run).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..data.preprocess.formats import TEXT_DOCUMENT_PER
from ..data.preprocess.inputs import PreprocessError
from ..data.preprocess.pipeline import run
from ..data.tokenizers import TOKENIZER_TYPES
from ..errors import EXIT_USER_ERROR, CommandLineParser, UserError


def get_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="a JSON-lines (.jsonl, .json), text (.txt) or Parquet (.parquet) file, the first two "
                            "optionally .gz or .zst; a datasets.save_to_disk directory; or a glob of them")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each line (Parquet/Arrow: columns; text: the output's name)")
    group.add_argument("--text-document-per", choices=TEXT_DOCUMENT_PER, default="line",
                       help=".txt inputs: each line is a document (empty lines skipped), or each file is one")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines when splitting sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip lines (rows, text files) that are not JSON objects with the keys, hold a value "
                            "that is not text, or are not UTF-8 (default: stop with an error)")
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
