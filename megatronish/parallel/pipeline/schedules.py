"""Forward/backward schedules over the microbatches of one iteration.

A schedule calls ``forward_step(data_iterator, model) -> (output, loss_func)`` per microbatch, where
``loss_func(output) -> (loss, stats)`` gives the microbatch's scalar loss and a dict of detached statistics
for logging. The backward of ``loss / num_microbatches`` accumulates gradients, so the iteration's
gradient is the mean over microbatches (Megatron's semantics). Returns the list of ``stats`` dicts (on the
last pipeline stage; ``[]`` on the others).

Three schedules, picked by :func:`get_forward_backward_func`:

- :func:`forward_backward_no_pipelining`: every microbatch's forward and backward on this rank.
- :func:`forward_backward_pipelining_without_interleaving` (1F1B): rank ``r`` of ``p`` runs ``min(p-r-1, M)``
  warm-up forwards, then alternates one forward / one backward, then drains the warm-up's backwards.
  Bubble ``(p-1)/M`` of the ideal time; at most ``warm-up + 1`` microbatches hold activations.
- :func:`forward_backward_pipelining_with_interleaving`: ``v`` model chunks per rank (virtual stages);
  ``M*v`` virtual microbatches, ``(p-r-1)*2 + (v-1)*p`` warm-up forwards, microbatches taken in groups of
  ``p`` per chunk (Megatron's table); bubble ``(p-1)/(v*M)``.

Each pipelined schedule is one function with three commented phases (``_one_f_one_b``, ``_interleaved_1f1b``)
written against two small interfaces: a *runner* (forward / backward of one microbatch on one chunk) and a
*communicator* (:class:`~megatronish.parallel.pipeline.p2p.P2PCommunicator`). Run with the real ones they
train; run with recording stand-ins they produce the exact order of work and messages without processes
(:func:`schedule_trace`, :func:`schedule_table`), which the tests compare against Megatron's rules.

Memory: once an activation has been sent on, only its autograd graph is needed, so its storage is replaced
by a 1-element tensor (:func:`deallocate_output_tensor`) and the backward later runs through the autograd
engine directly (:func:`custom_backward`), which does not compare the gradient's shape with the output's.
Data-parallel gradient reduction is switched off (``no_sync()``) for every chunk and switched back on just
before that chunk's last backward, so each chunk reduces once, overlapped with the remaining backwards.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch

from ..dims import DegreeError
from .p2p import arrived
from .timeline import span

__all__ = [
    "forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving", "get_forward_backward_func", "check_interleaving",
    "warmup_1f1b", "warmup_interleaved", "forward_chunk_id", "backward_chunk_id", "microbatch_id",
    "schedule_table", "schedule_trace", "deallocate_output_tensor", "custom_backward", "pipeline_tensor_shape",
]


# ============================================================================ no pipelining
def forward_backward_no_pipelining(forward_step, data_iterator, model, num_microbatches: int,
                                   forward_only: bool = False, *, timeline=None, grad_scale_func=None,
                                   per_token_loss: bool = False, **_pipeline_kwargs) -> list[dict]:
    """All microbatches on this rank, one after the other. The data-parallel gradient reduction is
    disabled (``model.no_sync()``) for all but the last microbatch, whose backward launches it.

    ``model``/``data_iterator`` may be one-element lists (the pipelined schedules' form). The pipelined
    schedules' keywords (``tensor_shape``, ``dtype``) are accepted and ignored, so
    :func:`get_forward_backward_func`'s result is called the same way for every layout.
    ``grad_scale_func(loss) -> loss`` (every schedule): applied to the loss before its backward (the fp16
    loss scale; Megatron's ``config.grad_scale_func``). ``per_token_loss`` (every schedule;
    ``--calculate-per-token-loss``): the microbatch losses are token sums, back-propagated as they are (not divided
    by the number of microbatches); the caller divides the gradients by the global batch's token count.
    """
    if isinstance(model, (list, tuple)):
        model = _single(model, "model")
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = _single(data_iterator, "data_iterator")
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    stats = []

    def step(mb: int):
        with span(timeline, "F", microbatch=mb, chunk=0):
            output, loss_func = forward_step(data_iterator, model)
            loss, s = loss_func(output)
        if not forward_only:
            with span(timeline, "B", microbatch=mb, chunk=0):
                _scaled(grad_scale_func, loss if per_token_loss else loss / num_microbatches).backward()
        stats.append(s)

    with no_sync():  # accumulation microbatches: gradients stay local
        for mb in range(num_microbatches - 1):
            step(mb)
    step(num_microbatches - 1)  # the last microbatch: its backward reduces the gradients (overlapped per bucket)
    return stats


def _scaled(grad_scale_func, loss):
    return loss if grad_scale_func is None else grad_scale_func(loss)


def _single(items, what: str):
    if len(items) != 1:
        raise ValueError(f"this schedule takes one model chunk, got {len(items)} in {what}; use the interleaved "
                         f"schedule for virtual pipeline stages")
    return items[0]


# ============================================================================ schedule arithmetic (pure)
def warmup_1f1b(p: int, r: int, num_microbatches: int) -> int:
    """1F1B warm-up forwards on pipeline rank ``r`` of ``p``: ``min(p - r - 1, M)``."""
    return min(p - r - 1, num_microbatches)


def warmup_interleaved(p: int, r: int, num_microbatches: int, v: int, forward_only: bool = False) -> int:
    """Interleaved warm-up (virtual) forwards: ``(p - r - 1)*2 + (v - 1)*p``, capped at ``M*v`` (all of them
    when ``forward_only``)."""
    total = num_microbatches * v
    if forward_only:
        return total
    return min((p - r - 1) * 2 + (v - 1) * p, total)


def forward_chunk_id(k: int, p: int, v: int) -> int:
    """Chunk of the ``k``-th virtual forward: microbatches go in groups of ``p`` through chunk 0, then the same
    group through chunk 1, ... (``k`` may be negative: Python's modulo, as Megatron)."""
    return (k % (p * v)) // p


def backward_chunk_id(k: int, p: int, v: int) -> int:
    """Chunk of the ``k``-th virtual backward: the forward table read from the last chunk down."""
    return v - 1 - forward_chunk_id(k, p, v)


def microbatch_id(k: int, p: int, v: int) -> int:
    """Microbatch of the ``k``-th virtual forward (or backward): group ``k // (p*v)``, position ``k % p``."""
    return (k // (p * v)) * p + k % p


def check_interleaving(p: int, v: int, num_microbatches: int) -> None:
    """Raise :class:`~megatronish.parallel.dims.DegreeError` (numbers only; ``parallel_config.check_interleaving``
    names the flags) unless the interleaved schedule can run ``num_microbatches`` on ``p`` ranks."""
    if num_microbatches % p:
        raise DegreeError("interleaving", f"the interleaved schedule (vp {v}) needs the microbatches per iteration "
                          f"({num_microbatches}) to be a multiple of pp {p}", pp=p, vp=v,
                          num_microbatches=num_microbatches)


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, *, tp: int = 1, cp: int = 1,
                          sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the tensors passed between stages: ``(s/cp [/tp under sequence parallelism], b, h)``."""
    s = seq_length // cp
    if sequence_parallel:  # resolved: RunConfig.sequence_parallel
        s //= tp
    return (s, micro_batch_size, hidden_size)


# ============================================================================ the two pipelined schedules
def _one_f_one_b(run, p2p, num_microbatches: int, forward_only: bool) -> None:
    """1F1B on one chunk. ``run.forward(mb, chunk, input) -> output to send (None on the last stage)``;
    ``run.backward(mb, chunk, output_grad) -> input grad to send (None on the first stage)``."""
    p, r, M = p2p.pp_size, p2p.pp_rank, num_microbatches
    num_warmup = warmup_1f1b(p, r, M)
    num_steady = M - num_warmup
    next_fwd = next_bwd = 0  # microbatch ids: forwards and backwards each run in order 0..M-1
    p2p.expect(activations=0 if r == 0 else M, gradients=0 if r == p - 1 or forward_only else M)

    # ---- warm-up: forwards only. Rank r runs p-r-1 ahead, so that the last rank can start 1F1B at once.
    for _ in range(num_warmup):
        x = p2p.recv_forward()
        y = run.forward(next_fwd, 0, x)
        next_fwd += 1
        p2p.send_forward(y)
        run.deallocate(y)  # keep only y's autograd graph

    # ---- steady state: one forward, then the backward of the oldest microbatch in flight.
    x = p2p.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        y = run.forward(next_fwd, 0, x)
        next_fwd += 1
        if forward_only:
            p2p.send_forward(y)
            if not last:
                x = p2p.recv_forward()
            continue
        dy = p2p.send_forward_recv_backward(y)
        run.deallocate(y)
        dx = run.backward(next_bwd, 0, dy)
        next_bwd += 1
        if last:
            p2p.send_backward(dx)
        else:
            x = p2p.send_backward_recv_forward(dx)

    # ---- cool-down: the backwards of the warm-up's microbatches.
    if not forward_only:
        for _ in range(num_warmup):
            dy = p2p.recv_backward()
            dx = run.backward(next_bwd, 0, dy)
            next_bwd += 1
            p2p.send_backward(dx)


def _interleaved_1f1b(run, p2p, num_microbatches: int, v: int, forward_only: bool) -> None:
    """Interleaved 1F1B over ``v`` chunks. Virtual microbatch ``k`` is (``microbatch_id(k)``,
    ``forward_chunk_id(k)``) going forward and (``microbatch_id(k)``, ``backward_chunk_id(k)``) going back.

    Chunk c of rank r feeds chunk c of rank r+1, and the last rank's chunk c feeds the first rank's chunk c+1
    (the ring). Received tensors wait in per-chunk queues until their chunk runs.
    """
    p, r, M = p2p.pp_size, p2p.pp_rank, num_microbatches
    total = M * v
    num_warmup = warmup_interleaved(p, r, M, v, forward_only)
    all_warmup = num_warmup == total
    num_steady = total - num_warmup
    first_rank, last_rank = r == 0, r == p - 1
    # every forward but global stage 0's receives its input, every backward but the last global stage's its gradient,
    # in the order the neighbour sends them (chunk c of rank r-1 feeds chunk c, the last rank's chunk c the first's c+1)
    fwd = [forward_chunk_id(k, p, v) for k in range(total)]
    bwd = [backward_chunk_id(k, p, v) for k in range(total)]
    p2p.expect(activations=[c + 1 for c in fwd if c < v - 1] if first_rank else fwd,
               gradients=[] if forward_only else [c - 1 for c in bwd if c > 0] if last_rank else bwd)
    inputs = [deque() for _ in range(v)]  # activations received, waiting for their chunk's forward
    grads = [deque() for _ in range(v)]  # gradients received, waiting for their chunk's backward

    def forward(k):
        mb, c = microbatch_id(k, p, v), forward_chunk_id(k, p, v)
        x = None if (first_rank and c == 0) else inputs[c].popleft()  # global stage 0 reads the data
        return run.forward(mb, c, x)

    def backward(k):
        mb, c = microbatch_id(k, p, v), backward_chunk_id(k, p, v)
        dy = None if (last_rank and c == v - 1) else grads[c].popleft()  # the last global stage has the loss
        return run.backward(mb, c, dy)

    # ---- warm-up: forwards only; every rank runs (v-1)*p, earlier ranks 2 more per step from the end.
    if not first_rank:
        inputs[0].append(p2p.recv_forward())
    for k in range(num_warmup):
        y = forward(k)
        next_c = forward_chunk_id(k + 1, p, v)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        if k == num_warmup - 1 and not all_warmup:
            # the last warm-up step also receives the gradient for the first steady backward (chunk v-1)
            recv_next = not last_rank
            x, dy = p2p.send_forward_backward_recv_forward_backward(y, None, recv_prev, recv_next, next_c, v - 1)
            if recv_next:
                grads[v - 1].append(dy)
        else:
            x = p2p.send_forward_recv_forward(y, recv_prev, next_c)
        if recv_prev:
            inputs[next_c].append(x)
        run.deallocate(y)

    # ---- steady state: forward of virtual microbatch k + warm-up, backward of k, one exchange for both
    # (overlapped: the forward half is posted before the backward runs, the backward half after it).
    overlap = getattr(p2p, "overlap", False)
    for k in range(num_steady):
        fk = k + num_warmup
        y = forward(fk)
        dx = None if overlap else backward(k)
        # Which chunk the next received activation belongs to. The first rank is p-1 virtual microbatches
        # ahead of the last, so what arrives now is the last rank's output of virtual forward fk-(p-1)
        # (none if that was the last chunk: the loss is not sent).
        recv_prev = True
        if first_rank:
            from_c = forward_chunk_id(fk - (p - 1), p, v)
            recv_prev = from_c != v - 1
            next_fc = from_c + 1
        else:
            next_fc = forward_chunk_id(fk + 1, p, v)
        # Likewise for gradients: the last rank trails the first by p-1 virtual backwards.
        recv_next = True
        if last_rank:
            from_c = backward_chunk_id(k - (p - 1), p, v)
            recv_next = from_c != 0
            next_bc = from_c - 1
        else:
            next_bc = backward_chunk_id(k + 1, p, v)
        if k == num_steady - 1:
            recv_prev = False  # every forward has run
        if overlap:
            x = p2p.send_forward_recv_forward(y, recv_prev, next_fc)
            run.deallocate(y)
            dy = p2p.send_backward_recv_backward(backward(k), recv_next, next_bc)
        else:
            x, dy = p2p.send_forward_backward_recv_forward_backward(y, dx, recv_prev, recv_next, next_fc, next_bc)
            run.deallocate(y)
        if recv_prev:
            inputs[next_fc].append(x)
        if recv_next:
            grads[next_bc].append(dy)

    # ---- cool-down: the remaining backwards.
    if not forward_only:
        if all_warmup and not last_rank:
            grads[v - 1].append(p2p.recv_backward(v - 1))
        for k in range(num_steady, total):
            dx = backward(k)
            next_bc = backward_chunk_id(k + 1, p, v)
            recv_next = not (last_rank and next_bc == v - 1) and k != total - 1
            dy = p2p.send_backward_recv_backward(dx, recv_next, next_bc)
            if recv_next:
                grads[next_bc].append(dy)


# ============================================================================ real execution
def deallocate_output_tensor(out) -> None:
    """Free an activation's storage once sent, keeping its autograd graph (``.data`` -> 1 element).

    A view (``out._base`` set) shares its base's storage, so there is nothing to free and it is left alone.
    """
    if isinstance(out, torch.Tensor) and out._base is None and out.numel() > 1:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backpropagate ``grad_output`` from ``output`` through the C++ autograd engine directly.

    ``torch.autograd.backward`` checks that the gradient's shape matches the output's, which a deallocated
    output (1-element ``.data``) fails; the graph itself does not need the output's values.
    """
    if output.grad_fn is None:
        raise RuntimeError("pipeline stage output has no autograd graph (was the forward run under no_grad?)")
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _Runner:
    """Forward / backward of one microbatch on one chunk, with what must live until its backward."""

    def __init__(self, forward_step, data_iterators, chunks, num_microbatches, forward_only, last_rank, timeline,
                 grad_scale_func=None, per_token_loss=False):
        self.forward_step, self.data, self.chunks = forward_step, data_iterators, chunks
        self.grad_scale_func = grad_scale_func
        self.loss_divisor = 1 if per_token_loss else num_microbatches
        self.M, self.forward_only, self.timeline = num_microbatches, forward_only, timeline
        self.v = len(chunks)
        self.last_rank = last_rank
        self.stats: list[dict] = []
        self.in_flight = [deque() for _ in chunks]  # per chunk: (microbatch, input, output), oldest first
        # DP gradient reduction off until each chunk's last backward (see enable_grad_sync).
        self._no_sync = [contextlib.ExitStack() for _ in chunks]
        if not forward_only:
            for stack, chunk in zip(self._no_sync, chunks):
                if hasattr(chunk, "no_sync"):
                    stack.enter_context(chunk.no_sync())

    def forward(self, mb: int, c: int, x):
        x = arrived(x)  # a receive posted ahead (gloo, --overlap-p2p-communication) is waited for here
        chunk = self.chunks[c]
        if hasattr(chunk, "set_input_tensor"):
            chunk.set_input_tensor(x)
        with span(self.timeline, "F", microbatch=mb, chunk=c):
            y, loss_func = self.forward_step(self.data[c], chunk)
            to_send = y
            if self.last_rank and c == self.v - 1:  # the last global stage: the loss, nothing to send
                loss, stats = loss_func(y)
                self.stats.append(stats)
                y, to_send = loss / self.loss_divisor, None
        if not self.forward_only:
            self.in_flight[c].append((mb, x, y))
        return to_send

    def backward(self, mb: int, c: int, dy):
        dy = arrived(dy)
        stored_mb, x, y = self.in_flight[c].popleft()
        if stored_mb != mb:
            raise RuntimeError(f"pipeline schedule error: chunk {c} backward of microbatch {mb} but the oldest "
                               f"in flight is {stored_mb}")
        if mb == self.M - 1:
            self._no_sync[c].close()  # this chunk's last backward: its gradients may now be reduced
        with span(self.timeline, "B", microbatch=mb, chunk=c):
            if dy is None:
                if y.dim() != 0:
                    raise RuntimeError(f"pipeline schedule error: no output gradient for chunk {c} microbatch "
                                       f"{mb}, which is not the last stage")
                torch.autograd.backward(_scaled(self.grad_scale_func, y))
            else:
                custom_backward(y, dy)
        if x is None:
            return None
        if x.grad is None:
            raise RuntimeError(f"chunk {c} microbatch {mb}: the stage's input received no gradient; the chunk's "
                               f"output must depend on the input set by set_input_tensor()")
        return x.grad

    def deallocate(self, y) -> None:
        if not self.forward_only:
            deallocate_output_tensor(y)

    def close(self) -> None:
        for stack in self._no_sync:
            stack.close()


def _as_list(x, n: int, what: str) -> list:
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(items) != n:
        raise ValueError(f"{what}: expected {n} (one per model chunk), got {len(items)}")
    return items


def _device_of(chunks):
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    return None


def _communicator(p2p, tensor_shape, dtype, chunks, timeline, parallel, overlap=False):
    if p2p is not None:
        return p2p
    if tensor_shape is None or parallel is None:
        raise ValueError("pipelined schedules need tensor_shape=(s [/tp under sequence parallelism], "
                         "micro batch, hidden) (see pipeline_tensor_shape()) and parallel= the run's "
                         "ParallelContext, or a p2p communicator")
    from .p2p import P2PCommunicator

    return P2PCommunicator(tensor_shape, dtype, _device_of(chunks), parallel=parallel, timeline=timeline,
                           overlap=overlap)


def forward_backward_pipelining_without_interleaving(
        forward_step, data_iterator, model, num_microbatches: int, forward_only: bool = False, *,
        tensor_shape=None, dtype=torch.float32, timeline=None, p2p=None, grad_scale_func=None,
        parallel=None, per_token_loss: bool = False, overlap_p2p_comm: bool = False) -> list[dict]:
    """1F1B over this rank's one chunk (``model``: a module or a one-element list). ``overlap_p2p_comm`` is
    accepted and ignored, as in Megatron-LM (1F1B waits for each exchange).

    ``tensor_shape``: ``(s [/t under SP], b, h)`` of the tensors between stages; ``dtype`` their dtype;
    ``timeline``: optional :class:`~megatronish.parallel.pipeline.timeline.PipelineTimeline`; ``parallel``: the
    run's :class:`~megatronish.parallel.context.ParallelContext` (its pipeline group); ``p2p``: a communicator
    to use instead of building one. Returns the loss stats (last stage; ``[]`` elsewhere).
    """
    chunks = _as_list(model, 1, "model")
    data = _as_list(data_iterator, 1, "data_iterator")
    comm = _communicator(p2p, tensor_shape, dtype, chunks, timeline, parallel)
    run = _Runner(forward_step, data, chunks, num_microbatches, forward_only, comm.is_last_stage, timeline,
                  grad_scale_func, per_token_loss)
    try:
        _one_f_one_b(run, comm, num_microbatches, forward_only)
        comm.wait_sends()
    finally:
        run.close()
    return run.stats


def forward_backward_pipelining_with_interleaving(
        forward_step, data_iterator, model, num_microbatches: int, forward_only: bool = False, *,
        tensor_shape=None, dtype=torch.float32, timeline=None, p2p=None, grad_scale_func=None,
        parallel=None, per_token_loss: bool = False, overlap_p2p_comm: bool = False) -> list[dict]:
    """Interleaved 1F1B over this rank's ``v`` chunks (``model``: list of chunks, ``data_iterator``: list of one
    iterator per chunk; each chunk reads microbatches 0..M-1 in order). ``num_microbatches`` must be a
    multiple of the pipeline size. ``overlap_p2p_comm``: receives posted ahead, waited for when used
    (:class:`~.p2p.P2PCommunicator`'s ``overlap``). Other arguments as the non-interleaved schedule."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    data = _as_list(data_iterator, len(chunks), "data_iterator")
    comm = _communicator(p2p, tensor_shape, dtype, chunks, timeline, parallel, overlap_p2p_comm)
    check_interleaving(comm.pp_size, len(chunks), num_microbatches)
    run = _Runner(forward_step, data, chunks, num_microbatches, forward_only, comm.is_last_stage, timeline,
                  grad_scale_func, per_token_loss)
    try:
        _interleaved_1f1b(run, comm, num_microbatches, len(chunks), forward_only)
        comm.wait_sends()
    finally:
        run.close()
    return run.stats


def get_forward_backward_func(pp: int, vp: int = 1):
    """The schedule for ``pp`` pipeline ranks with ``vp`` virtual stages each (Megatron's choice)."""
    if pp > 1:
        return forward_backward_pipelining_with_interleaving if vp > 1 \
            else forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


# ============================================================================ dry run (no processes)
class _TraceRunner:
    """Stands in for :class:`_Runner`: records each step; outputs are tokens naming what they are."""

    def __init__(self, p, r, v, ops):
        self.p, self.r, self.v, self.ops = p, r, v, ops

    def forward(self, mb, c, x):
        self.ops.append({"op": "F", "microbatch": mb, "chunk": c, "input": x})
        if self.r == self.p - 1 and c == self.v - 1:
            return None
        return ("activation", self.r, mb, c)

    def backward(self, mb, c, dy):
        self.ops.append({"op": "B", "microbatch": mb, "chunk": c, "output_grad": dy})
        if self.r == 0 and c == 0:
            return None
        return ("gradient", self.r, mb, c)

    def deallocate(self, y):
        pass


def _trace_communicator(p: int, r: int, ops: list):
    from .p2p import P2PCommunicator

    class _TraceP2P(P2PCommunicator):
        """The real communicator's methods over a recording transport: the i-th activation received from
        the previous rank is the token ``("recv_activation", r, i)``, likewise ``("recv_gradient", r, i)``."""

        def __init__(self):  # no process groups
            self.pp_size, self.pp_rank, self.timeline, self.ahead = p, r, None, False
            self._received = {"activation": 0, "gradient": 0}

        def _token(self, kind):
            i = self._received[kind]
            self._received[kind] += 1
            return (f"recv_{kind}", r, i)

        def _communicate(self, name, send_next=None, send_prev=None, recv_prev=False, recv_next=False, **chunks):
            from_prev = self._token("activation") if recv_prev else None
            from_next = self._token("gradient") if recv_next else None
            if send_next is not None or send_prev is not None or recv_prev or recv_next:
                ops.append({"op": "comm", "name": name, "send_next": send_next, "send_prev": send_prev,
                            "recv_prev": from_prev, "recv_next": from_next})
            return from_prev, from_next

    return _TraceP2P()


def schedule_trace(p: int, v: int, num_microbatches: int, rank: int, forward_only: bool = False) -> list[dict]:
    """Everything pipeline rank ``rank`` of ``p`` does in one iteration, in order, by running the schedule
    (``v == 1``: 1F1B; ``v > 1``: interleaved) on recording stand-ins. Steps are dicts:

    - ``{"op": "F", "microbatch", "chunk", "input"}`` / ``{"op": "B", "microbatch", "chunk", "output_grad"}``,
      where ``input``/``output_grad`` is the token of the received tensor used (None: none);
    - ``{"op": "comm", "name", "send_next", "send_prev", "recv_prev", "recv_next"}``: one batched exchange;
      sends are tokens ``("activation"|"gradient", rank, microbatch, chunk)``, receives are tokens
      ``("recv_activation"|"recv_gradient", rank, i)`` (the i-th of that kind on this rank), or None.
    """
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} out of range [0, {p})")
    ops: list[dict] = []
    run, comm = _TraceRunner(p, rank, v, ops), _trace_communicator(p, rank, ops)
    if v == 1:
        _one_f_one_b(run, comm, num_microbatches, forward_only)
    else:
        check_interleaving(p, v, num_microbatches)
        _interleaved_1f1b(run, comm, num_microbatches, v, forward_only)
    return ops


def schedule_table(p: int, v: int, num_microbatches: int, rank: int,
                   forward_only: bool = False) -> list[tuple[str, int, int]]:
    """The ordered ``("F"|"B", microbatch, chunk)`` steps of pipeline rank ``rank`` (see :func:`schedule_trace`)."""
    return [(s["op"], s["microbatch"], s["chunk"]) for s in schedule_trace(p, v, num_microbatches, rank, forward_only)
            if s["op"] != "comm"]
