"""Zero-bubble schedules as pure functions: each rank's list of actions (F, B, W, sends, receives).

The backward of a microbatch on a stage is split in ``B`` (the gradient of the stage's input, which the
previous stage waits for) and ``W`` (the weight gradients, which nobody waits for;
:mod:`megatronish.parallel.weight_grad`). Placing the ``W`` steps where a rank would otherwise wait fills the
pipeline bubble.

- ``zb-h1`` (one chunk per rank, stage ``r`` on rank ``r``): 1F1B's rule for forwards (at most ``p - r``
  microbatches between ``F`` and ``B``), ``B`` as soon as its gradient is there, and a ``W`` when the rank
  would otherwise wait or when ``p - 1`` microbatches already wait for theirs. With ``F = B = W`` the bubble is
  ``(p-1)/(3m)``: a third of 1F1B's.
- ``zbv`` (two chunks per rank in a V: rank ``r`` holds stages ``r`` and ``2p-1-r``, so the first and the last
  stage are both on rank 0; the hand-over from stage ``p-1`` to ``p`` stays on rank ``p-1``): the order of the
  zero-bubble paper's ZB-V (Qi et al.; :func:`zbv_order`), at most ``2p`` half-stage microbatches between ``F``
  and ``W`` (1F1B's peak on rank 0, in layers). With ``F = B = W`` the bubble is ``(p-1)/(6m)``: a sixth of
  1F1B's, and the least any schedule can reach (rank ``r`` receives its first input after ``r`` half-stage
  forwards and every rank has ``6m`` half-stage steps, so the window is at least ``6m + p - 1``). A unit-time
  list scheduler reaches the same bubble, but its ``W`` steps fill gaps that exist only when messages take no
  time: with message latency the paper's order keeps more of its bubble (``simulate(latency=...)``).
- ``dualpipev`` (DeepSeek's DualPipe cut in half, the V placement of ``zbv``; :func:`dualpipev_order`): phases
  of forwards, then overlapped pairs (the forward of one chunk with the backward of the other, which the GPU
  implementation runs at once to hide expert-parallel all-to-alls; here they run one after the other), then
  backwards split in ``B`` and ``W`` in the cool-down. Needs ``m >= 2p``.

:func:`build_compute_order` gives each rank's order of compute: for ``zb-h1`` a unit-time list scheduler
(``F = B = W = 1``; messages take no time) over the dependencies ``F(s-1) -> F(s)``, ``B(s+1) -> B(s)``
(``F(last) -> B(last)``), ``B -> W``, each rank choosing its next step by the rule above; for the V schedules
their fixed phases. :func:`add_messages` then inserts
the sends (right after the step that produces a tensor) and the receives: a rank receives the messages a peer
sends it in the order the peer sends them, each one just before the first of its steps that needs it or an
earlier-sent message (what a one-stream transport needs). :func:`simulate` replays ordered lists with
given durations (deadlock check, bubble, peak memory).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "SCHEDULES", "stage_of", "place", "num_chunks", "build_compute_order", "add_messages",
           "schedule_actions", "simulate", "peak_in_flight", "in_flight_limit", "dualpipev_order", "zbv_order",
           "V_SHAPED",
           "post_receives_early"]

SCHEDULES = ("zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank: rank r holds stages r and 2p-1-r


@dataclass(frozen=True)
class Action:
    """One step. ``op``: ``F``/``B``/``W`` (compute on local ``chunk``), ``SEND``/``RECV`` (``kind``
    ``activation`` or ``gradient`` of ``microbatch``, leaving or entering local ``chunk``, to/from ``peer``)."""

    op: str
    microbatch: int
    chunk: int
    kind: str | None = None
    peer: int | None = None

    def __repr__(self) -> str:
        if self.op in ("SEND", "RECV"):
            return f"{self.op}({self.kind[0]}{self.microbatch}.c{self.chunk}<->{self.peer})"
        return f"{self.op}{self.microbatch}.c{self.chunk}"


def num_chunks(schedule: str) -> int:
    return 2 if schedule in V_SHAPED else 1


def stage_of(schedule: str, p: int, rank: int, chunk: int) -> int:
    """Global stage of ``rank``'s local ``chunk`` (the V: chunk 1 on rank r is stage ``2p-1-r``)."""
    if schedule in V_SHAPED:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def place(schedule: str, p: int, stage: int) -> tuple[int, int]:
    """``(rank, local chunk)`` holding global ``stage``."""
    if schedule in V_SHAPED:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def in_flight_limit(schedule: str, p: int, rank: int) -> int:
    """Most chunk-microbatches a rank lets in between their ``F`` and their ``B`` under the list scheduler (a
    forward waits otherwise): ``p - r``, 1F1B's rule (``zb-h1``); with two chunks ``2p`` of half a stage each
    (1F1B's peak on rank 0, in layers)."""
    return p - rank if num_chunks(schedule) == 1 else 2 * p


def pending_weight_limit(p: int) -> int:
    """Most chunk-microbatches waiting for their ``W`` (after ``B``) before the rank runs a ``W`` first."""
    return p - 1


def build_compute_order(schedule: str, p: int, m: int) -> list[list[Action]]:
    """Each rank's order of ``F``/``B``/``W`` steps (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown zero-bubble schedule {schedule!r}; choose from {SCHEDULES}")
    if schedule == "dualpipev":
        return dualpipev_order(p, m)
    if schedule == "zbv":
        return zbv_order(p, m)
    v = num_chunks(schedule)
    n = p * v  # stages
    done: dict[tuple, int] = {}  # (op, mb, stage) -> end time
    nxt = {(op, s): 0 for op in "FBW" for s in range(n)}  # next microbatch per op and stage (each in order)
    orders: list[list[Action]] = [[] for _ in range(p)]
    total, t = 3 * m * n, 0
    while len(done) < total:
        if t > 10 * total:
            raise RuntimeError(f"{schedule}: no progress (p {p}, m {m})")
        started = []
        for r in range(p):
            choice = _choose(schedule, p, m, r, v, n, t, done, nxt)
            if choice is not None:
                started.append((r, choice))
        for r, (op, s) in started:
            mb = nxt[(op, s)]
            nxt[(op, s)] += 1
            done[(op, mb, s)] = t + 1
            orders[r].append(Action(op, mb, place(schedule, p, s)[1]))
        t += 1
    return orders


def _ready(op: str, mb: int, s: int, n: int, m: int, t: int, done: dict) -> bool:
    if mb >= m:
        return False
    if op == "F":
        return s == 0 or done.get(("F", mb, s - 1), t + 1) <= t
    if op == "B":
        if done.get(("F", mb, s), t + 1) > t:
            return False
        return s == n - 1 or done.get(("B", mb, s + 1), t + 1) <= t
    return done.get(("B", mb, s), t + 1) <= t


def _choose(schedule, p, m, r, v, n, t, done, nxt):
    stages = sorted((stage_of(schedule, p, r, c) for c in range(v)), reverse=True)  # the later stage first
    in_flight = sum(nxt[("F", s)] - nxt[("B", s)] for s in stages)
    pending = sum(nxt[("B", s)] - nxt[("W", s)] for s in stages)
    w_ready = [s for s in sorted(stages, key=lambda s: nxt[("W", s)])  # the oldest waiting W
               if _ready("W", nxt[("W", s)], s, n, m, t, done)]
    b_ready = [s for s in stages if _ready("B", nxt[("B", s)], s, n, m, t, done)]
    too_many_w = pending > pending_weight_limit(p)
    if b_ready and not (too_many_w and w_ready):  # the input gradient: the previous stage waits for it
        return "B", b_ready[0]
    if w_ready and too_many_w:
        return "W", w_ready[0]
    if in_flight < in_flight_limit(schedule, p, r):
        for s in stages:
            if _ready("F", nxt[("F", s)], s, n, m, t, done):
                return "F", s
    if w_ready:  # nothing else to do: a weight gradient fills the gap
        return "W", w_ready[0]
    return None


def zbv_order(p: int, m: int) -> list[list[Action]]:
    """ZB-V's order of compute on every rank (the zero-bubble paper's; the same order as
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble``). Chunk 0 is stage ``r``, chunk 1 stage ``2p-1-r``.
    Phases on rank ``r``, planned for ``n = max(m, 2p-1)`` microbatches (the steps of microbatches ``>= m`` are
    then left out, so small ``m`` keeps the shape):

    1. ``2(p-r)-1`` x ``F0``;  2. ``r`` x (``F1``, ``F0``);  3. ``p-r`` x (``F1``, ``B1``, ``W1``);
    4. until every forward has run: (``F0`` while any is left, ``B0``, ``W0``, ``F1``, ``B1``, ``W1``);
    5. ``r`` x (``B0``, ``B1``);  6. ``p-r`` x (``B0``, ``W0``);  7. the ``W1`` left, then the ``W0`` left.
    """
    n = max(m, 2 * p - 1)
    orders = []
    for r in range(p):
        order: list[Action] = []
        count = {(op, c): 0 for op in "FBW" for c in (0, 1)}

        def step(*ops):
            for op, c in ops:
                order.append(Action(op, count[(op, c)], c))
                count[(op, c)] += 1

        step(*[("F", 0)] * (2 * (p - r) - 1))
        step(*[("F", 1), ("F", 0)] * r)
        step(*[("F", 1), ("B", 1), ("W", 1)] * (p - r))
        while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
            step(*[("F", 0)] * (count[("F", 0)] < n), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
        step(*[("B", 0), ("B", 1)] * r)
        step(*[("B", 0), ("W", 0)] * (p - r))
        step(*[("W", 1)] * (count[("B", 1)] - count[("W", 1)]))
        step(*[("W", 0)] * (count[("B", 0)] - count[("W", 0)]))
        orders.append([a for a in order if a.microbatch < m])
    return orders


def dualpipev_order(p: int, m: int) -> list[list[Action]]:
    """DualPipeV's order of compute on every rank (DeepSeek's ``dualpipev.py``; the same order as
    ``torch.distributed.pipelining.ScheduleDualPipeV``). Chunk 0 is the V's descending leg (stage ``r``), chunk 1
    the ascending one (stage ``2p-1-r``). ``F0&B1`` is an overlapped pair, run as ``F0`` then ``B1``; a backward
    without ``W`` after it runs whole (``B`` then ``W`` at once); split ones queue their ``W``, which later
    ``W`` steps take oldest first. Phases on rank ``r``:

    1. ``2(p-r-1)`` x ``F0``;  2. ``r+1`` x (``F0``, ``F1``);  3. ``p-r-1`` x (``B1`` split, ``W``, ``F1``);
    4. ``m-2p+r+1`` x (``F0&B1``, ``F1&B0``) (the last rank runs its first ``F0``, ``B1`` unpaired);
    5. ``p-r-1`` x (``B1``, ``F1&B0``);  6. ``r+1`` x (``B1``, ``B0``), split from the middle one on (odd ranks
    from its ``B1``, even ranks from its ``B0``);  7. ``p-r-1`` x (``W``, ``B0`` split);  8. ``r+1`` x ``W``.
    """
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2p = {2 * p} microbatches, got {m}")
    orders = []
    for r in range(p):
        order: list[Action] = []
        count = {(op, c): 0 for op in "FBW" for c in (0, 1)}
        waiting: list[int] = []  # chunks of split B's whose W is still to run, oldest first

        def step(op, c, split=False):
            mb = count[(op, c)]
            count[(op, c)] += 1
            order.append(Action(op, mb, c))
            if op == "B":
                if split:
                    waiting.append(c)
                else:  # a whole backward
                    step("W", c)

        def weight():
            if waiting:
                step("W", waiting.pop(0))

        for _ in range(2 * (p - r - 1)):
            step("F", 0)
        for _ in range(r + 1):
            step("F", 0), step("F", 1)
        for _ in range(p - r - 1):
            step("B", 1, split=True), weight(), step("F", 1)
        for _ in range(m - 2 * p + r + 1):
            step("F", 0), step("B", 1), step("F", 1), step("B", 0)
        for _ in range(p - r - 1):
            step("B", 1), step("F", 1), step("B", 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            step("B", 1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            step("B", 0, split)
        for _ in range(p - r - 1):
            weight(), step("B", 0, split=True)
        for _ in range(r + 1):
            weight()
        orders.append(order)
    return orders


def add_messages(schedule: str, p: int, orders: list[list[Action]]) -> list[list[Action]]:
    """Insert sends and receives into the per-rank compute orders (see the module docstring)."""
    v = num_chunks(schedule)
    n = p * v

    def message(rank, a):  # what a compute step sends: (kind, stage it enters, receiving rank) or None
        s = stage_of(schedule, p, rank, a.chunk)
        if a.op == "F" and s < n - 1:
            return "activation", s + 1
        if a.op == "B" and s > 0:
            return "gradient", s - 1
        return None

    def needs(rank, a):  # what a compute step receives: (kind, stage) or None
        s = stage_of(schedule, p, rank, a.chunk)
        if a.op == "F" and s > 0:
            return "activation", s
        if a.op == "B" and s < n - 1:
            return "gradient", s
        return None

    # every rank's sends to each peer, in its order: (kind, mb, receiving stage)
    sent_to: dict[tuple[int, int], list] = {}
    for r, order in enumerate(orders):
        for a in order:
            msg = message(r, a)
            if msg is not None:
                dst = place(schedule, p, msg[1])[0]
                if dst != r:
                    sent_to.setdefault((r, dst), []).append((msg[0], a.microbatch, msg[1]))
    out: list[list[Action]] = []
    for r, order in enumerate(orders):
        cursor = {src: 0 for (src, dst) in sent_to if dst == r}
        actions: list[Action] = []
        for a in order:
            need = needs(r, a)
            if need is not None:
                src = place(schedule, p, need[1] - 1 if need[0] == "activation" else need[1] + 1)[0]
                if src != r:
                    queue = sent_to[(src, r)]
                    target = queue.index((need[0], a.microbatch, need[1]))
                    while cursor[src] <= target:
                        kind, mb, s = queue[cursor[src]]
                        actions.append(Action("RECV", mb, place(schedule, p, s)[1], kind, src))
                        cursor[src] += 1
            actions.append(a)
            msg = message(r, a)
            if msg is not None:
                dst = place(schedule, p, msg[1])[0]
                if dst != r:
                    actions.append(Action("SEND", a.microbatch, a.chunk, msg[0], dst))
        out.append(actions)
    return out


def post_receives_early(actions: list[Action]) -> list[Action]:
    """``--overlap-p2p-communication``: every ``RECV`` moved before the compute step ahead of it, so the message
    travels while that step runs. It never passes a message to or from its own peer: every link keeps its order
    of sends and receives (what a transport that runs each link's messages in order, as NCCL, needs), and no step
    needs a receive that came after it."""
    out: list[Action] = []
    for a in actions:
        j = len(out)
        if a.op == "RECV":
            passed = False
            while j > 0:
                prev = out[j - 1]
                if prev.op in ("SEND", "RECV"):
                    if prev.peer == a.peer:
                        break
                elif passed:
                    break
                else:
                    passed = True
                j -= 1
        out.insert(j, a)
    return out


def schedule_actions(schedule: str, p: int, m: int) -> list[list[Action]]:
    """Every rank's full action list for ``m`` microbatches on ``p`` ranks."""
    return add_messages(schedule, p, build_compute_order(schedule, p, m))


def simulate(lists: list[list[Action]], stage_fn, n: int, durations: dict, posted_receives: bool = False,
             latency: float = 0.0) -> dict:
    """Replay ordered per-rank lists: each compute step starts when its rank is free and its inputs exist
    (``stage_fn(rank, chunk) -> global stage``; ``n`` stages); sends and receives take no time, a tensor from
    another rank arrives ``latency`` after the step that made it, a receive waits for its send
    (``posted_receives``: a receive is only posted, the step using it waits). Split schedules
    have ``W`` steps; a list without them runs ``B`` as the whole backward.
    Returns ``{"spans": {rank: [(start, end, action)]}, "bubble": mean idle / mean busy over the window from
    the first start to the last end}``; raises ``RuntimeError`` on a deadlock, naming each rank's blocked step."""
    pos = [0] * len(lists)
    free = [0.0] * len(lists)
    done: dict[tuple, float] = {}
    sent: dict[tuple, float] = {}  # (src, dst, kind, mb, chunk on dst side? no: stage) -> time
    spans: dict[int, list] = {r: [] for r in range(len(lists))}
    owner = {stage_fn(r, a.chunk): r for r, actions in enumerate(lists) for a in actions}
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for r, actions in enumerate(lists):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                s = stage_fn(r, a.chunk)
                if a.op == "SEND":
                    sent[(r, a.peer, a.kind, a.microbatch)] = free[r]
                elif a.op == "RECV":
                    key = (a.peer, r, a.kind, a.microbatch)
                    if not posted_receives:
                        if key not in sent:
                            break
                        free[r] = max(free[r], sent[key])
                else:
                    deps = {"F": [("F", a.microbatch, s - 1)] if s > 0 else [],
                            "B": [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < n - 1 else []),
                            "W": [("B", a.microbatch, s)]}[a.op]
                    if any(d not in done for d in deps):
                        break
                    start = max([free[r]] + [done[d] + (latency if owner[d[2]] != r else 0.0) for d in deps])
                    end = start + durations[a.op]
                    done[(a.op, a.microbatch, s)] = end
                    spans[r].append((start, end, a))
                    free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: actions[pos[r]] for r, actions in enumerate(lists) if pos[r] < len(actions)}
            raise RuntimeError(f"deadlock: blocked steps {blocked}")
    busy = [sum(e - s for s, e, _ in sp) for sp in spans.values()]
    first = min(s for sp in spans.values() for s, _, _ in sp)
    last = max(e for sp in spans.values() for _, e, _ in sp)
    mean_busy = sum(busy) / len(busy)
    return {"spans": spans, "bubble": (last - first - mean_busy) / mean_busy, "makespan": last - first}


def peak_in_flight(actions: list[Action]) -> int:
    """Most chunk-microbatches held at once by one rank's list: counted from ``F`` until ``W`` (the ``W`` keeps
    the linears' inputs), or until ``B`` where the list has no ``W``."""
    split = any(a.op == "W" for a in actions)
    held = peak = 0
    for a in actions:
        if a.op == "F":
            held += 1
            peak = max(peak, held)
        elif a.op == ("W" if split else "B"):
            held -= 1
    return peak
