"""``pretrain(cfg)``: the training loop behind ``pretrain_gpt.py``. Its parts live beside it:

- :func:`~megatronish.training.initialize.setup` (``training/initialize.py``): distributed init -> the parallel
  context (every process group) -> RNG seeds -> model -> DDP or FSDP2 -> optimizer and LR/WD scheduler -> datasets
  -> checkpoint load, in that fixed order; it returns a :class:`TrainContext` holding the run's live objects and
  the loop's :class:`TrainState` (the counters a checkpoint saves, the histories); ``pretrain`` returns both, a
  :class:`TrainResult`.
- :func:`~megatronish.training.step.train_step` (``training/step.py``): one iteration: the schedule over the
  iteration's microbatches, gradient finalization (DP, SP, embedding group), the optimizer step (unscale, clip,
  step), FP8 scales, the LR/WD schedule.
- :class:`~megatronish.training.logger.TrainLogger` (``training/logger.py``): the per-interval record (JSON lines,
  TensorBoard, W&B, MLflow) and Megatron's log line, both from one record; evaluations (``training/evaluate.py``).
- ``training/batches.py``: the micro-batches and the ``--num-workers`` loader; ``training/state.py``: the loop's
  counters and state, the run's live objects; ``training/profiler.py``: ``--profile``.

When to save and when to stop is :class:`megatronish.training.exit.ExitPolicy`'s.
"""
from __future__ import annotations

import gc
import time

from ..parallel.pipeline.timeline import PipelineTimeline
from .batches import train_loader
from .evaluate import evaluate
from .exit import ExitPolicy
from .initialize import setup
from .logger import TrainLogger, write_timeline
from .profiler import Profiler
from .state import StepResult, TrainContext, TrainCounters, TrainResult, TrainState
from .step import apply_update, compute_gradients, train_step
from .watchdog import Watch

__all__ = ["pretrain", "setup", "train_step", "compute_gradients", "apply_update", "evaluate", "TrainLogger",
           "TrainContext", "TrainCounters", "TrainState", "TrainResult", "StepResult"]


def state_read_after(cfg, iteration: int, train_iters: int) -> bool:
    """Whether anything after iteration ``iteration`` reads its loss, its gradient norm or the model and
    optimizer state: the log line, an evaluation, a save (interval, exit, signal, duration, ``--save-hf-interval``),
    the end of training. Under ``--enable-optimizer-post-validation`` the step is validated there; otherwise by
    the next iteration (optim/post_validation.py)."""
    t, ck = cfg.train, cfg.checkpoint

    def every(n):
        return bool(n) and iteration % n == 0

    return (iteration >= train_iters or every(cfg.logging.log_interval) or (every(t.eval_interval) and t.eval_iters)
            or every(ck.save_interval) or every(ck.exit_interval) or every(ck.save_hf_interval)
            or bool(ck.exit_duration_in_mins) or ck.exit_signal_handler)


def pretrain(cfg, watch: Watch | None = None, report=None) -> TrainResult:
    """Train (and evaluate) as configured by a :class:`megatronish.config.RunConfig`; returns the loop's state
    (``.state``: iteration, losses, exit reason) and the run's live objects (``.context``). ``watch``: the entry
    point's rank watchdog (:class:`megatronish.training.watchdog.Watch`), started by ``setup``. ``report``: the
    entry point's ``--report-plan`` (:class:`megatronish.planner.report.PlanReport`), told after set-up and after
    each iteration."""
    run, state = setup(cfg, watch)
    if report is not None:
        report.predict(run)
    t = cfg.train
    train_iters = 0 if t.skip_train else t.train_iters
    logger = TrainLogger(run, train_iters, state)
    exit_policy = ExitPolicy(cfg.checkpoint)
    profiler = Profiler(cfg)
    if t.manual_gc:  # Megatron: collections only at fixed points, aligned across ranks
        gc.disable()
        gc.collect()
    num_mb = cfg.num_microbatches_at(state.consumed_samples)
    # --num-workers: micro-batches read ahead (under --rampup-batch-size, each iteration's ramped batch)
    loader = train_loader(run, state, train_iters)
    try:
        while state.iteration < train_iters:
            profiler.before_iteration(state.iteration)
            if cfg.num_microbatches_at(state.consumed_samples) != num_mb and state.iteration and cfg.checkpoint.save:
                if run.post_validation is not None:
                    run.post_validation.settle()
                run.checkpointer.save(state)  # Megatron saves when the ramp changes the number of microbatches
            num_mb = cfg.num_microbatches_at(state.consumed_samples)
            last = state.iteration == train_iters - 1
            timeline = PipelineTimeline() if cfg.logging.pipeline_timeline and last else None
            step = train_step(run, state, timeline, loader.next_iteration() if loader else None)
            if timeline is not None:
                write_timeline(run, timeline)
            if run.post_validation is not None and state_read_after(cfg, state.iteration, train_iters):
                run.post_validation.settle()  # what reads the step's result or the weights next sees them validated
            logger.after_step(state, step)
            if report is not None:
                report.after_step(state, logger.last_record)
            if t.eval_interval and t.eval_iters and state.iteration % t.eval_interval == 0 \
                    and state.iteration < train_iters:
                logger.evaluate(state)
                logger.window_start = time.perf_counter()  # evaluation time is not training time
            state.exit_reason = exit_policy.after_iteration(state, run.checkpointer)
            if run.hf_export is not None:
                run.hf_export.after_iteration(state.iteration)  # --save-hf-interval
            profiler.after_iteration(state.iteration)
            if t.manual_gc and t.manual_gc_interval and state.iteration % t.manual_gc_interval == 0:
                gc.collect()
            if state.exit_reason:
                break

        if loader is not None:
            loader.close()
        if t.eval_iters and not state.exit_reason:
            logger.evaluate(state)
            if run.test_ds is not None and len(run.test_ds) > 0:
                logger.evaluate(state, test=True)
        run.optimizer.finish_param_sync()  # callers get complete parameters (--overlap-param-gather)
        run.checkpointer.finish(state)  # final save; waits for background writes
        if run.hf_export is not None:
            run.hf_export.finish(state.iteration)  # --save-hf: the final state, unless just written
    finally:
        if loader is not None:
            loader.close()
        exit_policy.release()
        if t.manual_gc:
            gc.enable()
    logger.close()
    return TrainResult(state, run)
