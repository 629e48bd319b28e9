#!/usr/bin/env python
"""Precision on CPU: tokens/s and saved-activation peak of ``pretrain()`` in fp32, bf16 and FP8 (emulated,
``--fp8-format hybrid``) on one process, and the activation-memory ratios measured / formula per layer.

Part 1 runs the real training loop (mock data, DDP buffers, optimizer with fp32 master weights for bf16/fp8,
clipping) with ``--log-interval 1``; tokens/s is the median over the iterations after the first two, and the
activation peak is what the loop's meter records on its first iteration (tensors saved for backward, distinct
storages, parameters excluded). Ratios are printed against fp32.

Part 2 measures one bf16 transformer layer (dropout on) at TP 1 and TP 2, without and with sequence parallelism
and selective recompute, against Korthikanti et al.'s formula and against the formula plus this build's known
CPU deviations (``megatronish.training.memory.cpu_activation_bytes_per_layer``).

    python benchmarks/bench_precision.py [--layers 4] [--hidden 256] [--heads 8] [--seq 256] [--micro-batch 4]
        [--iters 8] [--vocab 8192] [--threads N]
"""
import argparse
import json
import os
import statistics
import tempfile

import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import gpt2
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.memory import (
    SavedActivationCounter,
    activation_bytes_per_layer,
    cpu_activation_bytes_per_layer,
)
from megatronish.training.pretrain import pretrain

os.environ.setdefault("MEGATRONISH_DEVICE", "cpu")  # read when a device is first asked for


def bench_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def run_precision(rank, world, args, flags, threads):
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
                str(args.heads), "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
                "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.micro_batch),
                "--train-iters", str(args.iters), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", str(args.vocab - 1), "--eval-iters", "0", "--log-interval", "1",
                "--metrics-file", metrics, *flags]
        groups.destroy_model_parallel()
        result = pretrain(configs_from_args(parse_args(argv), world))
        records = [json.loads(line) for line in open(metrics)]
    tps = statistics.median(r["tokens_per_sec"] for r in records[2:])
    meter = result.context.memory
    return {"tokens_per_sec": tps, "saved_activations": meter.measured, "formula": meter.estimate,
            "loss": [loss for _, loss in result.state.history]}


def measure_layer(rank, world, s, b, h, a):
    from megatronish.model.transformer import TransformerLayer
    from megatronish.parallel.dims import ParallelDims
    from megatronish.parallel.random import set_random_seed

    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=world))
    set_random_seed(1, 0, ctx.tp_rank)
    out = []
    for sp, rec in [(False, None), (True, None), (True, "selective"), (False, "selective")]:
        if world == 1 and sp:
            continue
        cfg = gpt2(num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=96, seq_length=s,
                   recompute_granularity=rec)
        layer = TransformerLayer(cfg, 0, sp, torch.bfloat16, parallel=ctx).train()
        x = torch.randn(s // world if sp else s, b, h, dtype=torch.bfloat16, requires_grad=True)
        with SavedActivationCounter(layer.parameters()) as c:
            y = layer(x)
        y.float().sum().backward()
        out.append((sp, rec, c.peak))
    return out


def main():
    args = bench_args()
    threads = args.threads or os.cpu_count()
    print(f"model: L={args.layers} h={args.hidden} a={args.heads} s={args.seq} b={args.micro_batch} "
          f"V={args.vocab}; {args.iters} iterations, {threads} threads, CPU")
    cases = {"fp32": [], "bf16": ["--bf16"], "fp8 (hybrid, emulated)": ["--fp8-format", "hybrid"],
             "bf16 + fp8 (hybrid)": ["--bf16", "--fp8-format", "hybrid"]}
    res = {}
    for name, flags in cases.items():
        res[name] = run_distributed(run_precision, 1, args, flags, threads, timeout=1800)[0]
    base = res["fp32"]
    print(f"\n{'precision':24s} {'tokens/s':>10s} {'x fp32':>7s} {'saved act. MB':>14s} {'x fp32':>7s} "
          f"{'formula MB':>11s} {'meas/formula':>12s} {'final loss':>10s}")
    for name, r in res.items():
        print(f"{name:24s} {r['tokens_per_sec']:10.1f} {r['tokens_per_sec'] / base['tokens_per_sec']:7.2f} "
              f"{r['saved_activations'] / 2**20:14.2f} {r['saved_activations'] / base['saved_activations']:7.2f} "
              f"{r['formula'] / 2**20:11.2f} {r['saved_activations'] / r['formula']:12.2f} {r['loss'][-1]:10.4f}")

    s, b, h, a = args.seq, args.micro_batch, args.hidden, args.heads
    print(f"\nper-layer saved activations, bf16, dropout on (s={s} b={b} h={h} a={a})")
    print(f"{'layout':28s} {'measured MB':>12s} {'formula MB':>11s} {'ratio':>6s} {'+CPU devs MB':>13s} {'ratio':>6s}")
    for t in (1, 2):
        for sp, rec, peak in run_distributed(measure_layer, t, s, b, h, a, timeout=1800)[0]:
            f = activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=sp, recompute=rec)
            adj = cpu_activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=sp, recompute=rec)
            label = f"t={t}" + (" SP" if sp else "") + (" selective" if rec else "")
            print(f"{label:28s} {peak / 2**20:12.3f} {f / 2**20:11.3f} {peak / f:6.2f} {adj / 2**20:13.3f} "
                  f"{peak / adj:6.3f}")


if __name__ == "__main__":
    main()
