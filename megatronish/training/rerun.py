"""``--rerun-mode`` (Megatron-LM's rerun state machine): a suspicious iteration is run again before the optimizer
step, to tell a fault of a rank's hardware from the model's own result (docs/reliability.md).

Suspicious: a NaN/Inf loss or gradient (``--check-for-nan-in-loss-and-grad``), a loss spike
(``--check-for-spiky-loss``: a micro-batch's loss at least 10x the largest of the first 100 this rank saw,
Megatron's rule) or an unexpectedly large gradient norm (``--check-for-large-grads``: 10x, the same rule). Every
rank checks its own values before the data-parallel reduction where it can; one all-reduce tells every rank, and
every rank's findings are gathered only when one is up, so every rank takes the same branch.

``validate_results`` (Megatron's default): the parameters and optimizer state are untouched before the optimizer
step, so the iteration runs again from the same micro-batches with the RNG state restored:

- the rerun is good: a transient fault; one ``WARNING`` line and training goes on with the rerun's result (which
  is what an undisturbed iteration computes, bit for bit);
- it comes back: Megatron reruns on another GPU. Here every data-parallel replica computes the next replica's
  micro-batches (replicas hold the same parameters, so those are the same computations on other ranks).
  - it follows the micro-batches: the model's own result (a divergence). The state before the step is saved to
    ``--save`` if it is not there yet, and the run stops: :class:`~megatronish.errors.NonFiniteError`, exit 3;
  - it stays on the ranks that had it: a persistent fault of those ranks; one line names each with its host and
    the run stops: :class:`~megatronish.errors.FaultyRankError`, exit 5.
  With one data-parallel replica, or gradients checked only after the data-parallel reduction (
  ``--overlap-grad-reduce``, FSDP2: every replica's gradients are mixed), no other rank can recompute a rank's
  part: a result that comes back is treated as a divergence, and the line says why.

``report_stats``: every iteration runs twice; the largest relative difference of the local losses and gradient
norms between the two runs is reported every log interval (training goes on with the second run's result; the
checks then act as under ``disabled``). ``disabled``: one run; a NaN stops the run as
``--check-for-nan-in-loss-and-grad`` always did, a spike or large gradient norm is a ``WARNING`` line.

Error injection for tests (Megatron's flags): ``--error-injection-rate N`` puts a fault into one iteration in N on
average, on the rank Megatron's rule picks (from ``--seed`` and the iteration, the same on every rank), of
``--error-injection-type`` (``nan_check.Injection``): a NaN in that rank's first gradient (its local loss under
``--fp16``, whose loss scaler owns gradient overflows).
"""
from __future__ import annotations

import copy
import functools
import math
import os
import random
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .. import device
from ..checkpoint.state import capture_rng, restore_rng
from ..errors import FaultyRankError, NonFiniteError
from ..parallel import comm_log as comm
from . import nan_check

__all__ = ["RerunMachine", "LargeValue", "make_rerun", "relative_difference", "MODES", "SPIKY_LOSS_FACTOR",
           "LARGE_GRADS_FACTOR", "LARGE_VALUE_SAMPLES"]

MODES = ("disabled", "validate_results", "report_stats")
SPIKY_LOSS_FACTOR = 10.0  # Megatron's pretrain_gpt.py
LARGE_GRADS_FACTOR = 10.0  # Megatron's param_and_grad_buffer check_grads
LARGE_VALUE_SAMPLES = 100  # values that set the largest before any is judged (Megatron's is_unexpectedly_large)
_FLAGS = ("loss", "grad", "spike", "large")  # the all-reduced findings, in this order


class LargeValue:
    """Megatron's ``is_unexpectedly_large``: the first ``samples`` finite values set the largest magnitude seen;
    after them a value at least ``factor`` times it is unexpectedly large. NaN and Inf are the NaN check's."""

    def __init__(self, factor: float, samples: int = LARGE_VALUE_SAMPLES):
        self.factor, self.samples = factor, samples
        self.count, self.largest = 0, 0.0

    def judge(self, value: float) -> bool:
        v = abs(value)
        return math.isfinite(v) and self.count >= self.samples and v >= self.largest * self.factor

    def record(self, value: float) -> None:
        v = abs(value)
        if math.isfinite(v) and self.count < self.samples:
            self.count += 1
            self.largest = max(self.largest, v)


def relative_difference(a: float, b: float) -> float:
    """Megatron's comparison of two results: 0 when equal (NaN and NaN too), inf when only one is not finite, else
    ``|a - b| / |(a + b) / 2|``."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)) or a + b == 0:
        return math.inf
    return abs((a - b) / (a + b) * 2)


@dataclass
class Run:
    """One run of an iteration's forward and backward on this rank: ``kind`` ``first``, ``rerun`` (same ranks,
    same micro-batches) or ``shifted`` (this rank computes ``owner``'s micro-batches)."""

    kind: str
    owner: int
    batches: list
    injection: nan_check.Injection | None = None
    check: Callable[[list], None] | None = None  # called with the run's stats where the NaN check goes
    flags: tuple = (0, 0, 0, 0)  # every rank's findings, all-reduced (_FLAGS)
    losses: list = field(default_factory=list)  # this rank's micro-batch losses (token means; last stage)
    grad_norm: float | None = None
    seen: list | None = None  # every rank's findings (gathered when a flag is up, and in a shifted run)

    @property
    def suspicious(self) -> bool:
        return any(self.flags)


def capture_iteration_inputs(run) -> tuple:
    """What a run of an iteration changes besides the gradients: the RNG streams, the FP8 scaling state (to run
    the iteration again, :func:`restore_iteration_inputs`)."""
    fp8 = copy.deepcopy(run.fp8.state_dict()) if run.fp8 is not None else None
    return capture_rng(run.rng_tracker), fp8


def restore_iteration_inputs(run, saved: tuple) -> None:
    rng, fp8 = saved
    restore_rng(rng, run.rng_tracker)
    if fp8 is not None:
        run.fp8.load_state_dict(copy.deepcopy(fp8))


def make_rerun(cfg, parallel) -> RerunMachine | None:
    """The run's machine, or None where there is nothing to rerun or judge: ``--rerun-mode disabled`` without
    the spike and gradient-norm checks, or ``validate_results`` with every check off (the loop then runs as it
    always did)."""
    t = cfg.train
    judged = t.check_for_nan_in_loss_and_grad or t.check_for_spiky_loss or t.check_for_large_grads
    if t.rerun_mode == "report_stats" or (t.rerun_mode == "validate_results" and judged) \
            or t.check_for_spiky_loss or t.check_for_large_grads:
        return RerunMachine(cfg, parallel)
    return None


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class RerunMachine:
    """One run's rerun engine (owned by the ``TrainContext``). :meth:`run_iteration` runs an iteration's forward
    and backward once or more, as the mode and the findings ask, and returns the accepted run's stats."""

    def __init__(self, cfg, parallel):
        t = cfg.train
        self.mode, self.check_nan = t.rerun_mode, t.check_for_nan_in_loss_and_grad
        self.spiky = LargeValue(SPIKY_LOSS_FACTOR) if t.check_for_spiky_loss else None
        self.large = LargeValue(LARGE_GRADS_FACTOR) if t.check_for_large_grads else None
        self.rate, self.error_type, self.seed = t.error_injection_rate, t.error_injection_type, t.seed
        self.save_dir = cfg.checkpoint.save
        self.overlap_grad_reduce = cfg.optim.overlap_grad_reduce
        self.report_every, self.train_iters = cfg.logging.log_interval, t.train_iters
        self.parallel = parallel
        self.diffs: list[tuple[int, float, float]] = []  # report_stats: (iteration, loss, gradient norm)
        self.corrected: list[int] = []  # iterations whose rerun replaced a first run with a transient fault

    # ------------------------------------------------------------------------------------------ the iteration
    def run_iteration(self, run, state, read: Callable[[int | None], list],
                      execute: Callable[[Run], list]) -> list[dict]:
        """The iteration's accepted stats (``run``: the ``TrainContext``, ``state``: the loop's ``TrainState``).
        ``read(dp_rank)``: the iteration's micro-batches (``dp_rank``: another data-parallel replica's, None: this
        one's); ``execute(r)`` runs the forward and backward on ``r.batches``, calling ``r.check(stats)`` where the
        NaN check goes. Raises on a divergence or a faulty rank (collective: every rank decides alike)."""
        it, me, dp = state.iteration + 1, self.parallel.rank, self.parallel
        batches = read(None)
        saved = capture_iteration_inputs(run)
        injection = self._injection(it, run)
        first = self._start(run, it, "first", me, batches, injection)
        stats = execute(first)
        if self.mode == "report_stats":
            restore_iteration_inputs(run, saved)
            second = self._start(run, it, "rerun", me, batches, injection)
            stats = execute(second)
            self._report(it, first, second)
            return self._settle(it, second, stats)
        if not first.suspicious or self.mode == "disabled":
            return self._settle(it, first, stats)
        restore_iteration_inputs(run, saved)
        second = self._start(run, it, "rerun", me, batches, injection)
        stats = execute(second)
        if not second.suspicious:
            _say(f"WARNING: iteration {it}: {self._what(first)}; it did not come back when the iteration was rerun: "
                 "a transient fault; training goes on with the rerun's result (--rerun-mode validate_results)")
            self.corrected.append(it)
            return self._settle(it, second, stats)
        reason, pairs = self._cannot_shift(run, first), ""
        if reason is None:
            restore_iteration_inputs(run, saved)
            nxt = (dp.dp_rank + 1) % dp.dp_size
            third = self._start(run, it, "shifted", dp.ranks("dp")[nxt], read(nxt), injection)
            execute(third)
            faulty, pairs = self._attribute(first, third)
            if faulty:
                where = ", ".join(f"rank {d['rank']} ({d['host']}, pid {d['pid']})" for d in faulty)
                raise FaultyRankError(
                    f"iteration {it}: {self._what(first)}; it came back when the iteration was rerun on the same "
                    f"ranks but not when other ranks computed the same micro-batches ({pairs}): a persistent fault "
                    f"of {where}; stopped before the optimizer step, nothing saved from this state; resume with "
                    "--load without that node (--rerun-mode validate_results)")
        restore_iteration_inputs(run, saved)
        saved_note = self._save_before(run, state)
        if reason is None:
            how = (f"it came back on every rerun, also when other ranks computed the same micro-batches ({pairs}): "
                   "the model's own result (a divergence), not a faulty rank")
        else:
            how = (f"it came back when the iteration was rerun; {reason}, so a fault of those ranks cannot be told "
                   "from a divergence: stopping as for a divergence")
        raise NonFiniteError(f"iteration {it}: {self._what(first)}; {how}; {saved_note}; stopped before the "
                             "optimizer step (--rerun-mode validate_results)")

    def _start(self, run, it, kind, owner, batches, injection) -> Run:
        r = Run(kind, owner, batches, injection)
        r.check = functools.partial(self._observe, run, r, it)
        return r

    def _injection(self, it: int, run) -> nan_check.Injection | None:
        """``--error-injection-rate``'s fault at ``it``: Megatron's rule, ``(r + rank) % N == 0`` with ``r`` drawn
        in ``[0, N)``, here from (``--seed``, iteration) so every rank draws the same."""
        if self.rate <= 0:
            return None
        rank = (-random.Random(f"{self.seed}:{it}").randrange(self.rate)) % self.rate
        if rank >= self.parallel.world_size:
            return None
        what = "grad" if run.optimizer.grad_scaler is None else "loss"
        _say(f"WARNING: iteration {it}: injecting a {self.error_type} into rank {rank}'s "
             f"{'gradient' if what == 'grad' else 'loss'} (--error-injection-rate {self.rate})")
        return nan_check.Injection(what, rank, self.error_type)

    # ------------------------------------------------------------------------------------------ the checks
    def _observe(self, run, r: Run, it: int, stats: list[dict]) -> None:
        """This rank's findings on its run of the iteration, all-reduced (and gathered when one is up)."""
        check_grads = run.optimizer.grad_scaler is None
        loss_bad, grad_bad = nan_check.local_findings(run.chunks, stats, check_grads) if self.check_nan \
            else (False, False)
        if self.spiky is not None or self.mode == "report_stats":  # each a device sync: only when judged
            r.losses = [float(s["lm loss"][0]) / max(float(s["lm loss"][1]), 1.0) for s in stats if "lm loss" in s]
        if self.large is not None or self.mode == "report_stats":
            grads = [g for c in run.chunks for g in nan_check.grad_tensors(c)]
            r.grad_norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads))
        spike = next((v for v in r.losses if self.spiky is not None and self.spiky.judge(v)), None)
        large = r.grad_norm if self.large is not None and self.large.judge(r.grad_norm) else None
        mine = (loss_bad, grad_bad, spike is not None, large is not None)
        flags = torch.tensor([int(f) for f in mine], dtype=torch.int32, device=device.current_device())
        if self.parallel.world_size > 1:
            comm.all_reduce(flags, op=dist.ReduceOp.MAX)
        r.flags = tuple(int(f) for f in flags.tolist())
        if not r.suspicious and r.kind != "shifted":
            return
        d = dict(rank=self.parallel.rank, owner=r.owner, loss=loss_bad,
                 grad=nan_check.first_bad_param(run.models, run.chunks) if grad_bad else None,
                 spike=None if spike is None else (spike, self.spiky.largest),
                 large=None if large is None else (large, self.large.largest),
                 host=socket.gethostname(), pid=os.getpid())
        r.seen = [None] * self.parallel.world_size
        if self.parallel.world_size > 1:
            comm.all_gather_object(r.seen, d)
        else:
            r.seen = [d]

    @staticmethod
    def _bad(d: dict) -> bool:
        return bool(d["loss"] or d["grad"] or d["spike"] or d["large"])

    def _what(self, r: Run) -> str:
        """The findings of ``r``, for the line."""
        seen = r.seen
        parts = [nan_check.describe([(d["loss"], d["grad"]) for d in seen])] \
            if any(d["loss"] or d["grad"] for d in seen) else []
        for key, what, factor, flag in (("spike", "loss", SPIKY_LOSS_FACTOR, "--check-for-spiky-loss"),
                                        ("large", "gradient norm", LARGE_GRADS_FACTOR, "--check-for-large-grads")):
            hit = [d for d in seen if d[key]]
            if hit:
                value, largest = hit[0][key]
                parts.append(f"{what} {value:.4g} on rank{'s' if len(hit) > 1 else ''} "
                             f"{nan_check.ranks_text([d['rank'] for d in hit])} is {factor:g}x or more the largest "
                             f"of the first {LARGE_VALUE_SAMPLES} ({largest:.4g}; {flag})")
        return "; ".join(parts)

    def _cannot_shift(self, run, first: Run) -> str | None:
        """Why no other rank can recompute the suspicious part (None: the replicas can)."""
        if self.parallel.dp_size == 1:
            return "with data-parallel size 1 no other rank computes these micro-batches"
        grads_mixed = self.overlap_grad_reduce or not all(hasattr(c, "grad_buffer") for c in run.chunks)
        if grads_mixed and (first.flags[1] or first.flags[3]):
            return ("the gradients are checked after the data-parallel reduction here (--overlap-grad-reduce or "
                    "FSDP2), which mixes every replica's")
        return None

    def _attribute(self, first: Run, third: Run) -> tuple[list[dict], str]:
        """(the ranks that had it, when it stays with them, else []; which rank computed whose micro-batches)."""
        bad = [d for d in first.seen if self._bad(d)]
        pairs = ", ".join(f"rank {d['rank']} for rank {d['owner']}" for d in third.seen
                          if d["owner"] in {b["rank"] for b in bad})
        follows = {d["owner"] for d in third.seen if self._bad(d)}
        return ([] if follows & {d["rank"] for d in bad} else bad), pairs

    def _save_before(self, run, state) -> str:
        """Save the state before the failed step (collective), unless it is on disk; the line's words for it."""
        if not self.save_dir:
            return "nothing saved (no --save)"
        if state.iteration == 0:
            return "nothing saved (no iteration completed)"
        run.checkpointer.finish(state)
        return f"the checkpoint of iteration {state.iteration} in --save {self.save_dir} holds the state before it"

    # ------------------------------------------------------------------------------------------ accepting
    def _settle(self, it: int, r: Run, stats: list[dict]) -> list[dict]:
        """Accept ``r``: its values join the spike and gradient-norm samples. Under ``disabled`` and
        ``report_stats`` a NaN stops the run as the NaN check always did and a spike is a WARNING line."""
        if r.suspicious:
            if r.flags[0] or r.flags[1]:
                raise NonFiniteError(f"iteration {it}: {nan_check.describe([(d['loss'], d['grad']) for d in r.seen])}"
                                     "; stopped before the optimizer step, nothing saved from this state "
                                     "(--check-for-nan-in-loss-and-grad, Megatron's default)")
            _say(f"WARNING: iteration {it}: {self._what(r)} (--rerun-mode {self.mode}: not rerun)")
        if self.spiky is not None:
            for v in r.losses:
                self.spiky.record(v)
        if self.large is not None and r.grad_norm is not None:
            self.large.record(r.grad_norm)
        return stats

    def _report(self, it: int, first: Run, second: Run) -> None:
        """report_stats: this iteration's largest relative differences (over every rank) between its two runs;
        one line each log interval."""
        loss = max((relative_difference(a, b) for a, b in zip(first.losses, second.losses)), default=0.0)
        norm = relative_difference(first.grad_norm, second.grad_norm) if first.grad_norm is not None else 0.0
        diffs = torch.tensor([loss, norm], dtype=torch.float64 if device.device_type() == "cpu" else torch.float32,
                             device=device.current_device())
        if self.parallel.world_size > 1:
            comm.all_reduce(diffs, op=dist.ReduceOp.MAX)
        self.diffs.append((it, *diffs.tolist()))
        if it % self.report_every and it != self.train_iters:
            return
        n, losses, norms = len(self.diffs), [d[1] for d in self.diffs], [d[2] for d in self.diffs]
        _say(f"rerun stats (--rerun-mode report_stats), iterations {self.diffs[0][0]}-{it}: {n} reruns; loss "
             f"identical in {losses.count(0.0)}, largest relative difference {max(losses):.3e}; gradient norm "
             f"identical in {norms.count(0.0)}, largest relative difference {max(norms):.3e}")
        self.diffs = []
        sys.stdout.flush()
