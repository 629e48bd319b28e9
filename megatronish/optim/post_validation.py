"""``--enable-optimizer-post-validation``: the optimizer step without a synchronization of the pipeline stages.

Megatron's step agrees on global values first: the gradient norm (clipping, and skipping a step whose norm is not
finite), the NaN check's findings, the reported loss. Each is a collective over every pipeline stage, so every rank
waits at the end of an iteration for the last one to finish its backward. Under a zero-bubble schedule that wait is
all the bubble left: without it the stages run as a parallelogram, each starting the next iteration as soon as its
own part of this one is done (ZBV's bubble goes from ``(p-1)/(6m)`` of the compute to none, docs/pipeline.md).

As the zero-bubble paper proposes, the step is taken at once, assuming that neither clipping nor a skip is due, and
the collectives are started without waiting (:meth:`PostValidation.step`). They are validated at the latest after
the next iteration's forward and backward (:meth:`PostValidation.settle`), by when every rank has long contributed.
The result is exactly the synchronous step's:

- the norm is within ``--clip-grad`` and finite: the step stands (the usual case in stable training);
- clipping was due: the step is rolled back (the main parameters, the optimizer states, the step counts and the
  gradients are kept until the validation) and taken again, clipped; the caller then runs the iteration computed
  since once more, from the same micro-batches and RNG state (``settle`` returns True);
- the norm is not finite: rolled back and skipped, as the synchronous step skips it;
- the NaN check (``--check-for-nan-in-loss-and-grad``) found a non-finite loss or gradient: rolled back, and its
  error raised on every rank.

The copies cost one more copy of this rank's main parameters and optimizer states (and, with ``--clip-grad`` > 0,
of its main gradients) while a step waits for its validation.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ..parallel import comm_log as comm
from .clip_grads import clip_coefficient, reduce_sums, total_of

__all__ = ["Deferred", "PostValidation"]


class Deferred:
    """A value whose collectives were started without waiting: :meth:`get` waits for them (once) and computes it."""

    def __init__(self, works: list, compute: Callable[[], object]):
        self._works, self._compute, self._done, self._value = works, compute, False, None

    def get(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._value, self._done = self._compute(), True
        return self._value


class _Speculation:
    """A step taken before its validation: the norm's terms in flight, the check's flags in flight, the copies to
    roll back to, and who to tell the outcome."""

    def __init__(self, terms, works, check, mains, states, grads, counts, increment, settled):
        self.terms, self.works, self.check = terms, works, check
        self.mains, self.states, self.grads, self.counts = mains, states, grads, counts
        self.increment, self.settled = increment, settled


class PostValidation:
    """Owns the step awaiting its validation (at most one) of ``optimizer`` (a
    :class:`~megatronish.optim.optimizer.MegatronOptimizer`) and its LR/WD ``scheduler`` (None: none)."""

    def __init__(self, optimizer, scheduler):
        if optimizer.grad_scaler is not None:
            raise ValueError("optimizer post-validation does not take a loss scaler (--fp16)")
        self.optimizer, self.scheduler = optimizer, scheduler
        self.pending: _Speculation | None = None
        self.stood = self.redone = 0  # steps validated as taken, and taken again (clipped or skipped)

    def step(self, increment: int, settled: Callable[[bool, float], None],
             check: tuple[torch.Tensor, Callable[[torch.Tensor], None]] | None = None) -> None:
        """Take the step on the finalized gradients now, unclipped, and advance the scheduler by ``increment``
        samples; start the norm's collectives (and ``check``'s: ``(flags, raise_found)``, the NaN check's local
        flags, MAX-reduced over the world, then ``raise_found(flags)``). ``settled(update_successful, grad_norm)``
        is called once validated."""
        self.settle()  # at most one step in flight
        opt = self.optimizer
        grads = opt.prepare_grads()
        terms = opt.grad_norm_terms()
        works = reduce_sums(terms, async_op=True)
        if check is not None:
            flags, raise_found = check
            works += _max_over_world(flags)
        slots = opt.slots
        with torch.no_grad():
            mains = [s.main.detach().clone() for s in slots]
            states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[s.main].items()}
                      for s in slots]
            kept = [g.clone() for g in grads] if opt.clip_grad > 0 else None
        self.pending = _Speculation(terms, works, check, mains, states, kept, (opt.num_steps, self._count()),
                                    increment, settled)
        opt.optimizer.step()
        opt.num_steps += 1
        opt.release_grads()
        opt.copy_main_to_model()
        self._advance(increment)

    def settle(self) -> bool:
        """Validate the step in flight (if any; collective: every rank calls it at the same point of the loop).
        Returns True when the step was taken again (clipped, or skipped): the model's parameters changed, and an
        iteration computed since must run again."""
        spec, self.pending = self.pending, None
        if spec is None:
            return False
        for work in spec.works:
            work.wait()
        norm = math.sqrt(total_of(spec.terms).item())
        if spec.check is not None and spec.check[0].any():
            self._roll_back(spec)
            self.optimizer.copy_main_to_model()
            spec.check[1](spec.check[0])  # raises on every rank
        if math.isfinite(norm) and clip_coefficient(norm, self.optimizer.clip_grad) is None:
            self.stood += 1
            spec.settled(True, norm)
            return False
        self._roll_back(spec)
        self.redone += 1
        opt = self.optimizer
        if math.isfinite(norm):  # clipping was due: the step again, clipped
            for s, g in zip(opt.slots, spec.grads):
                s.main.grad = g
            success = opt.apply_grads(spec.grads, norm)
            self._advance(spec.increment)
        else:  # skipped, as the synchronous step skips it
            opt.copy_main_to_model()
            success = False
        spec.settled(success, norm)
        return True

    def _roll_back(self, spec: _Speculation) -> None:
        opt = self.optimizer
        with torch.no_grad():
            for s, main, state in zip(opt.slots, spec.mains, spec.states):
                s.main.copy_(main)
                live = opt.optimizer.state[s.main]
                for k, v in state.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)):
                        live[k].copy_(v)
                    else:
                        live[k] = v
        opt.num_steps, count = spec.counts
        if self.scheduler is not None:
            self.scheduler.num_steps = count
            self.scheduler.step(increment=0)  # the groups' LR and WD of the restored count

    def _count(self):
        return self.scheduler.num_steps if self.scheduler is not None else None

    def _advance(self, increment: int) -> None:
        if self.scheduler is not None:
            self.scheduler.step(increment=increment)


def _max_over_world(flags: torch.Tensor) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    return [comm.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)]
