"""Mixture-of-experts training throughput: tokens/s of one training iteration (forward, backward, optimizer step)
through ``pretrain()`` with mock data, fp32, for

* an 8-expert top-2 model against a dense model with the same active parameters (dense FFN = 2 x expert FFN);
* grouped experts (``--moe-grouped-gemm``: ``torch._grouped_mm``) against the sequential loop over experts;
* the allgather against the alltoall token dispatcher, on 2 forked gloo ranks at expert-parallel size 2.

    PYTHONPATH=. python benchmarks/bench_moe.py [--threads 1] [--iters 12] [--hidden 256] [--expert-ffn 256]

A one-process run uses ``--threads`` threads (default 1), each of the 2 expert-parallel ranks
``max(1, threads // 2)``; the ratios compare runs with the same process and thread counts only. Tokens/s is the
training log's ``tokens_per_sec`` over the iterations after the first two (warm-up), best and median. The ratios
are the point: on a shared, loaded CPU the absolute numbers move from run to run, and the best iteration is the
one least disturbed by other processes. (Two OpenMP threads on two busy cores stall on each other: on a loaded
2-core machine ``--threads 2`` one-process numbers vary 10x between runs; use it on an idle machine.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import warnings

import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain


def model_flags(a, *, moe: bool, grouped: bool = True, dispatcher: str = "allgather", ep: int = 1) -> list[str]:
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--swiglu",
             "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0"]
    if not moe:
        return flags + ["--ffn-hidden-size", str(a.topk * a.expert_ffn)]
    flags += ["--num-experts", str(a.experts), "--moe-router-topk", str(a.topk), "--moe-ffn-hidden-size",
              str(a.expert_ffn), "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
              "--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep)]
    return flags + (["--moe-grouped-gemm"] if grouped else [])


def train(rank, world, a, flags):
    torch.set_num_threads(max(1, a.threads // world))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        argv = flags + ["--micro-batch-size", str(a.micro_batch // world), "--global-batch-size",
                        str(a.micro_batch), "--train-iters", str(a.iters), "--lr", "1e-4", "--mock-data",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab), "--eval-iters", "0",
                        "--log-interval", "1", "--seed", "1234", "--metrics-file", metrics]
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pretrain(configs_from_args(parse_args(argv), world))
        if rank:
            return None
        rates = [json.loads(line)["tokens_per_sec"] for line in open(metrics)]
    return max(rates[2:]), statistics.median(rates[2:])


def run(a, flags, world=1) -> tuple[float, float]:
    """Best and median tokens/s over the iterations after the warm-up (each run in fresh forked processes)."""
    return run_distributed(train, world, a, flags, timeout=1800)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per iteration (split over 2 EP ranks)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=255)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    tokens = a.micro_batch * a.seq
    print(f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, {tokens} tokens per iteration, "
          f"fp32, SwiGLU; MoE: {a.experts} experts top-{a.topk} of FFN {a.expert_ffn}; dense: FFN "
          f"{a.topk * a.expert_ffn}; {a.threads} threads on {os.cpu_count()} CPU cores, torch {torch.__version__}")
    r = {}
    r["dense"] = run(a, model_flags(a, moe=False))
    r["moe grouped"] = run(a, model_flags(a, moe=True, grouped=True))
    r["moe sequential"] = run(a, model_flags(a, moe=True, grouped=False))
    r["EP 2 allgather"] = run(a, model_flags(a, moe=True, dispatcher="allgather", ep=2), world=2)
    r["EP 2 alltoall"] = run(a, model_flags(a, moe=True, dispatcher="alltoall", ep=2), world=2)
    print(f"  {'':<16} {'best':>10} {'median':>10}  tokens/s")
    for name, (best, median) in r.items():
        print(f"  {name:<16} {best:>10.0f} {median:>10.0f}")
    print("ratios (best; median):")
    for label, x, y in [("MoE (grouped) / dense, same active parameters", "moe grouped", "dense"),
                        ("grouped / sequential experts", "moe grouped", "moe sequential"),
                        ("alltoall / allgather dispatcher at EP 2", "EP 2 alltoall", "EP 2 allgather")]:
        print(f"  {label:<46} {r[x][0] / r[y][0]:.2f}x; {r[x][1] / r[y][1]:.2f}x")


if __name__ == "__main__":
    main()
