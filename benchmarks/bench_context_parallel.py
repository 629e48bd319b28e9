"""Context parallelism on a long sequence: saved-activation bytes per rank and time per iteration at CP 1/2/4
(``pretrain()`` with mock data, a tiny model), and the bytes each rank sends for one attention layer (forward +
backward) per ``--cp-comm-type``, measured by counting what goes through ``torch.distributed``, beside the
formula of docs/context_parallel.md.

    python benchmarks/bench_context_parallel.py [--seq 8192] [--cps 1 2 4]

On a CPU the CP ranks share the cores, so time per iteration shows the overhead, not a speed-up; the memory
ratio is the point (target: CP N holds <= 1.1/N of CP 1's activations).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.parallel.context_parallel import context_parallel_attention
from megatronish.parallel.dims import ParallelDims
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain


def train(rank, world, a, comm):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        argv = ["--num-layers", "2", "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
                "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
                "--global-batch-size", "1", "--train-iters", str(a.iters), "--lr", "1e-4", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--eval-iters", "0",
                "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
                "--position-embedding-type", "rope", "--context-parallel-size", str(world),
                "--cp-comm-type", comm, "--metrics-file", metrics]
        result = pretrain(configs_from_args(parse_args(argv), world))
        times = [json.loads(line)["elapsed_ms"] for line in open(metrics)] if rank == 0 else []
    return {"activations": result.context.memory.measured, "ms": statistics.median(times[1:]) if times else None}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def count_bytes(rank, world, a, comm):
    """Bytes this rank sends for one attention layer's forward + backward."""
    sent = [0]
    originals = {}

    def wrap(name, count):
        fn = getattr(dist, name)
        originals[name] = fn

        def counted(*args, **kw):
            sent[0] += count(*args, **kw)
            return fn(*args, **kw)
        setattr(dist, name, counted)

    n = world
    wrap("batch_isend_irecv", lambda ops: sum(_nbytes(op.tensor) for op in ops if op.op is originals["isend"]))
    originals["isend"] = dist.isend
    wrap("all_to_all", lambda out, inp, group=None: sum(_nbytes(t) for t in inp) * (n - 1) // n)
    wrap("all_gather", lambda out, t, group=None: _nbytes(t) * (n - 1))
    wrap("reduce_scatter", lambda out, inp, group=None: sum(_nbytes(t) for t in inp) * (n - 1) // n)
    try:
        ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, cp=world,
                                                            cp_inner=2 if comm == "a2a+p2p" else None))
        s, hq, hkv, d = a.seq // world, a.heads, a.heads // 2, a.hidden // a.heads
        q, k, v = (torch.randn(1, h, s, d, requires_grad=True) for h in (hq, hkv, hkv))
        out = context_parallel_attention(q, k, v, group=ctx.cp_group, comm_type=comm, scale=1 / math.sqrt(d),
                                         inner_group=ctx.group("cp_inner"), outer_group=ctx.group("cp_outer"))
        out.sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return sent[0]


def formula(comm: str, n: int, s: int, hq: int, hkv: int, d: int, b: int = 1, bytes_: int = 4) -> float:
    """Bytes one rank sends per attention layer, forward + backward (docs/context_parallel.md)."""
    local = b * (s // n) * d * bytes_  # one head's local tokens
    kv = 2 * hkv * local
    if comm == "p2p":  # forward: N-1 K/V blocks; backward: N-1 K/V blocks and N fp32 dK/dV blocks
        return (n - 1) * kv + (n - 1) * kv + n * kv
    if comm == "a2a":  # q, k, v and the output out and back: (N-1)/N of each local tensor, twice
        return 2 * (n - 1) / n * (2 * hq + 2 * hkv) * local
    if comm == "allgather":  # K/V to N-1 peers; backward reduce-scatter of dK/dV
        return 2 * (n - 1) * kv
    raise ValueError(comm)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    a = p.parse_args()
    print(f"tiny model: 2 layers, hidden {a.hidden}, {a.heads} heads (RoPE), seq {a.seq}, micro batch 1, fp32, "
          f"{os.cpu_count()} CPU cores")
    base = None
    print(f"{'CP':>3} {'comm':>9} {'saved activations/rank':>23} {'ratio to CP1':>13} {'x N':>6} {'ms/iter':>9}")
    for cp in a.cps:
        for comm in (["p2p"] if cp == 1 else ["p2p", "a2a", "allgather"]):
            r = run_distributed(train, cp, a, comm, timeout=1800)[0]
            base = base or r["activations"]
            ratio = r["activations"] / base
            print(f"{cp:>3} {comm:>9} {r['activations'] / 2**20:>20.2f} MB {ratio:>13.3f} {ratio * cp:>6.2f} "
                  f"{r['ms']:>9.0f}")
    print("\nbytes sent per rank for one attention layer (forward + backward), measured vs formula:")
    hq, hkv, d = a.heads, a.heads // 2, a.hidden // a.heads
    for cp in [c for c in a.cps if c > 1]:
        for comm in ("p2p", "a2a", "allgather"):
            if comm == "a2a" and hkv % cp:
                continue
            measured = run_distributed(count_bytes, cp, a, comm)[0]
            want = formula(comm, cp, a.seq, hq, hkv, d)
            print(f"  CP {cp} {comm:>9}: {measured / 2**20:8.3f} MB   formula {want / 2**20:8.3f} MB   "
                  f"ratio {measured / want:.3f}")


if __name__ == "__main__":
    main()
