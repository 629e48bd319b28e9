"""Point-to-point communication between adjacent pipeline ranks.

Activations travel forward (rank r -> r+1) and their gradients backward (r+1 -> r), as tensors of one shape
``(s [/t under sequence parallelism], b, h)`` in the pipeline dtype, but from a standalone MTP stage on (a layout's
``m`` before the loss's stage), whose messages hold ``1 + D`` such blocks along the sequence: each receive is
posted for a local chunk, whose stage gives its shape (:meth:`P2PCommunicator.recv_shape`). Every call posts all of
its sends and receives in one ``torch.distributed.batch_isend_irecv`` and waits for them (on gloo the receives
are posted ahead and waited for at use, the sends at the end, below), which works on gloo (CPU) and NCCL (GPU).

Neighbours form a ring (the first rank's previous is the last): the interleaved schedule sends the last
rank's chunk-c output to the first rank's chunk c+1. With two pipeline ranks the next and previous rank are
the same process, so one batch may carry an activation and a gradient to the same peer. They stay apart
because (a) activations use tag 0 and gradients tag 1 (gloo matches on tags), and (b) every batch lists its
ops in one fixed order — send activation, send gradient, recv activation, recv gradient — so the i-th send
to a peer meets that peer's i-th receive from us even where tags are ignored (NCCL).

On gloo (the CPU backend) a send does not move until its receive is posted, so a rank that posted its receive only
in the exchange that needs it waited for the sender to reach its own exchange, and a sender that waited for its
sends waited for the receiver to reach its. There the schedule announces how many tensors of each kind it will
receive (:meth:`P2PCommunicator.expect`), the communicator keeps the next :data:`RECEIVES_AHEAD` receives of each
kind posted, a received tensor comes back as a :class:`Pending` that the step using it waits for (a
``wait_activation`` / ``wait_gradient`` span on the timeline), and sends are not waited for until the schedule ends
(:meth:`P2PCommunicator.wait_sends`; a finished send is let go at the next one, with its tensor). Each kind is still
received in the schedule's order and the tags keep the kinds apart, so every tensor lands where it did. NCCL, which
matches a link's messages in order without tags, keeps the one batch per exchange.

``overlap`` (``--overlap-p2p-communication``, Megatron's ``overlap_p2p_comm``): each exchange is still posted
as one batch (both directions together, which keeps NCCL's matching safe), but not waited for; a received
tensor comes back as a :class:`Pending`, which the schedule waits for (:func:`arrived`) just before the step that
uses it, and the sends are waited for at the end of the schedule (:meth:`P2PCommunicator.wait_sends`). The
interleaved schedule then posts the forward half of each steady-state exchange before its backward, so the next
activation travels while the backward computes. The timeline shows each wait as a ``wait_activation`` /
``wait_gradient`` span on the p2p row.

Two kinds of methods:

- ``recv_forward``, ``recv_backward``, ``send_forward``, ``send_backward``, ``send_forward_recv_backward``,
  ``send_backward_recv_forward`` (the 1F1B schedule) skip what the pipeline's ends do not do: the first
  stage receives no activation and sends no gradient, the last stage sends no activation and receives no
  gradient; they return ``None`` there.
- ``send_forward_recv_forward``, ``send_backward_recv_backward``,
  ``send_forward_backward_recv_forward_backward`` (the interleaved schedule) do what they are told: a
  ``None`` tensor is not sent, a ``False`` flag receives nothing. The schedule knows which virtual stage is
  first or last.
"""
from __future__ import annotations

from collections import deque

import torch

from .. import comm_log as comm
from .timeline import span

__all__ = ["P2PCommunicator", "Pending", "arrived", "RECEIVES_AHEAD"]

_TAG_ACTIVATION, _TAG_GRADIENT = 0, 1
RECEIVES_AHEAD = 2  # receives of each kind kept posted ahead on gloo (P2PCommunicator.expect)


class Pending:
    """A posted receive: :meth:`wait` returns the tensor (an activation then requires grad)."""

    def __init__(self, buffer: torch.Tensor, requests, kind: str, timeline=None):
        self.buffer, self.requests, self.kind, self.timeline = buffer, list(requests), kind, timeline

    def wait(self) -> torch.Tensor:
        if self.requests:
            with span(self.timeline, f"wait_{self.kind}", "comm"):
                for req in self.requests:
                    req.wait()
            self.requests = []
            if self.kind == "activation":
                self.buffer.requires_grad_(True)
        return self.buffer


def _as_list(x) -> list:
    return list(x) if isinstance(x, list) else [x]


def _finished(req) -> bool:
    """A send that has completed (waited for here, which raises its error if it failed)."""
    if req.is_completed():
        req.wait()
        return True
    return False


def _per_op_requests(group) -> bool:
    """Whether ``group``'s backend is gloo: tags match messages and each op of a batch has its own request."""
    try:
        return torch.distributed.get_backend(group) == "gloo"
    except (RuntimeError, ValueError, AttributeError):  # a stand-in group
        return False


def arrived(x):
    """``x`` itself, or the tensor of a :class:`Pending` receive once it has arrived."""
    return x.wait() if isinstance(x, Pending) else x


class P2PCommunicator:
    """Sends and receives this rank's pipeline tensors over ``parallel``'s pipeline group.

    ``tensor_shape``: ``(s, b, h)`` (``s`` already divided by TP under sequence parallelism and by CP).
    ``timeline``: an optional :class:`~megatronish.parallel.pipeline.timeline.PipelineTimeline`.
    """

    def __init__(self, tensor_shape, dtype=torch.float32, device=None, *, parallel, timeline=None,
                 overlap: bool = False):
        self.tensor_shape = tuple(int(d) for d in tensor_shape)
        if len(self.tensor_shape) != 3:
            raise ValueError(f"pipeline tensors are [s, b, h]; got shape {self.tensor_shape}")
        self.dtype = dtype
        if device is None:
            from ... import device as _device

            device = _device.current_device()
        self.device = torch.device(device)
        self.group = parallel.pp_group
        self.dims = parallel.dims  # which stage a local chunk is, and how many sequence blocks its messages carry
        self.pp_rank, self.pp_size = parallel.pp_rank, parallel.pp_size
        self.next_rank, self.prev_rank = parallel.next_pp_rank, parallel.prev_pp_rank
        self.timeline = timeline
        self.overlap, self._sends = overlap, []  # overlap: receives come back Pending
        # Receives posted ahead (gloo: tags keep the two directions apart, every op has its own request): per kind,
        # the requests posted, oldest first, and how many more this iteration will take (see expect()).
        self.ahead = _per_op_requests(self.group)
        self._posted = {"activation": deque(), "gradient": deque()}
        self._to_post = {"activation": deque(), "gradient": deque()}  # the receiving local chunks, in order
        self._ensure_ready(parallel.p2p_ready)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def _ensure_ready(self, ready: set) -> None:
        # NCCL wants the first op on a group that batches p2p to involve every member: run one collective,
        # once per group (``ready`` lives on the parallel context).
        if self.pp_size == 1 or id(self.group) in ready:
            return
        comm.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        ready.add(id(self.group))

    # ---- the one transport -------------------------------------------------------------------------------
    def recv_shape(self, kind: str, chunk: int = 0) -> tuple[int, int, int]:
        """Shape of an ``activation`` (``gradient``) received for local ``chunk``: the pipeline tensor shape with
        as many sequence blocks as the previous (this) stage's output carries (``ParallelDims.stage_message_blocks``:
        ``1 + D`` from a standalone MTP stage on, else 1)."""
        stage = self.dims.stage_of(self.pp_rank, chunk) - (kind == "activation")
        s, b, h = self.tensor_shape
        return s * self.dims.stage_message_blocks(stage), b, h

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        s, b, h = self.tensor_shape
        if tuple(t.shape) not in {(s, b, h), (s * self.dims.message_blocks, b, h)}:  # (a standalone MTP stage's)
            raise ValueError(f"pipeline {what} has shape {tuple(t.shape)} but the pipeline tensor shape is "
                             f"{self.tensor_shape} ([seq / (TP under sequence parallelism) / CP, micro batch, "
                             f"hidden]); every stage must output [s, b, h] of that shape")
        if t.dtype != self.dtype:
            raise ValueError(f"pipeline {what} has dtype {t.dtype} but the pipeline dtype is {self.dtype}; "
                             f"build the communicator with the model's activation dtype")
        return t.detach().contiguous()

    def expect(self, activations, gradients) -> None:
        """This iteration receives ``activations`` from the previous rank and ``gradients`` from the next (each a
        count, for local chunk 0, or the receiving local chunks in arrival order): on gloo the first
        :data:`RECEIVES_AHEAD` of each are posted now, and each receive taken posts the next, so a message moves
        as soon as it is sent (a gloo send waits for its receive to be posted) and no rank waits for the other end
        of an exchange to reach it. Each kind is received in the schedule's order, so every message still lands
        where it did."""
        if not self.ahead:
            return
        if any(self._posted.values()) or any(self._to_post.values()):
            raise RuntimeError("pipeline schedule error: receives left posted from the previous iteration")
        self._to_post = {kind: deque([0] * n if isinstance(n, int) else n)
                         for kind, n in (("activation", activations), ("gradient", gradients))}
        for kind in self._posted:
            self._post_ahead(kind)

    def _post_ahead(self, kind: str) -> None:
        posted = self._posted[kind]
        while self._to_post[kind] and len(posted) < RECEIVES_AHEAD:
            buf = torch.empty(self.recv_shape(kind, self._to_post[kind].popleft()), dtype=self.dtype,
                              device=self.device)
            peer, tag = (self.prev_rank, _TAG_ACTIVATION) if kind == "activation" else (self.next_rank, _TAG_GRADIENT)
            req, = comm.batch_isend_irecv([comm.P2POp(comm.IRECV, buf, peer, self.group, tag)])
            posted.append(Pending(buf, [req], kind, self.timeline))

    def _take(self, kind: str) -> Pending:
        posted = self._posted[kind]
        if not posted:
            raise RuntimeError(f"pipeline schedule error: one {kind} received more than expect() announced")
        got = posted.popleft()
        self._post_ahead(kind)
        return got

    def _sends_of(self, send_next, send_prev) -> list:
        """The send ops of one exchange: activation first, then gradient (the module docstring's order)."""
        ops = []
        if send_next is not None:
            ops.append(comm.P2POp(comm.ISEND, self._check(send_next, "activation"), self.next_rank, self.group,
                                  _TAG_ACTIVATION))
        if send_prev is not None:
            ops.append(comm.P2POp(comm.ISEND, self._check(send_prev, "gradient"), self.prev_rank, self.group,
                                  _TAG_GRADIENT))
        return ops

    def _communicate(self, name: str, send_next=None, send_prev=None, recv_prev: bool = False,
                     recv_next: bool = False, prev_chunk: int = 0, next_chunk: int = 0):
        """One exchange: ``(received from prev, received from next)``. On gloo :meth:`_exchange_ahead`; otherwise
        every send/recv posted in one batch (fixed order, see the module docstring) and waited for (``overlap``:
        the receives come back :class:`Pending`, the sends are waited for in :meth:`wait_sends`). ``prev_chunk``
        / ``next_chunk``: the local chunks the received activation / gradient are for (their shapes)."""
        if self.ahead:
            return self._exchange_ahead(name, send_next, send_prev, recv_prev, recv_next)
        ops, from_prev, from_next = self._sends_of(send_next, send_prev), None, None
        if recv_prev:
            from_prev = torch.empty(self.recv_shape("activation", prev_chunk), dtype=self.dtype, device=self.device)
            ops.append(comm.P2POp(comm.IRECV, from_prev, self.prev_rank, self.group, _TAG_ACTIVATION))
        if recv_next:
            from_next = torch.empty(self.recv_shape("gradient", next_chunk), dtype=self.dtype, device=self.device)
            ops.append(comm.P2POp(comm.IRECV, from_next, self.next_rank, self.group, _TAG_GRADIENT))
        if ops and self.overlap:
            with span(self.timeline, name, "comm"):
                reqs = comm.batch_isend_irecv(ops)
            sends = len(ops) - (from_prev is not None) - (from_next is not None)
            self._sends += reqs[:sends]
            mine = iter(reqs[sends:])
            if len(reqs) != len(ops):  # NCCL coalesces a batch into one request: the receives wait for it
                self._sends += reqs
                mine = iter([reqs] * 2)
            if from_prev is not None:
                from_prev = Pending(from_prev, _as_list(next(mine)), "activation", self.timeline)
            if from_next is not None:
                from_next = Pending(from_next, _as_list(next(mine)), "gradient", self.timeline)
            return from_prev, from_next
        if ops:
            with span(self.timeline, name, "comm"):
                for req in comm.batch_isend_irecv(ops):
                    req.wait()
        if from_prev is not None:
            from_prev.requires_grad_(True)  # the next chunk's input: backward leaves its gradient in .grad
        return from_prev, from_next

    def _exchange_ahead(self, name, send_next, send_prev, recv_prev, recv_next):
        """gloo: the sends posted and not waited for (:meth:`wait_sends`); the receives are those posted ahead, each
        a :class:`Pending` that the step using it waits for (:func:`arrived`), with or without ``overlap``."""
        ops = self._sends_of(send_next, send_prev)
        from_prev = self._take("activation") if recv_prev else None
        from_next = self._take("gradient") if recv_next else None
        if ops:
            with span(self.timeline, name, "comm"):
                self._sends = [req for req in self._sends if not _finished(req)] + comm.batch_isend_irecv(ops)
        return from_prev, from_next

    def wait_sends(self) -> None:
        """Wait for the sends still in flight; on gloo also check that every receive posted ahead was taken
        (called once the schedule has run)."""
        with span(self.timeline, "wait_sends", "comm") if self._sends else span(None, ""):
            for req in self._sends:
                req.wait()
        self._sends = []
        if self.ahead and (any(self._posted.values()) or any(self._to_post.values())):
            left = {k: len(self._posted[k]) + len(self._to_post[k]) for k in self._posted}
            self._posted = {k: deque() for k in self._posted}
            self._to_post = {k: deque() for k in self._to_post}
            raise RuntimeError(f"pipeline schedule error: receives announced but not taken: {left}")

    # ---- 1F1B (pipeline ends skipped) --------------------------------------------------------------------
    def recv_forward(self, chunk: int = 0):
        """Activation from the previous stage (``None`` on the first stage); ``chunk``: the local chunk it is for
        (the interleaved schedule)."""
        return None if self.is_first_stage else self._communicate("recv_forward", recv_prev=True,
                                                                  prev_chunk=chunk)[0]

    def recv_backward(self, chunk: int = 0):
        """Gradient from the next stage (``None`` on the last stage)."""
        return None if self.is_last_stage else self._communicate("recv_backward", recv_next=True,
                                                                 next_chunk=chunk)[1]

    def send_forward(self, output) -> None:
        if not self.is_last_stage and output is not None:
            self._communicate("send_forward", send_next=output)

    def send_backward(self, input_grad) -> None:
        if not self.is_first_stage and input_grad is not None:
            self._communicate("send_backward", send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        """Send an activation on, receive the gradient of an earlier one (``None`` on the last stage)."""
        if self.is_last_stage:
            return None
        return self._communicate("send_forward_recv_backward", send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        """Send a gradient back, receive the next activation (``None`` on the first stage)."""
        if self.is_first_stage:
            return None
        return self._communicate("send_backward_recv_forward", send_prev=input_grad, recv_prev=True)[0]

    # ---- interleaved (the schedule decides what is sent and received) ------------------------------------
    def send_forward_recv_forward(self, output, recv_prev: bool, chunk: int = 0):
        return self._communicate("send_forward_recv_forward", send_next=output, recv_prev=recv_prev,
                                 prev_chunk=chunk)[0]

    def send_backward_recv_backward(self, input_grad, recv_next: bool, chunk: int = 0):
        return self._communicate("send_backward_recv_backward", send_prev=input_grad, recv_next=recv_next,
                                 next_chunk=chunk)[1]

    def send_forward_backward_recv_forward_backward(self, output, input_grad, recv_prev: bool, recv_next: bool,
                                                    prev_chunk: int = 0, next_chunk: int = 0):
        """Returns ``(activation from prev, gradient from next)``; ``prev_chunk`` / ``next_chunk``: the local
        chunks they are for."""
        return self._communicate("send_forward_backward_recv_forward_backward", send_next=output,
                                 send_prev=input_grad, recv_prev=recv_prev, recv_next=recv_next,
                                 prev_chunk=prev_chunk, next_chunk=next_chunk)

    # ---- single asynchronous messages (the zero-bubble schedules' action lists) ------------------------------
    def _peer(self, pp_peer: int) -> int:
        if pp_peer == (self.pp_rank + 1) % self.pp_size:
            return self.next_rank
        if pp_peer == (self.pp_rank - 1) % self.pp_size:
            return self.prev_rank
        raise ValueError(f"pipeline rank {self.pp_rank} has no link to pipeline rank {pp_peer}")

    def isend(self, tensor, kind: str, pp_peer: int) -> None:
        """Post the send of an ``activation`` or ``gradient`` to adjacent pipeline rank ``pp_peer``, not waited for
        (:meth:`wait_sends`; sends already done are let go at each send, and with them their tensors)."""
        tag = _TAG_ACTIVATION if kind == "activation" else _TAG_GRADIENT
        op = comm.P2POp(comm.ISEND, self._check(tensor, kind), self._peer(pp_peer), self.group, tag)
        self._sends = [req for req in self._sends if not _finished(req)] + comm.batch_isend_irecv([op])

    def irecv(self, kind: str, pp_peer: int, chunk: int = 0):
        """Post the receive of an ``activation`` or ``gradient`` from ``pp_peer`` for local ``chunk``:
        ``(tensor, request)``."""
        buf = torch.empty(self.recv_shape(kind, chunk), dtype=self.dtype, device=self.device)
        tag = _TAG_ACTIVATION if kind == "activation" else _TAG_GRADIENT
        op = comm.P2POp(comm.IRECV, buf, self._peer(pp_peer), self.group, tag)
        return buf, comm.batch_isend_irecv([op])[0]

