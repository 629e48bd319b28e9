"""Running a zero-bubble action list (:mod:`.zero_bubble`) with the split backward (:mod:`..weight_grad`).

Each rank walks its list in order: ``F`` runs the chunk's forward (:class:`~.schedules._Runner`), ``B`` the input
half of its backward, ``W`` the weight half; ``SEND`` posts an asynchronous send of the tensor the step before
produced (a sent activation's storage is then freed, as in 1F1B); ``RECV`` posts an asynchronous receive, waited for
by the step that uses it (a ``wait_activation`` / ``wait_gradient`` span on the timeline's p2p row). With
``overlap_p2p_comm`` every receive is posted one compute step earlier (:func:`.zero_bubble.post_receives_early`), so
it travels while that step runs. Only those waits block, and the lists come from a feasible schedule (every rank
receives in its peer's send order), so no rank waits forever. The hand-over between the two legs of the V (``zbv``,
``dualpipev``) on rank ``p-1`` stays local. Data-parallel reduction stays off until each chunk's last ``W``, whose
hooks then reduce the gradients; an FSDP2 chunk accumulates its gradients unsharded and reduce-scatters them once,
after the schedule.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch

from ..weight_grad import WeightGradStore, attached, backward_input, backward_weight
from .p2p import RECEIVES_AHEAD
from .schedules import _as_list, _communicator, _Runner, _scaled
from .timeline import span
from .zero_bubble import num_chunks, place, post_receives_early, schedule_actions, stage_of

__all__ = ["forward_backward_zero_bubble"]


class _SplitRunner(_Runner):
    """:class:`_Runner` with the backward split into ``B`` and ``W``."""

    def __init__(self, *args, store: WeightGradStore, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = store
        self.params = [list(c.parameters()) for c in self.chunks]
        self.pending = [deque() for _ in self.chunks]  # per chunk: (microbatch, PendingWeightGrads)

    def backward(self, mb: int, c: int, dy):
        stored_mb, x, y = self.in_flight[c].popleft()
        if stored_mb != mb:
            raise RuntimeError(f"pipeline schedule error: chunk {c} B of microbatch {mb} but the oldest in flight "
                               f"is {stored_mb}")
        with span(self.timeline, "B", microbatch=mb, chunk=c):
            if dy is None and y.dim() != 0:
                raise RuntimeError(f"pipeline schedule error: no output gradient for chunk {c} microbatch {mb}, "
                                   f"which is not the last stage")
            out = _scaled(self.grad_scale_func, y) if dy is None else y
            dx, work = backward_input(out, dy, x, self.params[c], self.store,
                                      accumulate=getattr(self.chunks[c], "fsdp", False))
        self.pending[c].append((mb, work))
        if x is not None and dx is None:
            raise RuntimeError(f"chunk {c} microbatch {mb}: the stage's input received no gradient")
        return dx

    def weight(self, mb: int, c: int) -> None:
        stored_mb, work = self.pending[c].popleft()
        if stored_mb != mb:
            raise RuntimeError(f"pipeline schedule error: chunk {c} W of microbatch {mb} before {stored_mb}")
        if mb == self.M - 1:
            self._no_sync[c].close()  # this chunk's last W: its gradients may now be reduced
        with span(self.timeline, "W", microbatch=mb, chunk=c):
            backward_weight(work)


class _Receives:
    """The list's receives, posted in its order on each link (kind, peer). On gloo (``comm.ahead``) up to
    :data:`~.p2p.RECEIVES_AHEAD` per link are posted ahead of the steps that take them (a gloo send moves only once
    its receive is posted); otherwise each at its ``RECV``."""

    def __init__(self, actions, comm):
        self.comm, self.depth = comm, RECEIVES_AHEAD if getattr(comm, "ahead", False) else 0
        self.unposted: dict[tuple, deque] = {}  # link -> keys (kind, microbatch, chunk) not posted yet, in order
        self.link: dict[tuple, tuple] = {}
        for a in actions:
            if a.op == "RECV":
                key, link = (a.kind, a.microbatch, a.chunk), (a.kind, a.peer)
                self.unposted.setdefault(link, deque()).append(key)
                self.link[key] = link
        self.posted: dict[tuple, tuple] = {}  # key -> (buffer, request)
        self.untaken = dict.fromkeys(self.unposted, 0)  # link -> posted, not taken yet
        for link in self.unposted:
            self._top_up(link)

    def _post_next(self, link) -> None:
        key = self.unposted[link].popleft()
        self.posted[key] = self.comm.irecv(*link, chunk=key[2])  # (its shape: that chunk's stage)
        self.untaken[link] += 1

    def _top_up(self, link) -> None:
        while self.unposted[link] and self.untaken[link] < self.depth:
            self._post_next(link)

    def post(self, key) -> None:
        """The ``RECV`` step: post ``key`` (and those before it on its link) unless posted ahead."""
        while key not in self.posted:
            self._post_next(self.link[key])

    def take(self, key) -> tuple:
        got, link = self.posted.pop(key), self.link[key]
        self.untaken[link] -= 1
        self._top_up(link)
        return got


def _execute(actions, run: _SplitRunner, comm, schedule: str, p: int, r: int) -> None:
    n = p * num_chunks(schedule)
    receives = _Receives(actions, comm)
    inbox: dict[tuple, object] = {}  # (kind, microbatch, local chunk) -> tensor, or None: a posted receive
    outbox: dict[tuple, torch.Tensor] = {}  # (kind, microbatch, local chunk) -> produced, to be sent

    def take(kind, mb, c):
        got = inbox.pop((kind, mb, c))
        if got is None:
            buf, req = receives.take((kind, mb, c))
            with span(run.timeline, f"wait_{kind}", "comm", microbatch=mb, chunk=c):
                req.wait()
            return buf.requires_grad_(True) if kind == "activation" else buf
        return got

    def deliver(kind, mb, to_stage, tensor):
        rank, c = place(schedule, p, to_stage)
        if rank == r:  # the V's turn on rank p-1: no message
            inbox[(kind, mb, c)] = tensor.detach().requires_grad_(True) if kind == "activation" else tensor
        else:
            outbox[(kind, mb, c)] = tensor

    for a in actions:
        s = stage_of(schedule, p, r, a.chunk)
        if a.op == "RECV":
            receives.post((a.kind, a.microbatch, a.chunk))
            inbox[(a.kind, a.microbatch, a.chunk)] = None
        elif a.op == "SEND":
            tensor = outbox.pop((a.kind, a.microbatch, a.chunk))
            comm.isend(tensor, a.kind, a.peer)
            if a.kind == "activation":
                run.deallocate(tensor)  # the send holds the values; the graph is all B needs
        elif a.op == "F":
            x = take("activation", a.microbatch, a.chunk) if s > 0 else None
            y = run.forward(a.microbatch, a.chunk, x)
            if s < n - 1:
                deliver("activation", a.microbatch, s + 1, y)
        elif a.op == "B":
            dy = take("gradient", a.microbatch, a.chunk) if s < n - 1 else None
            dx = run.backward(a.microbatch, a.chunk, dy)
            if s > 0:
                deliver("gradient", a.microbatch, s - 1, dx)
        else:
            run.weight(a.microbatch, a.chunk)
    comm.wait_sends()
    if inbox or outbox:
        raise RuntimeError(f"pipeline schedule error: unused messages {sorted(inbox) + sorted(outbox)}")


def forward_backward_zero_bubble(
        forward_step, data_iterator, model, num_microbatches: int, forward_only: bool = False, *,
        schedule: str = "zb-h1", tensor_shape=None, dtype=torch.float32, timeline=None, p2p=None,
        grad_scale_func=None, parallel=None, per_token_loss: bool = False,
        overlap_p2p_comm: bool = False) -> list[dict]:
    """A zero-bubble schedule (``zb-h1``: one chunk; ``zbv``, ``dualpipev``: two chunks in a V) over this rank's
    chunks. ``forward_only`` runs the forwards in the same order; ``overlap_p2p_comm`` posts each receive one
    compute step ahead. Other arguments as the 1F1B schedule."""
    v = num_chunks(schedule)
    chunks = _as_list(model, v, "model")
    data = _as_list(data_iterator, v, "data_iterator")
    comm = _communicator(p2p, tensor_shape, dtype, chunks, timeline, parallel)
    p, r = comm.pp_size, comm.pp_rank
    holds_loss = place(schedule, p, p * v - 1)[0] == r
    store = WeightGradStore()
    run = _SplitRunner(forward_step, data, chunks, num_microbatches, forward_only, holds_loss, timeline,
                       grad_scale_func, per_token_loss, store=store)
    actions = schedule_actions(schedule, p, num_microbatches)[r]
    if forward_only:
        actions = [a for a in actions if a.op == "F" or (a.op in ("SEND", "RECV") and a.kind == "activation")]
    if overlap_p2p_comm:
        actions = post_receives_early(actions)
    try:
        with attached(chunks, None if forward_only else store), contextlib.ExitStack() as fsdp:
            if not forward_only:  # FSDP2 reduce-scatters once, after the last W
                for chunk in chunks:
                    if getattr(chunk, "fsdp", False):
                        fsdp.enter_context(chunk.reduce_after_split_backward())
            _execute(actions, run, comm, schedule, p, r)
    finally:
        run.close()
    return run.stats
