#!/usr/bin/env python
"""Framework overhead: tokens/s of the training loop behind ``pretrain_gpt.py`` (TP = DP = PP = 1) vs the
bare model's forward + backward + AdamW step loop, same shape, same process, fp32 on CPU.

The bare loop is the limit: ``GPTModel`` + ``build_optimizer`` with the batch already in memory, no DDP
buffers, no scheduler, no clipping, no logging. ``pretrain()`` runs the real loop (mock data, DDP gradient
buffer, LR schedule, grad-norm clipping, metrics) with ``--log-interval 1``; its tokens/s is the median of the
iterations after the first two. The bare loop runs before and after it and its median is taken over both. The best
iteration of each is compared too: on a machine shared with other jobs it is the steadier of the two ratios.

    python benchmarks/bench_framework_overhead.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256]
        [--micro-batch 4] [--microbatches 1] [--iters 8] [--vocab 50304]
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.data.mock import MockGPTDataset
from megatronish.data.sampler import collate
from megatronish.model import GPTModel
from megatronish.optim.optimizer import build_optimizer
from megatronish.training.pretrain import pretrain


def bench_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per iteration")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--iters", type=int, default=8)
    return p.parse_args()


def bare_loop(cfg, args, iters):
    """Median seconds per iteration of the bare model + optimizer."""
    model = GPTModel(cfg.model)
    model.init_parameters(cfg.train.seed)
    opt = build_optimizer(model.named_parameters(), "adam", 1e-4, 0.01)
    ds = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
    batches = [collate([ds[i * args.micro_batch + j] for j in range(args.micro_batch)])
               for i in range(args.microbatches)]
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        for b in batches:
            (model(b["tokens"], labels=b["labels"]).mean() / args.microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main():
    args = bench_args()
    gbs = args.micro_batch * args.microbatches
    tokens = gbs * args.seq
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
                str(args.heads), "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
                "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(gbs),
                "--train-iters", str(args.iters + 2), "--lr", "1e-4", "--mock-data", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", str(args.vocab - 1), "--attention-dropout", "0",
                "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1", "--metrics-file", metrics]
        cfg = configs_from_args(parse_args(argv), 1)
        bare = bare_loop(cfg, args, args.iters // 2)
        pretrain(cfg)
        bare += bare_loop(cfg, args, args.iters // 2)
        records = [json.loads(line) for line in open(metrics)]
    ours = statistics.median(r["tokens_per_sec"] for r in records[2:])
    limit = tokens / statistics.median(bare)
    ours_best, limit_best = max(r["tokens_per_sec"] for r in records[2:]), tokens / min(bare)
    print(f"shape: layers {args.layers} hidden {args.hidden} heads {args.heads} seq {args.seq} "
          f"micro batch {args.micro_batch} x {args.microbatches} vocab {args.vocab}; threads {torch.get_num_threads()}")
    print(f"bare model fwd+bwd+adamw : {limit:10.1f} tokens/s")
    print(f"pretrain() loop          : {ours:10.1f} tokens/s")
    print(f"ratio pretrain/bare      : {ours / limit:.3f}   (target >= 0.95)")
    print(f"best iteration of each   : {ours_best:.1f} / {limit_best:.1f} tokens/s, ratio {ours_best / limit_best:.3f}")


if __name__ == "__main__":
    main()
