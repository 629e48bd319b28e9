"""Pipeline bubble, measured beside Megatron's formula ``(p-1)/(v*m)``.

A synthetic pipeline on forked gloo ranks runs the real schedules and p2p: every stage's forward sleeps
``tf/v`` and its backward ``tb/v`` per microbatch (the same per-rank work for any v, as when a model's
layers are split into v chunks), so the cost is uniform and CPU contention does not blur it. Each rank
records its compute spans with :class:`PipelineTimeline`; the bubble is mean idle / mean busy over the
iteration window (the quantity the formula describes). Prints one line per configuration.

    python benchmarks/bench_pipeline_bubble.py [--tf-ms 20 --tb-ms 40 --iters 3 --trace-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.pipeline.schedules import get_forward_backward_func, schedule_trace
from megatronish.parallel.pipeline.timeline import (
    PipelineTimeline,
    bubble_fraction,
    gather_timeline,
    write_chrome_trace,
)
from megatronish.testing import run_distributed

SHAPE = (4, 1, 8)  # [s, b, h] passed between stages


class _Sleep(torch.autograd.Function):
    """forward: sleep tf, identity; backward: sleep tb, identity."""

    @staticmethod
    def forward(ctx, x, tf, tb):
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        time.sleep(ctx.tb)
        return dy, None, None


class SleepStage(nn.Module):
    def __init__(self, tf: float, tb: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.tf, self.tb, self.input_tensor = tf, tb, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        x = x if self.input_tensor is None else self.input_tensor
        return _Sleep.apply(x * self.w, self.tf, self.tb)  # [s, b, h]


def _worker(rank, world, v, m, tf, tb, iters, trace_path):
    dims = ParallelDims(world_size=world, pp=world, vp=v)
    ctx = groups.initialize_model_parallel(dims)
    chunks = [SleepStage(tf / v, tb / v) for _ in range(v)]

    def forward_step(data_iterator, model):
        out = model(next(data_iterator))
        return out, lambda y: (y.sum(), {"loss": y.sum().detach()})

    func = get_forward_backward_func(world, v)
    bubbles, events = [], None
    for _ in range(iters):
        timeline = PipelineTimeline(rank)
        data = [iter([torch.ones(SHAPE) for _ in range(m)]) for _ in range(v)]
        dist.barrier()
        func(forward_step, data if v > 1 else data[0], chunks if v > 1 else chunks[0], m, tensor_shape=SHAPE,
             timeline=timeline, parallel=ctx)
        events = gather_timeline(timeline)
        if rank == 0:
            bubbles.append(bubble_fraction(events))
    if rank == 0 and trace_path:
        write_chrome_trace(trace_path, events, {"p": world, "v": v, "m": m})
    return bubbles


def simulated_bubble(p: int, v: int, m: int, tf: float, tb: float) -> float:
    """The schedule's own bubble with zero-latency messages: replay every rank's :func:`schedule_trace`
    (forward tf/v, backward tb/v; a batched exchange finishes when both ends of each message have posted)."""
    traces = [schedule_trace(p, v, m, r) for r in range(p)]
    clock, pos, posted = [0.0] * p, [0] * p, {}  # posted: (kind, channel, index) -> time
    count: dict = {}

    def ops_of(r, step):
        nxt, prv = (r + 1) % p, (r - 1) % p
        ops = []
        for kind, present, ch in (("send", step["send_next"], ("a", r, nxt)),
                                  ("send", step["send_prev"], ("g", r, prv)),
                                  ("recv", step["recv_prev"], ("a", prv, r)),
                                  ("recv", step["recv_next"], ("g", nxt, r))):
            if present is not None:
                count[(r, kind, ch)] = count.get((r, kind, ch), 0) + 1
                ops.append((kind, ch, count[(r, kind, ch)] - 1))
        return ops

    current = [None] * p
    while any(pos[r] < len(traces[r]) for r in range(p)):
        for r in range(p):  # run compute up to the next exchange and post it
            while pos[r] < len(traces[r]) and current[r] is None:
                step = traces[r][pos[r]]
                if step["op"] == "comm":
                    current[r] = ops_of(r, step)
                    for op in current[r]:
                        posted[op] = clock[r]
                else:
                    clock[r] += (tf if step["op"] == "F" else tb) / v
                    pos[r] += 1
        done = []
        for r in range(p):
            if current[r] is not None:
                peers = [(("recv" if k == "send" else "send"), ch, i) for k, ch, i in current[r]]
                if all(q in posted for q in peers):
                    done.append((r, max([clock[r]] + [posted[q] for q in peers])))
        if not done and any(pos[r] < len(traces[r]) for r in range(p)):
            raise RuntimeError("simulated schedule deadlocked")
        for r, t in done:
            clock[r], current[r] = t, None
            pos[r] += 1
    busy = m * (tf + tb)
    return (max(clock) - busy) / busy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--tf-ms", type=float, default=20.0, help="forward time per microbatch per rank")
    ap.add_argument("--tb-ms", type=float, default=40.0, help="backward time per microbatch per rank")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--trace-dir", default=None, help="write the last iteration's Chrome trace per config here")
    args = ap.parse_args(argv)
    p, m = args.p, args.m
    print(f"synthetic pipeline: p={p}, m={m}, forward {args.tf_ms} ms + backward {args.tb_ms} ms per microbatch "
          f"per rank (split over v chunks), gloo, {args.iters} iterations, median")
    for v in (1, 2):
        trace = os.path.join(args.trace_dir, f"bubble_p{p}_v{v}_m{m}.json") if args.trace_dir else None
        if trace:
            os.makedirs(args.trace_dir, exist_ok=True)
        bubbles = run_distributed(_worker, p, v, m, args.tf_ms / 1e3, args.tb_ms / 1e3, args.iters, trace,
                                  timeout=600)[0]
        measured = statistics.median(b["bubble"] for b in bubbles)
        window = statistics.median(b["window"] for b in bubbles)
        formula = (p - 1) / (v * m)
        simulated = simulated_bubble(p, v, m, args.tf_ms, args.tb_ms)
        print(f"p={p} m={m} v={v}: measured bubble {measured:.3f}  schedule replayed without processes "
              f"{simulated:.3f}  formula (p-1)/(v*m) = {formula:.3f}  "
              f"ratio {measured / formula:.2f}  (iteration {window * 1e3:.0f} ms, ideal "
              f"{m * (args.tf_ms + args.tb_ms):.0f} ms)" + (f"  trace {trace}" if trace else ""))


if __name__ == "__main__":
    main()
