#!/usr/bin/env python
"""Data pipeline measurements, each next to its limit or peer in the same run; prints ratios.

1. preprocess throughput (tools/preprocess_data.py on the bundled corpus, JSON parsing and .bin/.idx
   writing included) vs the same tokenizer's raw batched encode of the same texts held in memory,
   with the same worker count (the limit), on the bundled corpus repeated 16 times;
2. random sample reads through GPTDataset (tokens, labels, masks) vs raw numpy.memmap slicing of
   seq_length + 1 tokens at random offsets (the limit);
3. sample-index build for 1e9 tokens: ours (C++) vs megatron-core's compiled helper (the peer).

    python benchmarks/bench_data.py [--workers 1 2] [--seq-length 2048]
"""
import argparse
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings

import numpy as np

from megatronish.data import build_gpt_datasets, helpers
from megatronish.data.tokenizers import build_tokenizer, gpt2_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tools/preprocess_data.py is a script of this checkout, not a module of the package: load it from its file.
_spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(REPO, "tools", "preprocess_data.py"))
preprocess_data = sys.modules["preprocess_data"] = importlib.util.module_from_spec(_spec)  # workers unpickle by name
_spec.loader.exec_module(preprocess_data)

CORPUS = os.path.join(REPO, "examples", "corpus", "python_docs.jsonl")
_TOK = None


def _encode_chunk(texts):
    return sum(len(x) for x in _TOK.tokenize_batch(texts))


def best_of(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_preprocess(workers_list, out_dir):
    global _TOK
    vocab, merges = gpt2_files()
    _TOK = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    # the bundled corpus repeated 16 times (~31 MB): the fixed start-up (tokenizer files parsed, ~0.2 s) then
    # weighs a few percent, still far more than on a real multi-GB corpus
    corpus = os.path.join(out_dir, "corpus.jsonl")
    with open(CORPUS, encoding="utf-8") as f:
        lines = f.readlines()
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(lines * 16)
    texts = [json.loads(line)["text"] for line in lines * 16]
    chunks = [texts[i:i + preprocess_data._CHUNK_LINES] for i in range(0, len(texts), preprocess_data._CHUNK_LINES)]
    nbytes = os.path.getsize(corpus)
    results = []
    for w in workers_list:
        if w == 1:
            limit = best_of(lambda: [_encode_chunk(c) for c in chunks])
        else:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(w) as pool:
                pool.map(_encode_chunk, chunks[:w])  # warm
                limit = best_of(lambda: pool.map(_encode_chunk, chunks, 1))
        argv = ["--input", corpus, "--output-prefix", os.path.join(out_dir, f"bench{w}"), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                "--workers", str(w), "--log-interval", "100000000"]
        ours = best_of(lambda: preprocess_data.main(argv))
        results.append((w, nbytes / ours / 1e6, nbytes / limit / 1e6, limit / ours))
        print(f"preprocess  workers={w}: tool {nbytes / ours / 1e6:6.2f} MB/s, raw batched encode "
              f"{nbytes / limit / 1e6:6.2f} MB/s  ->  ratio {limit / ours:.2f}")
    return os.path.join(out_dir, "bench1_text_document"), results


def bench_reads(prefix, seq_length, out_dir, n_reads=20000):
    n_samples = 4000
    train = build_gpt_datasets([prefix], "1", seq_length, 1234, (n_samples, None, None),
                               cache_dir=os.path.join(out_dir, "cache"), eod_id=50256)[0]
    import torch

    raw = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(train), n_reads)
    offs = rng.integers(0, raw.shape[0] - seq_length - 1, n_reads)

    def via_dataset():
        for i in idx:
            train[int(i)]

    def via_memmap():
        for o in offs:
            text = torch.from_numpy(raw[o:o + seq_length + 1].astype(np.int64))
            text[:-1], text[1:]

    via_dataset()  # warm page cache and mask cache
    t_ds = best_of(via_dataset)
    t_raw = best_of(via_memmap)
    print(f"sample reads seq={seq_length}: dataset {n_reads / t_ds:9.0f} samples/s, raw memmap "
          f"{n_reads / t_raw:9.0f} samples/s  ->  ratio {t_raw / t_ds:.2f}")
    return t_raw / t_ds


def bench_sample_index(seq_length, total_tokens=10**9):
    rng = np.random.default_rng(0)
    num_docs = total_tokens // 1000
    sizes = rng.integers(1, 2000, num_docs).astype(np.int32)
    sizes[-1] += total_tokens - int(sizes.sum())
    doc_idx = np.arange(num_docs, dtype=np.int32)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    ours = best_of(lambda: helpers.build_sample_idx(sizes, doc_idx, seq_length, 1, tokens), repeat=2)
    line = f"sample index, {tokens / 1e9:.1f}e9 tokens, seq={seq_length}: ours {ours:.3f} s"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers_cpp as mh
        peer = best_of(lambda: mh.build_sample_idx_int32(sizes, doc_idx, seq_length, 1, tokens, True, 1), repeat=2)
        line += f", megatron-core {peer:.3f} s  ->  ratio {peer / ours:.2f}"
    except ImportError:
        peer = None
        line += " (megatron-core not installed: no peer)"
    print(line)
    return ours, peer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-length", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        prefix, _ = bench_preprocess(args.workers, out_dir)
        if not os.path.exists(prefix + ".idx"):
            prefix = os.path.join(out_dir, f"bench{args.workers[0]}_text_document")
        bench_reads(prefix, args.seq_length, out_dir)
        bench_reads(prefix, 256, out_dir)
    bench_sample_index(args.seq_length)


if __name__ == "__main__":
    main()
