"""One iteration: Megatron's ``forward_step`` and its loss, the schedule over the iteration's microbatches, the
NaN check and gradient finalization (DP, SP, embedding group) (:func:`compute_gradients`), then the optimizer
step (unscale, clip, step), FP8 scales and the LR/WD schedule (:func:`apply_update`)."""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import device
from ..model.moe import stats as moe_stats
from ..model.mtp import mtp_loss
from ..optim.post_validation import Deferred
from ..parallel import comm_log as comm
from ..parallel.context_parallel import split_for_context_parallel
from ..parallel.ddp import finalize_model_grads
from . import nan_check
from .batches import data_iterators, microbatches, model_arg
from .metrics import print_rank_last
from .rerun import capture_iteration_inputs, restore_iteration_inputs
from .state import StepResult
from .timers import Timers

if TYPE_CHECKING:
    from ..parallel.context import ParallelContext
    from ..parallel.pipeline.timeline import PipelineTimeline
    from .rerun import Run
    from .state import TrainContext, TrainState

__all__ = ["make_forward_step", "in_region", "loss_sums", "print_rank0", "compute_gradients", "apply_update",
           "train_step"]


def loss_sums(stats: list[dict], parallel: ParallelContext, key: str = "lm loss", works: list | None = None):
    """``[sum of token losses, loss tokens]`` of the whole global batch (Megatron's reporting: each microbatch
    reports both, summed over microbatches and DP x CP), on every rank (sent from the last pipeline stage).
    ``key``: which report (``mtp_<k> loss``: a multi-token-prediction depth's). ``works``: the sending is started,
    not waited for; its handle is appended there."""
    sums = torch.zeros(2, dtype=torch.float32, device=device.current_device())
    if parallel.holds_loss:
        sums = torch.stack([s[key].float() for s in stats]).sum(0)
        group = parallel.dp_cp_group
        if group is not None and group.size() > 1:  # one stage's ranks: they reach it together
            comm.all_reduce(sums, group=group)
    if parallel.pp_size > 1:
        work = comm.broadcast(sums, src=parallel.loss_rank, group=parallel.pp_group, async_op=works is not None)
        if works is not None:
            works.append(work)
    return sums


def _mean(sums: torch.Tensor) -> float:
    total, tokens = sums.tolist()
    return total / max(tokens, 1.0)


def _reported_loss(stats: list[dict], parallel: ParallelContext, key: str = "lm loss", deferred: bool = False):
    """The iteration's loss: the token-weighted mean over the global batch (Megatron's), on every rank
    (``deferred``: a :class:`~megatronish.optim.post_validation.Deferred` of it)."""
    if not deferred:
        return _mean(loss_sums(stats, parallel, key))
    works: list = []
    sums = loss_sums(stats, parallel, key, works)
    return Deferred(works, lambda: _mean(sums))


def make_forward_step(reset_position_ids: bool, parallel: ParallelContext, per_token_loss: bool = False,
                      mtp_scaling_factor: float = 0.1):
    """Megatron's ``forward_step``/``loss_func``. Each microbatch reports ``[token-loss sum, loss tokens]`` of
    this rank's tokens. The loss back-propagated is the microbatch's token mean (the schedule divides it by the
    number of microbatches), or under ``per_token_loss`` the token sum (the gradients are divided by the global
    batch's token count after the backward). With ``--mtp-num-layers`` the multi-token-prediction term
    (:func:`~megatronish.model.mtp.mtp_loss`, weighted by ``mtp_scaling_factor``) is added, and each depth's
    ``[loss sum, tokens]`` reported as ``mtp_<k> loss``."""
    cp, cp_rank, cp_group = parallel.cp_size, parallel.cp_rank, parallel.cp_group

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        docs = batch.get("document_ids")  # --reset-attention-mask: the whole sequence's (attention sees all of it)
        if cp > 1:  # this CP rank's two chunks of every [b, s] tensor (Megatron's get_batch_on_this_cp_rank)
            batch = {k: split_for_context_parallel(v, 1, cp, cp_rank) for k, v in batch.items()}
        position_ids = batch["position_ids"].long() if reset_position_ids else None
        output = model(batch["tokens"].long(), position_ids=position_ids, labels=batch["labels"].long(),
                       document_ids=docs)
        mask = batch["loss_mask"].float()

        def loss_func(losses):  # per-token losses [b, s] -> masked token mean (or sum)
            extra = 0.0
            report = {}
            if losses.dim() == 3:  # --mtp-num-layers: [1 + D, b, s], the decoder's then each depth's
                extra, report = mtp_loss(losses, mask, mtp_scaling_factor, per_token_loss, cp_group)
                losses = losses[0]
            total = (losses.float() * mask).sum()
            report = {"lm loss": torch.stack([total.detach(), mask.sum()]), **report}
            if per_token_loss:
                return total + extra, report
            if cp == 1:
                return total / mask.sum().clamp(min=1) + extra, report
            # The token count of the whole sequence: summed over CP. Gradients flow through this rank's sum only
            # and are averaged over DP x CP, hence the factor CP.
            num_tokens = mask.sum()
            comm.all_reduce(num_tokens, group=cp_group)
            return total * cp / num_tokens.clamp(min=1) + extra, report

        return output, loss_func

    return forward_step


def in_region(forward_step, region):
    """``forward_step`` with the model's forward inside ``region()`` (Transformer Engine's one autocast a forward:
    ``TeManager.autocast``); the loss function it returns runs after the region, as the backward does."""
    def forward_step_in_region(data_iterator, model):
        with region():
            return forward_step(data_iterator, model)

    return forward_step_in_region


def print_rank0():
    """``print`` on rank 0 only (the first pipeline stage holds the most)."""
    return lambda msg: print_rank_last(dist.get_rank() == 0, msg)


def compute_gradients(run: TrainContext, state: TrainState, timeline: PipelineTimeline | None = None,
                      batches: list[dict] | None = None, details: dict | None = None) -> float:
    """Forward and backward of the global batch at ``state.consumed_samples`` (its size from the ramp under
    ``--rampup-batch-size``; ``batches``: its micro-batches read ahead by the loader, None: read here), the NaN
    check and the gradient finalization; returns the iteration's loss (``details["mtp"]``, when ``details`` is
    given, each multi-token-prediction depth's, ``{"mtp_<k> loss": value}``). The gradients are then in the DDP buffers
    (``param.main_grad``). Under ``--rerun-mode`` (``run.rerun``, :mod:`megatronish.training.rerun`) a suspicious
    iteration runs again before anything below changes the state."""
    cfg = run.cfg
    num_mb = cfg.num_microbatches_at(state.consumed_samples)
    pv = run.post_validation
    if pv is not None:  # the NaN check's local findings, validated with the step (optim/post_validation.py)
        def check(stats):
            if details is not None and cfg.train.check_for_nan_in_loss_and_grad:
                details["nan_report"] = nan_check.local_report(run.models, run.chunks, stats, check_grads=True)

        saved = capture_iteration_inputs(run) if pv.pending is not None else None
        stats = _forward_backward(run, state, num_mb, batches, timeline, check)
        if saved is not None and pv.settle():  # the last step was taken again: this iteration saw the old weights
            restore_iteration_inputs(run, saved)
            stats = _forward_backward(run, state, num_mb, batches, None, check)
    elif run.rerun is None:
        check = None
        if cfg.train.check_for_nan_in_loss_and_grad:
            check = functools.partial(nan_check.check_loss_and_grads, run.models, run.chunks,
                                      iteration=state.iteration + 1, check_grads=run.optimizer.grad_scaler is None)
        stats = _forward_backward(run, state, num_mb, batches, timeline, check)
    else:
        def read(dp_rank: int | None) -> list[dict]:  # the micro-batches (dp_rank: another replica's, to rerun them)
            if dp_rank is None and batches is not None:
                return batches
            with (run.timers or Timers(0))("batch-generator"):
                return list(microbatches(run.train_ds, state.consumed_samples, cfg.train.micro_batch_size, num_mb,
                                         torch.device("cpu"), run.parallel, dp_rank))

        stats = run.rerun.run_iteration(run, state, read, lambda r: _forward_backward(
            run, state, num_mb, r.batches, timeline if r.kind == "first" else None, r.check, r))
    if cfg.model.moe.num_experts is not None:
        moe_stats.update_expert_biases(run.models, run.parallel)
    if cfg.train.empty_unused_memory_level >= 1:
        device.empty_cache()
    deferred = pv is not None
    if details is not None and cfg.model.mtp_num_layers:  # collective: every rank
        details["mtp"] = {f"mtp_{k} loss": _reported_loss(stats, run.parallel, f"mtp_{k} loss", deferred)
                          for k in range(1, cfg.model.mtp_num_layers + 1)}
    return _reported_loss(stats, run.parallel, deferred=deferred)


def _forward_backward(run: TrainContext, state: TrainState, num_mb: int, batches: list[dict] | None,
                      timeline: PipelineTimeline | None, check, rerun: Run | None = None) -> list[dict]:
    """One run of the iteration's forward and backward, ``check(stats)`` (None: none) and the gradient
    finalization; returns the micro-batches' stats. ``rerun``: which run of the iteration this is."""
    cfg = run.cfg
    timers = run.timers or Timers(0)
    for c in run.chunks:
        c.zero_grad_buffer()
    if batches is None:
        with timers("batch-generator"):
            batches = list(microbatches(run.train_ds, state.consumed_samples, cfg.train.micro_batch_size, num_mb,
                                         torch.device("cpu"), run.parallel))
    it = data_iterators(run, run.train_ds, state.consumed_samples, num_mb, batches)
    if cfg.model.moe.num_experts is not None:  # the routers' losses take the main loss's backward scale
        per_token = cfg.train.calculate_per_token_loss
        moe_stats.start_step(run.models, run.optimizer.loss_scale / (1 if per_token else num_mb), per_token)
    with run.memory.measure(), timers("forward-backward"):  # saved-activation bytes / allocator peak, first iteration
        stats = run.schedule(run.forward_step, it, model_arg(run), num_mb, timeline=timeline)
    if run.checkpointer is not None:  # --async-save: the snapshot is taken before anything below changes the state
        run.checkpointer.wait_for_snapshot()
    run.memory.report(print_fn=print_rank0())
    if run.compiler is not None:
        run.compiler.report()  # the compile time, once
    nan_check.inject_for_test(run.chunks, stats, state.iteration + 1,  # test hooks; nothing unless asked
                              *((rerun.kind, rerun.owner, rerun.injection) if rerun is not None else ()))
    # --check-for-nan-in-loss-and-grad: before the optimizer step; before the data-parallel reduction where it has
    # not started yet (the rank that produced a NaN is named), after it under --overlap-grad-reduce and FSDP2 (whose
    # backward reduce-scatters)
    early = check is not None and not cfg.optim.overlap_grad_reduce \
        and all(hasattr(c, "grad_buffer") for c in run.chunks)
    if early:
        check(stats)
    num_tokens = None
    if cfg.train.calculate_per_token_loss:  # this rank's loss tokens (last stage; finalize sends them on)
        num_tokens = torch.zeros((), dtype=torch.float32, device=device.current_device())
        if stats:
            num_tokens = torch.stack([s["lm loss"][1].float() for s in stats]).sum()
    with timers("grads-reduce-scatter" if cfg.optim.use_distributed_optimizer else "grads-all-reduce"):
        finalize_model_grads(run.chunks, run.parallel, num_tokens)
    if check is not None and not early:
        check(stats)
    return stats


def apply_update(run: TrainContext, state: TrainState, loss, details: dict | None = None) -> StepResult:
    """The optimizer step on the finalized gradients, FP8 scales, the LR/WD schedule; advances ``state``. Under
    ``--enable-optimizer-post-validation`` (``loss`` and ``details``' values are then
    :class:`~megatronish.optim.post_validation.Deferred`) the step is taken at once and the result's loss, norm and
    success are filled in when it is validated."""
    batch = run.cfg.global_batch_size_at(state.consumed_samples)
    if run.post_validation is not None:
        result = _speculative_update(run, state, loss, details or {}, batch)
    else:
        with (run.timers or Timers(0))("optimizer"):
            update_successful, grad_norm = run.optimizer.step()  # unscale/overflow check, clip, step, copy back
        if update_successful:  # Megatron: the LR/WD schedule advances only with an applied update
            run.scheduler.step(increment=batch)
        result = StepResult(loss, update_successful, grad_norm, batch)
        state.history.append((state.iteration + 1, loss))
    if run.fp8 is not None:
        run.fp8.update()  # amax histories and next scales, once per optimizer step
    if run.cfg.train.empty_unused_memory_level >= 2:
        device.empty_cache()
    state.iteration += 1
    state.consumed_samples += batch
    return result


def _speculative_update(run: TrainContext, state: TrainState, loss, details: dict, batch: int) -> StepResult:
    """The post-validated step (:class:`~megatronish.optim.post_validation.PostValidation`); the result and the
    history entry are completed once validated."""
    iteration, index = state.iteration + 1, len(state.history)
    result = StepResult(math.nan, True, None, batch)
    state.history.append((iteration, math.nan))
    mtp = details.get("mtp")

    def settled(update_successful: bool, grad_norm: float) -> None:
        result.loss, result.update_successful, result.grad_norm = loss.get(), update_successful, grad_norm
        result.mtp = {name: value.get() for name, value in mtp.items()} if mtp is not None else None
        state.history[index] = (iteration, result.loss)

    check = None
    if "nan_report" in details:
        flags, mine = details["nan_report"]
        check = (flags, lambda reduced: nan_check.raise_found(
            reduced, mine, iteration, "stopped at the step's validation and rolled back, nothing saved from this "
            "state (--check-for-nan-in-loss-and-grad, --enable-optimizer-post-validation)"))
    with (run.timers or Timers(0))("optimizer"):
        run.post_validation.step(batch, settled, check)
    return result


def train_step(run: TrainContext, state: TrainState, timeline: PipelineTimeline | None = None,
               batches: list[dict] | None = None) -> StepResult:
    """One iteration on the global batch at ``state.consumed_samples`` (``batches``: its micro-batches, read ahead
    by the loader; None: read here); advances ``state``."""
    details: dict = {}
    loss = compute_gradients(run, state, timeline, batches, details)
    cfg = run.cfg
    moe = None
    if cfg.model.moe.num_experts is not None:  # collective: every rank, before the update advances the state
        moe = moe_stats.step_metrics(run.models, run.parallel, cfg.model,
                                     cfg.num_microbatches_at(state.consumed_samples))
    result = apply_update(run, state, loss, details)
    result.moe = moe
    if run.post_validation is None:
        result.mtp = details.get("mtp")
    return result

