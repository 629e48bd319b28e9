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
same schedule replayed in unit time without processes (zero-latency messages), replayed with every message taking
the one-way latency ``L`` measured first by a ping between two ranks (:func:`message_latency`; "at L"), 1F1B and
interleaved replayed with every step taking as long as it took in the measured iteration and no message time ("own
steps": what the run's uneven steps leave, the rest of the measured bubble is message time), and the formula. Also
with ``--overlap-p2p-communication`` ("overlap").

    python benchmarks/bench_pipeline_bubble.py [--p 4 --m 8 16 --t-ms 20 --iters 3 --ascii-dir DIR]

One warm-up iteration runs before the measured ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from megatronish.optim.optimizer import MegatronOptimizer
from megatronish.optim.post_validation import PostValidation
from megatronish.parallel import groups
from megatronish.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.pipeline.choose import forward_backward_func
from megatronish.parallel.pipeline.p2p import P2PCommunicator, arrived
from megatronish.parallel.pipeline.schedules import schedule_trace
from megatronish.parallel.pipeline.timeline import (
    PipelineTimeline,
    ascii_timeline,
    bubble_fraction,
    gather_timeline,
    steady_state_bubble,
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


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda y: (y.sum(), {"loss": y.sum().detach()})


def _worker(rank, world, schedule, m, t, iters, overlap):
    v = CHUNKS[schedule]
    dims = ParallelDims(world_size=world, pp=world, vp=v, pipeline_schedule=schedule)
    ctx = groups.initialize_model_parallel(dims)
    chunks = [SleepStage(t / v) for _ in range(v)]

    func = forward_backward_func(world, v, schedule)
    bubbles, best = [], None  # best: the events of the iteration with the least bubble
    for i in range(iters + 1):  # the first is a warm-up (the autograd engine's first call is slow)
        timeline = PipelineTimeline(rank)
        data = [iter([torch.ones(SHAPE) for _ in range(m)]) for _ in range(v)]
        dist.barrier()
        func(_forward_step, data if v > 1 else data[0], chunks if v > 1 else chunks[0], m, tensor_shape=SHAPE,
             timeline=timeline, parallel=ctx, overlap_p2p_comm=overlap)
        events = gather_timeline(timeline)
        if rank == 0 and i > 0:
            bubbles.append(bubble_fraction(events))
            best = events if bubbles[-1]["bubble"] == min(b["bubble"] for b in bubbles) else best
    groups.destroy_model_parallel()
    return bubbles, best


def _steady_worker(rank, world, schedule, m, t, iters):
    """Back-to-back iterations with ``--enable-optimizer-post-validation``'s step between them (the stages wrapped
    in DDP, the run's optimizer, :class:`PostValidation`): nothing synchronizes the ranks between iterations. One
    warm-up iteration, then ``iters`` measured periods (:func:`steady_state_bubble`). The step is SGD at LR 0 with a
    ``--clip-grad`` no norm reaches: every step stands at its validation (the usual case in stable training), so
    the stages' cost stays exact."""
    v = CHUNKS[schedule]
    dims = ParallelDims(world_size=world, pp=world, vp=v, pipeline_schedule=schedule)
    ctx = groups.initialize_model_parallel(dims)
    chunks = [DistributedDataParallel(SleepStage(t / v)) for _ in range(v)]
    validation = PostValidation(MegatronOptimizer(chunks, optimizer="sgd", lr=0.0, sgd_momentum=0.0,
                                                  clip_grad=1e9, parallel=ctx), None)

    func = forward_backward_func(world, v, schedule)
    timeline = PipelineTimeline(rank)
    dist.barrier()
    for i in range(iters + 2):
        seen = len(timeline.events)
        for c in chunks:
            c.zero_grad_buffer()
        data = [iter([torch.ones(SHAPE) for _ in range(m)]) for _ in range(v)]
        func(_forward_step, data if v > 1 else data[0], chunks if v > 1 else chunks[0], m, tensor_shape=SHAPE,
             timeline=timeline, parallel=ctx)
        for e in timeline.events[seen:]:
            e["iteration"] = i
        finalize_model_grads(chunks, ctx)
        validation.settle()  # the last iteration's step, as the training loop validates it
        validation.step(1, lambda ok, norm: None)
    validation.settle()
    events = gather_timeline(timeline)
    groups.destroy_model_parallel()
    return steady_state_bubble([e for e in events if e["iteration"] >= 1]) if rank == 0 else None


def _ping(rank, world, n, t):
    """One-way latency of a pipeline message as the runner sends it: rank 1 waits in a receive posted ahead, rank 0
    posts the send after sleeping ``t`` (a compute step); the tensor carries its send time (one clock: one host)."""
    dims = ParallelDims(world_size=world, pp=world, vp=1, pipeline_schedule="1f1b")
    ctx = groups.initialize_model_parallel(dims)
    p2p = P2PCommunicator(SHAPE, torch.float64, parallel=ctx)
    latencies = []
    for _ in range(n):
        if rank == 0:
            p2p.expect(activations=0, gradients=1)
            time.sleep(t)
            p2p.send_forward(torch.full(SHAPE, time.time(), dtype=torch.float64))
            arrived(p2p.recv_backward())  # rank 1 has posted its next receive
        else:
            p2p.expect(activations=1, gradients=0)
            x = arrived(p2p.recv_forward())
            latencies.append(time.time() - float(x.detach()[0, 0, 0]))
            p2p.send_backward(torch.zeros(SHAPE, dtype=torch.float64))
        p2p.wait_sends()
    groups.destroy_model_parallel()
    return latencies


def message_latency(t: float, n: int = 40) -> float:
    """The median one-way time of a pipeline message between two forked gloo ranks (:func:`_ping`), seconds."""
    latencies = sorted(run_distributed(_ping, 2, n, t, timeout=300)[1])
    return latencies[len(latencies) // 2]


def simulated_bubble(p: int, v: int, m: int, tf: float, tb: float, latency: float = 0.0, steps=None) -> float:
    """The schedule's own bubble with messages as the communicator moves them on gloo: replay every rank's
    :func:`schedule_trace` (forward tf/v, backward tb/v, or rank r's k-th step ``steps[r][k]``); sends never wait and
    receives are posted ahead, so a step waits only for the tensor it uses, which arrives ``latency`` after its
    sender posted it. The bubble as :func:`bubble_fraction` reads it from a timeline."""
    traces = [schedule_trace(p, v, m, r) for r in range(p)]
    count: dict = {}

    def message(role, kind, src, dst):  # (kind, src, dst, index on that link), counted by each end
        i = count[(role, kind, src, dst)] = count.get((role, kind, src, dst), -1) + 1
        return (kind, src, dst, i)

    def links(r):  # (next, previous)
        return (r + 1) % p, (r - 1) % p

    received = {}  # the receiver's token of a tensor -> its message
    for r in range(p):
        nxt, prv = links(r)
        for step in (s for s in traces[r] if s["op"] == "comm"):
            for token, kind, src in ((step["recv_prev"], "a", prv), (step["recv_next"], "g", nxt)):
                if token is not None:
                    received[token] = message("recv", kind, src, r)
    clock, pos, done, sent, spans = [0.0] * p, [0] * p, [0] * p, {}, []
    while any(pos[r] < len(traces[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            nxt, prv = links(r)
            while pos[r] < len(traces[r]):
                step = traces[r][pos[r]]
                if step["op"] == "comm":
                    for kind, present, dst in (("a", step["send_next"], nxt), ("g", step["send_prev"], prv)):
                        if present is not None:
                            sent[message("send", kind, r, dst)] = clock[r]
                else:
                    token = step["input"] if step["op"] == "F" else step["output_grad"]
                    if token is not None:
                        if received[token] not in sent:
                            break
                        clock[r] = max(clock[r], sent[received[token]] + latency)
                    t = steps[r][done[r]] if steps else (tf if step["op"] == "F" else tb) / v
                    spans.append({"rank": r, "cat": "compute", "start": clock[r], "end": clock[r] + t})
                    clock[r], done[r] = clock[r] + t, done[r] + 1
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulated schedule deadlocked")
    return bubble_fraction(spans)["bubble"]


def replayed_bubble(schedule: str, p: int, m: int, latency: float = 0.0) -> float:
    """The schedule's own bubble in unit time (``latency`` in units of F): zero-bubble lists through
    ``zero_bubble.simulate`` (F = B = W = 1, receives posted ahead), 1F1B and interleaved through their tables'
    message replay (forward 1, backward 2)."""
    if schedule in ("1f1b", "interleaved-1f1b"):
        return simulated_bubble(p, CHUNKS[schedule], m, 1.0, 2.0, latency)
    lists = schedule_actions(schedule, p, m)
    return simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * num_chunks(schedule),
                    {op: 1 / num_chunks(schedule) for op in "FBW"},
                    posted_receives=True, latency=latency)["bubble"]


def steady_replay(schedule: str, p: int, m: int, iterations: int = 6) -> float:
    """The schedule's steady-state bubble in unit time with no synchronization between iterations: its lists
    replayed ``iterations`` times back to back (each iteration's messages its own), the growth of the makespan
    per iteration against the ideal ``3m`` (F = B = W = 1); NaN for 1F1B and interleaved (not replayed so)."""
    if schedule in ("1f1b", "interleaved-1f1b"):
        return float("nan")

    def makespan(k):
        lists = schedule_actions(schedule, p, m)
        chained = [[dataclasses.replace(a, microbatch=a.microbatch + i * m) for i in range(k) for a in lists[r]]
                   for r in range(p)]
        v = num_chunks(schedule)
        return simulate(chained, lambda r, c: stage_of(schedule, p, r, c), p * v,
                        {op: 1 / v for op in "FBW"}, posted_receives=True)["makespan"]

    return (makespan(iterations) - makespan(iterations // 2)) / (iterations - iterations // 2) / (3 * m) - 1


def own_times_bubble(schedule: str, p: int, m: int, events: list[dict]) -> float | None:
    """1F1B and interleaved: the replay with every step taking as long as it took in the run (``events``) and
    messages taking no time: the bubble the run's own step times leave; the rest is message time."""
    if schedule not in ("1f1b", "interleaved-1f1b"):
        return None
    steps = [[e["end"] - e["start"] for e in sorted((e for e in events if e["rank"] == r and e["cat"] == "compute"),
                                                      key=lambda e: e["start"])] for r in range(p)]
    return simulated_bubble(p, CHUNKS[schedule], m, 0.0, 0.0, steps=steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--t-ms", type=float, default=20.0, help="F, B and W time per microbatch per rank (sleep)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--ascii-dir", default=None, help="write each run's last timeline as text here")
    ap.add_argument("--no-steady", action="store_true",
                    help="skip the back-to-back iterations under --enable-optimizer-post-validation")
    ap.add_argument("--steady-only", action="store_true", help="only the back-to-back iterations")
    args = ap.parse_args(argv)
    p, t = args.p, args.t_ms / 1e3
    latency = message_latency(t)
    print(f"synthetic pipeline: p={p}, F = B = W = {args.t_ms:g} ms per microbatch per rank (sleep, split over the "
          f"chunks), gloo, the least of {args.iters} iterations; bubble = mean idle / mean busy over the window",
          flush=True)
    print(f"message latency L (one way, median of 40 after a {args.t_ms:g} ms sleep, ping between two ranks): "
          f"{latency * 1e3:.3f} ms; back to back (no sleep): {message_latency(0.0) * 1e3:.3f} ms", flush=True)
    print(f"{'schedule':<17}{'m':>3}  {'measured':>8}  {'overlap':>8}  {'replayed':>8}  {'at L':>8}  {'own steps':>9}  "
          f"{'formula':>8}  {'vs formula':>10}  {'vs at L':>7}  {'vs 1F1B':>7}  iteration")
    for m in [] if args.steady_only else args.m:
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
            measured, window, events = got[False]
            base = measured if schedule == "1f1b" else base
            formula = FORMULA[schedule](p, m)
            at_latency = replayed_bubble(schedule, p, m, latency / t)
            own = own_times_bubble(schedule, p, m, events)
            vs_base = f"{measured / base:7.2f}" if base else f"{'':>7}"
            print(f"{schedule:<17}{m:>3}  {measured:8.4f}  {got[True][0]:8.4f}  {replayed_bubble(schedule, p, m):8.4f}"
                  f"  {at_latency:8.4f}  {'–' if own is None else f'{own:.4f}':>9}  {formula:8.4f}"
                  f"  {measured / formula:10.2f}  {measured / at_latency:7.2f}  {vs_base}  {window * 1e3:.0f} ms "
                  f"(ideal {3 * m * args.t_ms:.0f} ms)", flush=True)
    if args.no_steady:
        return
    print(f"\nback to back under --enable-optimizer-post-validation (no synchronization between iterations; "
          f"{args.iters} periods after a warm-up): steady-state bubble = (period - busy) / busy", flush=True)
    print(f"{'schedule':<17}{'m':>3}  {'steady':>8}  {'replayed':>8}  {'formula':>8}  {'vs 1F1B':>7}  "
          f"{'vs 1F1B synchronized':>20}  period")
    for m in args.m:
        base = synced = None
        for schedule in args.schedules:
            got = run_distributed(_steady_worker, p, schedule, m, t, args.iters, timeout=600)[0]
            if schedule == "1f1b":
                base = got["bubble"]
                synced = min(b["bubble"] for b in run_distributed(_worker, p, schedule, m, t, args.iters, False,
                                                                  timeout=600)[0][0])
            ratio = f"{got['bubble'] / base:7.2f}" if base else f"{'':>7}"
            vs_synced = f"{got['bubble'] / synced:20.2f}" if synced else f"{'':>20}"
            print(f"{schedule:<17}{m:>3}  {got['bubble']:8.4f}  {steady_replay(schedule, p, m):8.4f}  "
                  f"{FORMULA[schedule](p, m):8.4f}  {ratio}  {vs_synced}  {got['period'] * 1e3:.0f} ms "
                  f"(busy {got['busy'] * 1e3:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
