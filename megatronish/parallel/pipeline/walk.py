"""What a pipeline rank holds at its peak, found by walking its schedule's own order of steps.

Each schedule is a list of ``(op, chunk)`` steps per rank (:func:`rank_orders`): 1F1B's and the interleaved
schedule's tables (``schedules.schedule_table``: ``F`` and ``B``), the zero-bubble schedules' action lists
(``zero_bubble.build_compute_order``: ``F``, ``B`` and ``W``). Walking them (:func:`walk_peak`), ``F`` adds one
chunk-microbatch's activations, ``B`` trades them for what its deferred weight gradients need until ``W`` (nothing
when the backward is whole) and ``W`` frees that. Both the start-up memory report (``training/memory.py``) and the
planner (``planner/activations.py``) read a rank's peak this way, so every schedule's in-flight count, uneven chunks
(a layout's) and the split backward's held tensors are decided here once.
"""
from __future__ import annotations

import functools

__all__ = ["rank_orders", "walk_peak", "schedule_of"]


def schedule_of(schedule: str | None, v: int) -> str:
    """The schedule that runs: ``--pipeline-schedule``, else Megatron's choice from the flags (interleaved with
    virtual stages, 1F1B without)."""
    return schedule or ("interleaved-1f1b" if v > 1 else "1f1b")


@functools.lru_cache(maxsize=64)
def rank_orders(schedule: str | None, p: int, v: int, m: int) -> tuple:
    """Each rank's ``(op, chunk)`` steps of one iteration of ``schedule`` (:func:`schedule_of`) over ``p`` ranks,
    ``v`` chunks a rank and ``m`` microbatches (cached: a report or a plan asks for every rank)."""
    from .zero_bubble import SCHEDULES, build_compute_order

    schedule = schedule_of(schedule, v)
    if schedule in SCHEDULES:
        return tuple(tuple((a.op, a.chunk) for a in order) for order in build_compute_order(schedule, p, m))
    from .schedules import schedule_table

    return tuple(tuple((op, c) for op, _, c in schedule_table(p, v, m, r)) for r in range(p))


def walk_peak(steps, held: list[float], deferred: list[float]) -> tuple[list[int], list[int], int]:
    """Walk one rank's ``(op, chunk)`` steps: ``F`` holds ``held[c]`` bytes, ``B`` trades them for
    ``deferred[c]``, ``W`` frees those. Returns the chunk-microbatches per chunk between ``F`` and ``B`` and between
    ``B`` and ``W`` when the sum is largest (the first such moment), and the most ever between ``F`` and ``B``."""
    v = len(held)
    fb, bw = [0] * v, [0] * v
    best, at, most = -1.0, ([0] * v, [0] * v), 0
    for op, c in steps:
        fb[c] += (op == "F") - (op == "B")
        bw[c] += (op == "B") - (op == "W")
        total = sum(n * x for n, x in zip(fb, held)) + sum(n * x for n, x in zip(bw, deferred))
        if total > best:
            best, at = total, (list(fb), list(bw))
        most = max(most, sum(fb))
    return at[0], at[1], most
