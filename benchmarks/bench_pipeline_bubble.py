"""Pipeline bubble of every schedule, measured from the timeline beside its formula and its unit-time replay.

A synthetic pipeline on forked gloo ranks runs the real schedules and p2p (``--pipeline-schedule`` 1f1b,
interleaved-1f1b with 2 chunks, zb-h1, zbv, dualpipev). Every stage costs the same: per microbatch and rank a
forward sleeps ``t``, the input-gradient half of the backward (``B``) ``t`` and the weight-gradient half (``W``)
``t``, each split over the rank's chunks; 1F1B and interleaved run ``B`` and ``W`` as one backward of ``2t``.
The stage sleeps instead of computing: on a shared, loaded CPU, processes that compute slow each other down and
blur the schedule, while sleeping ranks keep the cost exact. Each rank records its compute spans with
:class:`PipelineTimeline`; the bubble is mean idle / mean busy over the iteration window (the least over the
iterations: other load on the machine only adds idle time), from the first compute
start to the last compute end over all ranks (the quantity Megatron's ``(p-1)/(v*m)`` describes). Beside it: the
same schedule replayed in unit time without processes (zero-latency messages) and the formula. Also with the
receives posted ahead (``--overlap-p2p-communication``).

    python benchmarks/bench_pipeline_bubble.py [--p 4 --m 8 16 --t-ms 20 --iters 3 --ascii-dir DIR]

One warm-up iteration runs before the measured ones.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.pipeline.choose import forward_backward_func
from megatronish.parallel.pipeline.schedules import schedule_trace
from megatronish.parallel.pipeline.timeline import (
    PipelineTimeline,
    ascii_timeline,
    bubble_fraction,
    gather_timeline,
)
from megatronish.parallel.pipeline.zero_bubble import num_chunks, schedule_actions, simulate, stage_of
from megatronish.testing import run_distributed

SHAPE = (4, 1, 8)  # [s, b, h] passed between stages
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
CHUNKS = {"1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
# bubble / ideal with F = B = W (each schedule's own formula, docs/pipeline.md)
FORMULA = {"1f1b": lambda p, m: (p - 1) / m, "interleaved-1f1b": lambda p, m: (p - 1) / (2 * m),
           "zb-h1": lambda p, m: (p - 1) / (3 * m), "zbv": lambda p, m: (p - 1) / (6 * m),
           "dualpipev": lambda p, m: (p - 1) / (6 * m)}


class _Sleep(torch.autograd.Function):
    """forward: sleep tf, ``x * w``; backward: sleep tb for the input's gradient, tw for the weight's; with a
    weight-gradient store deferring (the split backward's ``B``), the weight's part is queued for ``W``."""

    @staticmethod
    def forward(ctx, x, w, t, store):
        ctx.save_for_backward(x, w)
        ctx.t, ctx.store = t, store
        time.sleep(t)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        time.sleep(ctx.t)
        dx = dy * w

        def weight_grad():
            time.sleep(ctx.t)
            return ((dy * x).sum().reshape(1),)

        if ctx.store is not None and ctx.store.deferring:
            ctx.store.put((w,), weight_grad)
            return dx, None, None, None
        return dx, weight_grad()[0], None, None


class SleepStage(nn.Module):
    weight_grad_store = None  # set by the split backward (megatronish.parallel.weight_grad.attached)

    def __init__(self, t: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.t, self.input_tensor = t, None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        x = x if self.input_tensor is None else self.input_tensor
        return _Sleep.apply(x, self.w, self.t, self.weight_grad_store)  # [s, b, h]


def _worker(rank, world, schedule, m, t, iters, overlap):
    v = CHUNKS[schedule]
    dims = ParallelDims(world_size=world, pp=world, vp=v, pipeline_schedule=schedule)
    ctx = groups.initialize_model_parallel(dims)
    chunks = [SleepStage(t / v) for _ in range(v)]

    def forward_step(data_iterator, model):
        out = model(next(data_iterator))
        return out, lambda y: (y.sum(), {"loss": y.sum().detach()})

    func = forward_backward_func(world, v, schedule)
    bubbles, events = [], None
    for i in range(iters + 1):  # the first is a warm-up (the autograd engine's first call is slow)
        timeline = PipelineTimeline(rank)
        data = [iter([torch.ones(SHAPE) for _ in range(m)]) for _ in range(v)]
        dist.barrier()
        func(forward_step, data if v > 1 else data[0], chunks if v > 1 else chunks[0], m, tensor_shape=SHAPE,
             timeline=timeline, parallel=ctx, overlap_p2p_comm=overlap)
        events = gather_timeline(timeline)
        if rank == 0 and i > 0:
            bubbles.append(bubble_fraction(events))
    groups.destroy_model_parallel()
    return bubbles, events


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


def replayed_bubble(schedule: str, p: int, m: int) -> float:
    """The schedule's own bubble in unit time: zero-bubble lists through ``zero_bubble.simulate`` (F = B = W = 1),
    1F1B and interleaved through their tables' message replay (forward 1, backward 2)."""
    if schedule in ("1f1b", "interleaved-1f1b"):
        return simulated_bubble(p, CHUNKS[schedule], m, 1.0, 2.0)
    lists = schedule_actions(schedule, p, m)
    return simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * num_chunks(schedule),
                    {"F": 1, "B": 1, "W": 1})["bubble"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--t-ms", type=float, default=20.0, help="F, B and W time per microbatch per rank (sleep)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--ascii-dir", default=None, help="write each run's last timeline as text here")
    args = ap.parse_args(argv)
    p, t = args.p, args.t_ms / 1e3
    print(f"synthetic pipeline: p={p}, F = B = W = {args.t_ms:g} ms per microbatch per rank (sleep, split over the "
          f"chunks), gloo, the least of {args.iters} iterations; bubble = mean idle / mean busy over the window")
    print(f"{'schedule':<17}{'m':>3}  {'measured':>8}  {'overlap':>8}  {'replayed':>8}  {'formula':>8}  "
          f"{'vs formula':>10}  {'vs 1F1B':>7}  iteration")
    for m in args.m:
        base = None
        for schedule in args.schedules:
            got = {}
            for overlap in (False, True):
                bubbles, events = run_distributed(_worker, p, schedule, m, t, args.iters, overlap, timeout=600)[0]
                best = min(bubbles, key=lambda b: b["bubble"])  # load on the machine only adds idle time
                got[overlap] = (best["bubble"], best["window"], events)
                if args.ascii_dir:
                    os.makedirs(args.ascii_dir, exist_ok=True)
                    name = f"{schedule}_p{p}_m{m}" + ("_overlap" if overlap else "") + ".txt"
                    with open(os.path.join(args.ascii_dir, name), "w") as f:
                        f.write(ascii_timeline(events) + "\n")
            measured, window, _ = got[False]
            base = measured if schedule == "1f1b" else base
            formula = FORMULA[schedule](p, m)
            vs_base = f"{measured / base:7.2f}" if base else f"{'':>7}"
            print(f"{schedule:<17}{m:>3}  {measured:8.4f}  {got[True][0]:8.4f}  {replayed_bubble(schedule, p, m):8.4f}"
                  f"  {formula:8.4f}  {measured / formula:10.2f}  {vs_base}  {window * 1e3:.0f} ms "
                  f"(ideal {3 * m * args.t_ms:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
