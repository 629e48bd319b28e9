"""Merge indexed datasets (``.bin/.idx`` pairs) into one, in order.

    megatronish-merge-datasets --input data/shards/ --output-prefix data/all_text_document
    python tools/merge_datasets.py ...                       # the same, under Megatron-LM's script name

``--input`` is a directory (every ``*.idx``/``*.bin`` pair in it, sorted by name, as in Megatron-LM)
or one or more path prefixes; ``--output-prefix`` names the merged dataset.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

from ..data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
)
from ..errors import EXIT_USER_ERROR, CommandLineParser


def find_prefixes(inputs: Sequence[str]) -> List[str]:
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        directory = inputs[0]
        prefixes = []
        for name in sorted(os.listdir(directory)):
            if name.endswith(".idx"):
                prefix = os.path.join(directory, name[: -len(".idx")])
                if not os.path.isfile(get_bin_path(prefix)):
                    raise IndexedDatasetError(f"'{get_idx_path(prefix)}' has no matching .bin file")
                prefixes.append(prefix)
        if not prefixes:
            raise IndexedDatasetError(f"--input directory '{directory}' holds no .idx/.bin pairs")
        return prefixes
    return list(inputs)


def merge(prefixes: Sequence[str], output_prefix: str) -> None:
    datasets = [IndexedDataset(p) for p in prefixes]  # validates every pair before writing
    dtypes = {d.index.dtype for d in datasets}
    if len(dtypes) != 1:
        raise IndexedDatasetError(
            "datasets to merge must share a dtype, got "
            + ", ".join(f"'{p}': {d.index.dtype.__name__}" for p, d in zip(prefixes, datasets))
        )
    out_idx = get_idx_path(output_prefix)
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise IndexedDatasetError(f"--output-prefix '{output_prefix}' is also an input")
    if os.path.exists(out_idx):
        os.remove(out_idx)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtypes.pop())
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(out_idx)
    except BaseException:
        if os.path.exists(get_bin_path(output_prefix)):
            os.remove(get_bin_path(output_prefix))
        raise


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = CommandLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="a directory of .bin/.idx pairs, or dataset path prefixes in order")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the merged dataset")
    args = parser.parse_args(argv)
    try:
        prefixes = find_prefixes(args.input)
        out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
        if not os.path.isdir(out_dir):
            raise IndexedDatasetError(f"--output-prefix directory '{out_dir}' does not exist")
        merge(prefixes, args.output_prefix)
    except (IndexedDatasetError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
