#!/usr/bin/env python
"""Data pipeline measurements, each next to its limit or peer in the same run; prints ratios.

1. preprocess throughput (tools/preprocess_data.py on the bundled corpus repeated ``--corpus-repeat`` times (64:
   124 MB), JSON parsing and .bin/.idx writing included) vs the same tokenizer's fastest batched encode
   (tokenize_batch_flat) of the same texts already parsed and held by the same number of forked workers (the
   limit); limit and tool runs alternate, best of --repeat each (with the best tool run's CPU time: its main
   process and its workers); the same documents from a Parquet file (row groups of 1024 rows) in the same
   alternation, with the throughput ratio parquet / jsonl (and the best runs' CPU time); then the 2-worker tool
   against the 1-worker limit, and one worker's stages;
   ``--only preprocess-memory``: peak memory (RSS) of the tool over a Parquet file of ``--parquet-mb`` MB of text
   (the corpus repeated with a different prefix per copy, row groups of 256 rows) next to the same over a
   16 MB one: bounded memory does not grow with the file;
2. random sample reads through GPTDataset.get_batch (tokens, labels, masks; batches of 32) vs raw numpy.memmap
   reads of the same bytes into the same batch array: per-sample slices at random offsets, and one contiguous
   slice (the memory-bandwidth bound); also the per-sample dataset[i] path;
3. sample-index build for 1e9 tokens: ours (C++) vs megatron-core's compiled helper (the peer).

    python benchmarks/bench_data.py [--workers 1 2] [--seq-length 2048] [--only preprocess] [--repeat 3]
        [--corpus-repeat 64]
    python benchmarks/bench_data.py --only preprocess-memory [--parquet-mb 1024] [--workers 2]
"""
import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

from megatronish.data import build_gpt_datasets, helpers
from megatronish.data.preprocess import inputs
from megatronish.data.preprocess.encoder import Encoder, make_tokenizer
from megatronish.data.tokenizers import build_tokenizer, gpt2_files
from megatronish.tools import preprocess_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CORPUS = os.path.join(REPO, "examples", "corpus", "python_docs.jsonl")
_TOK = None


_CHUNKS = None


def _encode_chunk(i):
    return _TOK.tokenize_batch_flat(_CHUNKS[i])[0].shape[0]


def _children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def best_of(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_preprocess(workers_list, out_dir, repeat=3, corpus_repeat=64):
    global _TOK, _CHUNKS
    vocab, merges = gpt2_files()
    _TOK = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    # the bundled corpus repeated 64 times by default (~125 MB): the fixed start-up (tokenizer files parsed, ~0.2 s)
    # then weighs ~2% of a run (more than on a real multi-GB corpus; the stages line reports it on its own)
    corpus = os.path.join(out_dir, "corpus.jsonl")
    with open(CORPUS, encoding="utf-8") as f:
        lines = f.readlines()
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(lines * corpus_repeat)
    # the limit: the same texts, already parsed and held by the (forked) workers, in chunks of the tool's
    # CHUNK_BYTES of input lines, through the tokenizer's fastest batched encode; nothing read, parsed or written
    _CHUNKS, chunk, size = [], [], 0
    for line in lines * corpus_repeat:
        chunk.append(json.loads(line)["text"])
        size += len(line.encode("utf-8"))
        if size >= inputs.CHUNK_BYTES:
            _CHUNKS.append(chunk)
            chunk, size = [], 0
    _CHUNKS.append(chunk)
    nbytes = os.path.getsize(corpus)
    parquet = write_parquet(os.path.join(out_dir, "corpus.parquet"), [json.loads(x)["text"] for x in lines],
                            corpus_repeat, row_group_size=1024)
    results = {}
    for w in workers_list:
        argv = ["--input", corpus, "--output-prefix", os.path.join(out_dir, f"bench{w}"), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                "--workers", str(w), "--log-interval", "100000000"]
        argv_parquet = [parquet, os.path.join(out_dir, f"bench{w}_parquet")] + argv[4:]
        argv_parquet = ["--input", argv_parquet[0], "--output-prefix", argv_parquet[1]] + argv_parquet[2:]
        t_parquet = float("inf")
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(w) as pool:
            pool.map(_encode_chunk, range(w))  # warm
            # the limit and the tool alternate, best of each: a machine shared with other work slows both alike
            limit = ours = float("inf")
            cpu = None
            for _ in range(repeat):
                if w == 1:
                    limit = min(limit, best_of(lambda: [_encode_chunk(i) for i in range(len(_CHUNKS))], 1))
                else:
                    limit = min(limit, best_of(lambda: pool.map(_encode_chunk, range(len(_CHUNKS)), 1), 1))
                # the tool runs in this process: its main process's CPU is this process's, its workers' CPU is
                # that of the children that end during the call
                main0, kids0 = time.process_time(), _children_cpu()
                t = best_of(lambda: preprocess_data.main(argv), 1)
                if t < ours:
                    ours, cpu = t, (time.process_time() - main0, _children_cpu() - kids0)
                if parquet:
                    main0, kids0 = time.process_time(), _children_cpu()
                    t = best_of(lambda: preprocess_data.main(argv_parquet), 1)
                    if t < t_parquet:
                        t_parquet, cpu_parquet = t, (time.process_time() - main0, _children_cpu() - kids0)
        results[w] = (nbytes / ours / 1e6, nbytes / limit / 1e6)
        print(f"preprocess  workers={w}: tool {nbytes / ours / 1e6:6.2f} MB/s, raw batched encode "
              f"{nbytes / limit / 1e6:6.2f} MB/s  ->  ratio {limit / ours:.2f}  (tool CPU: main process "
              f"{cpu[0]:.2f} s, workers {cpu[1]:.2f} s; wall {ours:.2f} s, raw {limit:.2f} s)", flush=True)
        if parquet:
            same = [open(os.path.join(out_dir, f"bench{w}{s}_text_document.bin"), "rb").read()
                    for s in ("", "_parquet")]
            same = same[0] == same[1]
            print(f"preprocess  workers={w}: parquet input {nbytes / t_parquet / 1e6:6.2f} MB/s, jsonl input "
                  f"{nbytes / ours / 1e6:6.2f} MB/s (same documents; MB of the JSON lines)  ->  ratio parquet/jsonl "
                  f"{ours / t_parquet:.2f}  (wall {t_parquet:.2f} s vs {ours:.2f} s; CPU: main process "
                  f"{cpu_parquet[0]:.2f} vs {cpu[0]:.2f} s, workers {cpu_parquet[1]:.2f} vs {cpu[1]:.2f} s; same .bin: "
                  f"{same})", flush=True)
    preprocess_breakdown(corpus, vocab, merges)
    if 1 in results:
        for w in sorted(results):
            if w > 1:
                print(f"preprocess  workers={w} vs 1: tool{w}/raw1 {results[w][0] / results[1][1]:.2f}, "
                      f"tool{w}/tool1 {results[w][0] / results[1][0]:.2f}, tool{w}/raw{w} "
                      f"{results[w][0] / results[w][1]:.2f}  (load average {os.getloadavg()[0]:.2f})")
    return os.path.join(out_dir, "bench1_text_document"), results


def write_parquet(path, texts, repeat, row_group_size, vary=False):
    """``texts`` repeated ``repeat`` times into a Parquet file (one ``text`` column), written a copy at a time;
    ``vary``: each copy's documents start with the copy's number (no two documents alike). None without pyarrow."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("pyarrow not installed: no Parquet input case (pip install 'megatronish[data]')")
        return None
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for r in range(repeat):
            batch = [f"[{r}] {t}" for t in texts] if vary else texts
            writer.write_table(pa.table({"text": batch}, schema=schema), row_group_size=row_group_size)
    return path


def _tree_rss(pid):
    """Resident bytes of ``pid`` and its descendants (from /proc; 0 for a process that is gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration, ValueError):
            pass
    return total


def _peak_memory(argv):
    """(seconds, peak summed RSS of the tool's processes sampled every 20 ms, peak RSS of its largest process)
    of the tool run as a child process."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *argv],
                            stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"preprocess_data exited with {proc.returncode}")
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest process that ended
    return time.perf_counter() - t, peak, largest


def bench_parquet_memory(out_dir, parquet_mb=1024, workers=2):
    """Peak memory of the tool over a Parquet file of ``parquet_mb`` MB of text and over a 16 MB one."""
    with open(CORPUS, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    per_copy = sum(len(t.encode("utf-8")) for t in texts)
    vocab, merges = gpt2_files()
    rows = []
    for mb in (16, parquet_mb):
        path = os.path.join(out_dir, f"big{mb}.parquet")
        copies = max(1, round(mb * 1e6 / per_copy))
        t = time.perf_counter()
        if write_parquet(path, texts, copies, row_group_size=256, vary=True) is None:
            return None
        made = time.perf_counter() - t
        argv = ["--input", path, "--output-prefix", os.path.join(out_dir, f"big{mb}"), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers",
                str(workers), "--log-interval", "100000000"]
        secs, peak, largest = _peak_memory(argv)
        text_mb, file_mb = copies * per_copy / 1e6, os.path.getsize(path) / 1e6
        rows.append((text_mb, peak))
        print(f"preprocess memory  Parquet {file_mb:.0f} MB file ({text_mb:.0f} MB of text, {copies * len(texts)} "
              f"rows, row groups of 256; written in {made:.0f} s), workers={workers}: {secs:.1f} s "
              f"({text_mb / secs:.1f} MB/s); peak RSS of all its processes {peak / 1e6:.0f} MB (sum, shared pages "
              f"counted in each), of its largest process {largest / 1e6:.0f} MB  ->  peak / file "
              f"{peak / 1e6 / file_mb:.3f}, peak / text {peak / 1e6 / text_mb:.3f}", flush=True)
        for ext in (".bin", ".idx"):
            os.remove(os.path.join(out_dir, f"big{mb}_text_document{ext}"))
        os.remove(path)
    print(f"preprocess memory  peak RSS at {rows[1][0]:.0f} MB of text / at {rows[0][0]:.0f} MB: "
          f"{rows[1][1] / rows[0][1]:.2f}")
    return rows


def preprocess_breakdown(corpus, vocab, merges, repeat=3):
    """One worker's stages over the whole corpus, in this process, best of ``repeat`` each: where the time of a
    1-worker run goes next to the pure encode."""
    argv = ["--input", corpus, "--output-prefix", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            vocab, "--merge-file", merges, "--append-eod", "--workers", "1"]
    args = preprocess_data.get_parser().parse_args(argv)
    encoder = Encoder(args)
    encoder.initializer()
    tasks = list(inputs.iter_tasks(inputs.plan_segments([corpus], 1)[0]))
    datas = [encoder.read(t) for t in tasks]
    docs = []
    for data in datas:
        part = []
        for line in data.split(b"\n")[:-1]:
            encoder._parse(line, part)
        docs.append([d["text"] for d in part])
    tok = Encoder.tokenizer
    t = {
        "tokenizer build": best_of(lambda: make_tokenizer(args), repeat),
        "read + split lines": best_of(lambda: [encoder.read(x).split(b"\n") for x in tasks], repeat),
        "JSON + checks": best_of(lambda: [encoder._parse(line, []) for d in datas for line in d.split(b"\n")[:-1]],
                                 repeat),
        "encode": best_of(lambda: [tok.tokenize_batch_flat([s[0] for s in d]) for d in docs], repeat),
        "encode + eod/lengths assembly": best_of(lambda: [encoder._tokenize(d) for d in docs], repeat),
        "whole tasks": best_of(lambda: [encoder.encode_task(x) for x in tasks], repeat),
    }
    print("preprocess  1-worker stages: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()))
    return t


def make_corpus_dataset(out_dir):
    """The bundled corpus (repeated 16 times) tokenized once, untimed; returns the dataset prefix."""
    vocab, merges = gpt2_files()
    corpus = os.path.join(out_dir, "corpus.jsonl")
    with open(CORPUS, encoding="utf-8") as f:
        lines = f.readlines()
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(lines * 16)
    preprocess_data.main(["--input", corpus, "--output-prefix", os.path.join(out_dir, "reads"), "--tokenizer-type",
                          "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                          "--workers", "2", "--log-interval", "100000000"])
    return os.path.join(out_dir, "reads_text_document")


def bench_reads(prefix, seq_length, out_dir, n_reads=20000, batch=32):
    """Random samples read as training reads them, against raw memmap reads of the same bytes.

    ``get_batch``: batches of ``batch`` random sample indices through ``GPTDataset.get_batch`` (tokens, labels,
    loss mask, position ids), into reused buffers. Limits, same batch shape, same uint16 -> int64 copy into a
    preallocated ``[batch, seq_length + 1]`` array: (a) one memmap slice of ``seq_length + 1`` tokens per sample
    at random offsets; (b) one contiguous memmap slice of all ``batch * (seq_length + 1)`` tokens at a random
    offset (no per-sample work at all: the memory-bandwidth bound). Also the per-sample path
    (``dataset[i]``, what a DataLoader with ``default_collate`` calls) against (a) done per sample.
    """
    n_samples = 4000
    train = build_gpt_datasets([prefix], "1", seq_length, 1234, (n_samples, None, None),
                               cache_dir=os.path.join(out_dir, "cache"), eod_id=50256)[0]
    import torch

    raw = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    n_batches = n_reads // batch
    idx = rng.integers(0, len(train), (n_batches, batch))
    offs = rng.integers(0, raw.shape[0] - seq_length - 1, (n_batches, batch))
    starts = rng.integers(0, raw.shape[0] - batch * (seq_length + 1), n_batches)
    buf = np.empty((batch, seq_length + 1), dtype=np.int64)
    flat = buf.reshape(-1)

    def batched():
        for b in idx:
            train.get_batch(b, reuse=True)

    def raw_per_sample():
        for row in offs:
            for k, o in enumerate(row):
                buf[k] = raw[o:o + seq_length + 1]

    def raw_contiguous():
        for o in starts:
            flat[:] = raw[o:o + flat.shape[0]]

    def per_item():
        for i in idx.reshape(-1)[:n_reads // 4]:
            train[int(i)]

    def raw_per_item():
        for o in offs.reshape(-1)[:n_reads // 4]:
            text = torch.from_numpy(raw[o:o + seq_length + 1].astype(np.int64))
            text[:-1], text[1:]

    batched(), raw_contiguous()  # warm the page cache and the buffers
    t = {name: best_of(fn) for name, fn in (("batched", batched), ("raw_per_sample", raw_per_sample),
                                            ("raw_contiguous", raw_contiguous), ("per_item", per_item),
                                            ("raw_per_item", raw_per_item))}
    n = n_batches * batch
    print(f"sample reads seq={seq_length}, batches of {batch}: get_batch {n / t['batched']:9.0f} samples/s; raw "
          f"memmap per-sample slices {n / t['raw_per_sample']:9.0f} samples/s -> ratio "
          f"{t['raw_per_sample'] / t['batched']:.2f}; raw one contiguous slice {n / t['raw_contiguous']:9.0f} "
          f"samples/s -> ratio {t['raw_contiguous'] / t['batched']:.2f}")
    print(f"  per-sample dataset[i] {n_reads // 4 / t['per_item']:9.0f} samples/s vs raw per-sample slice + "
          f"torch {n_reads // 4 / t['raw_per_item']:9.0f} samples/s -> ratio {t['raw_per_item'] / t['per_item']:.2f}")
    return t["raw_per_sample"] / t["batched"], t["raw_contiguous"] / t["batched"]


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
    parser.add_argument("--repeat", type=int, default=3, help="preprocess: alternating runs of limit and tool")
    parser.add_argument("--corpus-repeat", type=int, default=64,
                        help="preprocess: the bundled corpus (1.94 MB) repeated this many times")
    parser.add_argument("--parquet-mb", type=int, default=1024,
                        help="preprocess-memory: MB of text in the large Parquet file")
    parser.add_argument("--only", choices=["preprocess", "preprocess-memory", "reads", "index"], default=None,
                        help="run one part (reads still preprocess the corpus once, untimed when alone)")
    args = parser.parse_args()
    if args.only == "preprocess-memory":
        with tempfile.TemporaryDirectory() as out_dir:
            bench_parquet_memory(out_dir, args.parquet_mb, args.workers[-1])
        return
    with tempfile.TemporaryDirectory() as out_dir:
        if args.only in (None, "preprocess"):
            prefix, _ = bench_preprocess(args.workers, out_dir, args.repeat, args.corpus_repeat)
            if not os.path.exists(prefix + ".idx"):
                prefix = os.path.join(out_dir, f"bench{args.workers[0]}_text_document")
        if args.only in (None, "reads"):
            if args.only == "reads":
                prefix = make_corpus_dataset(out_dir)
            bench_reads(prefix, args.seq_length, out_dir)
            bench_reads(prefix, 256, out_dir)
    if args.only in (None, "index"):
        bench_sample_index(args.seq_length)

if __name__ == "__main__":
    main()
