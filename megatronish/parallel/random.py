"""Megatron's RNG streams and activation checkpointing that replays them.

Streams (Megatron's seeds, so runs compare with Megatron's):
- the *default* stream of each device: ``seed + 100 * pp_rank`` — the same on every TP rank, used for dropout
  outside tensor-parallel regions;
- ``model-parallel-rng``: ``seed + 2718 + tp_rank`` — different per TP rank, used for dropout inside
  tensor-parallel regions (attention probabilities of the local heads) and under sequence parallelism;
- ``data-parallel-rng``: ``seed``;
- ``expert-parallel-rng``: ``seed + 1024 + 100 * ep_rank + etp_rank`` — different per expert-parallel and
  expert-TP rank, for randomness inside the experts.

The tracker keeps each named stream's generator state and :meth:`RNGStatesTracker.fork` swaps it in for the
current device's default generator (CPU or CUDA, whichever the model runs on).

A run owns its tracker: ``setup`` makes one, seeds it through ``set_random_seed(..., tracker=)`` and hands it to the
model (each module that draws from a stream, and :func:`checkpoint`) and to the ``Checkpointer``. Megatron's
accessor, :func:`get_rng_tracker` (``get_cuda_rng_tracker()``), is for users' code: it returns the tracker the last
``set_random_seed`` seeded. A module built without a tracker (tests, tools) takes that one when it is built, and
``set_random_seed`` without a tracker seeds it again in place, as Megatron's single tracker is.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from .. import device

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class RNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block on that stream and saves where it left off."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._active: str | None = None  # the stream currently swapped in, if any

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already used by another RNG stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        saved = device.get_rng_state()
        device.manual_seed(seed)
        self.states_[name] = device.get_rng_state()
        device.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} was never added; call model_parallel_manual_seed() first")
        if self._active == name:  # nested fork of the stream already in use: keep drawing from it
            yield
            return
        saved, outer = device.get_rng_state(), self._active
        device.set_rng_state(self.states_[name])
        self._active = name
        try:
            yield
        finally:
            self.states_[name] = device.get_rng_state()
            device.set_rng_state(saved)
            self._active = outer


_current = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """Megatron's ``get_cuda_rng_tracker()``, for users' code: the tracker the last :func:`set_random_seed` (or
    :func:`model_parallel_manual_seed`) seeded (before any, one of the process's own)."""
    return _current


def tracker_or_current(tracker: RNGStatesTracker | None) -> RNGStatesTracker:
    """``tracker``, or for a module built without one the tracker :func:`get_rng_tracker` returns now."""
    return _current if tracker is None else tracker


def model_parallel_manual_seed(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int | None = None,
                               tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed the device's default stream with ``seed`` and add the named streams (Megatron's offsets) to
    ``tracker`` (None: the current one, reseeded in place), which becomes the current one: model parallel
    ``seed + 2718 + tp_rank``; expert parallel ``seed + 1024 + 100 * ep_rank + etp_rank`` (``etp_rank``, the expert
    tensor-parallel rank, defaults to ``tp_rank``). Returns the tracker."""
    global _current
    tracker = _current = tracker_or_current(tracker)
    device.manual_seed(seed)
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + (tp_rank if etp_rank is None else etp_rank))
    return tracker


def set_random_seed(seed: int, pp_rank: int = 0, tp_rank: int = 0, ep_rank: int = 0,
                    dp_rank: int = 0, data_parallel_random_init: bool = False, etp_rank: int | None = None,
                    tracker: RNGStatesTracker | None = None) -> int:
    """Megatron's ``_set_random_seed``: ``seed + 100*pp_rank`` (``+ 10*dp_rank`` with
    ``--data-parallel-random-init``) seeds python, numpy, torch and ``tracker`` (a run's own; None: the current
    one, see :func:`model_parallel_manual_seed`). Returns the seed used."""
    s = seed + 100 * pp_rank
    if data_parallel_random_init:
        s += 10 * dp_rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    model_parallel_manual_seed(s, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank, tracker=tracker)
    return s


# ---- activation checkpointing --------------------------------------------------------------------
def _capture_rng(tracker: RNGStatesTracker):
    return torch.get_rng_state(), device.get_rng_state(), tracker.get_states(), tracker._active


def _restore_rng(tracker: RNGStatesTracker, states):
    cpu, dev, streams, active = states
    torch.set_rng_state(cpu)
    device.set_rng_state(dev)
    tracker.set_states(streams)
    tracker._active = active  # recompute sees the same fork nesting as the forward did


class CheckpointFunction(torch.autograd.Function):
    """Run ``function(*args)`` without keeping activations; in backward, restore every RNG state seen at
    forward time (CPU, device, tracker streams), recompute with grad, and backpropagate. Recomputed dropout
    masks are therefore identical to the forward ones. ``contexts`` (or None): a callable returning the
    ``(forward, recompute)`` context managers of this call, made at forward time and entered around the first
    forward and around the recompute (as ``torch.utils.checkpoint``'s ``context_fn``; Transformer Engine's FP8
    state, ``TeManager.recompute_contexts``)."""

    @staticmethod
    def forward(ctx, function, tracker, contexts, *args):
        ctx.function, ctx.tracker = function, tracker
        ctx.rng_states = _capture_rng(tracker)
        forward_ctx, ctx.recompute_ctx = contexts() if contexts is not None else (
            contextlib.nullcontext(), contextlib.nullcontext())
        with torch.no_grad(), forward_ctx:
            outputs = function(*args)
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.non_tensor = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = [ctx.non_tensor[i] if t is None else t.detach().requires_grad_(t.requires_grad)
                  for i, t in enumerate(saved)]
        now = _capture_rng(ctx.tracker)
        _restore_rng(ctx.tracker, ctx.rng_states)
        try:
            with torch.enable_grad(), ctx.recompute_ctx:
                outputs = ctx.function(*inputs)
        finally:
            _restore_rng(ctx.tracker, now)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[x.grad if torch.is_tensor(x) else None for x in inputs])


def checkpoint(function, *args, tracker: RNGStatesTracker | None = None, contexts=None):
    """Activation checkpointing of ``function(*args)`` with RNG replay of the CPU and device generators and of
    ``tracker``'s streams (None: the current tracker) and ``contexts`` around the two forwards (see
    :class:`CheckpointFunction`)."""
    return CheckpointFunction.apply(function, tracker_or_current(tracker), contexts, *args)
