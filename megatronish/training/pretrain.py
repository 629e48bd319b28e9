"""``pretrain(cfg)``: the training loop behind ``pretrain_gpt.py``, in three parts.

- :func:`setup`: distributed init -> the parallel context (every process group) -> RNG seeds -> model
  (layout-invariant init) -> DDP wrapper -> optimizer and LR/WD scheduler -> datasets -> checkpoint load. The
  order is fixed; it returns a :class:`TrainContext` holding the run's live objects.
- :func:`train_step`: one iteration: the schedule over ``num_microbatches`` microbatches, gradient finalization
  (DP, SP, embedding group), the optimizer step (unscale, clip, step), FP8 scales, the LR/WD schedule.
- :class:`TrainLogger`: the per-interval record (JSON lines, TensorBoard, W&B) and Megatron's log line, both
  from one record; evaluations.

When to save and when to stop is :class:`megatronish.training.exit.ExitPolicy`'s.
"""
from __future__ import annotations

import functools
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import device
from ..checkpoint.manager import setup_checkpointing
from ..data.loader import MicroBatchLoader
from ..data.mock import MockGPTDataset
from ..data.sampler import collate, global_batch_indices
from ..model.build import build_model_chunks
from ..optim.clip_grads import global_norm
from ..optim.grad_scaler import build_grad_scaler
from ..optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from ..optim.optimizer import get_megatron_optimizer
from ..parallel import groups
from ..parallel.context import ParallelContext
from ..parallel.context_parallel import split_for_context_parallel
from ..parallel.ddp import DistributedDataParallel, finalize_model_grads
from ..parallel.pipeline.schedules import get_forward_backward_func, pipeline_tensor_shape
from ..parallel.pipeline.timeline import PipelineTimeline, gather_timeline, write_chrome_trace
from ..parallel.random import set_random_seed
from ..precision.fp8 import Fp8Manager, Fp8Recipe, check_transformer_impl, enable_fp8
from . import nan_check, watchdog
from .exit import ExitPolicy
from .flops import device_peak_tflops, num_floating_point_operations
from .memory import ActivationMeter, report_theoretical_memory
from .metrics import MetricsWriter, print_rank_last, train_log_line
from .timers import Timers, straggler_lines


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    history: list = field(default_factory=list)  # (iteration, lm loss) of every iteration, for callers
    valid_history: list = field(default_factory=list)
    valid_consumed_samples: int = 0  # evaluations continue through the validation set, as Megatron's do
    test_history: list = field(default_factory=list)  # (iteration, lm loss) of the test-split evaluation at the end
    exit_reason: str | None = None  # set when --exit-interval / --exit-duration-in-mins / a signal ended training
    context: "TrainContext | None" = field(default=None, repr=False)  # models, optimizer, scheduler, fp8 manager


@dataclass
class TrainContext:
    """The run's live objects, made by :func:`setup` (callers reach them through ``TrainState.context``)."""

    models: list
    chunks: list
    optimizer: object
    scheduler: object = None
    fp8: object = None  # megatronish.precision.fp8.Fp8Manager under --fp8-format (its state is checkpointed)
    memory: object = None  # megatronish.training.memory.ActivationMeter: estimate and first-iteration measurement
    parallel: ParallelContext | None = None  # the degrees and this rank's process groups
    cfg: object = None  # the RunConfig
    schedule: object = None  # the pipeline schedule, bound to its dtype, loss scaling and parallel context
    forward_step: object = None
    train_ds: object = None
    valid_ds: object = None
    test_ds: object = None  # --split's third share or --test-data-path: evaluated once at the end
    timers: object = None  # megatronish.training.timers.Timers (--timing-log-level, --log-straggler)
    checkpointer: object = None
    device: object = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str | None, timeout_minutes: float) -> None:
    """Initialize ``torch.distributed`` from torchrun's environment (no-op if already initialized)."""
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device.set_device_for_local_rank(local_rank)
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one, on a free local port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    dist.init_process_group(backend or device.default_backend(), timeout=timedelta(minutes=timeout_minutes))


def _is_logging_rank(parallel: ParallelContext) -> bool:
    return parallel.is_last_stage and parallel.tp_rank == 0 and parallel.dp_cp_rank == 0


def _reported_loss(stats: list[dict], parallel: ParallelContext) -> float:
    """The iteration's loss: mean over microbatches on the last stage, averaged over DP, then sent to every
    pipeline rank (so every rank can report it)."""
    loss = torch.zeros((), dtype=torch.float32, device=device.current_device())
    if parallel.is_last_stage:
        loss = torch.stack([s["lm loss"].float() for s in stats]).mean()
        group = parallel.dp_cp_group
        if group is not None and group.size() > 1:
            dist.all_reduce(loss, group=group)
            loss /= group.size()
    if parallel.pp_size > 1:
        dist.broadcast(loss, src=parallel.ranks("pp")[-1], group=parallel.pp_group)
    return loss.item()


def _batch_reader(dataset):
    """``read(indices) -> micro-batch`` (a dict of CPU tensors) for ``dataset``."""
    if isinstance(dataset, MockGPTDataset):
        return lambda idx: collate([{k: torch.as_tensor(v) for k, v in dataset[i].items()} for i in idx])
    from ..data.gpt_dataset import get_batch  # file data only: mock runs do not load the compiled helpers

    # file data: the micro-batch read at once (each document span copied once; same samples, same order)
    return functools.partial(get_batch, dataset)


def _microbatches(dataset, consumed: int, mbs: int, num_mb: int, dev, parallel: ParallelContext):
    read = _batch_reader(dataset)
    # CP ranks of one data-parallel replica read the same samples (each keeps its chunks of the sequence)
    for idx in global_batch_indices(consumed, mbs, parallel.dp_size, parallel.dp_rank, num_mb):
        yield {k: v.to(dev) for k, v in read(idx).items()}


def _train_loader(run: "TrainContext", state: "TrainState", train_iters: int) -> MicroBatchLoader:
    """``--num-workers`` worker processes reading the training micro-batches ahead, from the consumed samples on
    (the same batches for every worker count)."""
    cfg = run.cfg
    return MicroBatchLoader(_batch_reader(run.train_ds), consumed=state.consumed_samples,
                            micro_batch_size=cfg.train.micro_batch_size, dp_size=run.parallel.dp_size,
                            dp_rank=run.parallel.dp_rank, num_microbatches=cfg.num_microbatches,
                            global_batch_size=cfg.train.global_batch_size,
                            iterations=max(0, train_iters - state.iteration), num_workers=cfg.data.num_workers,
                            pin_memory=run.device.type == "cuda", timer=run.timers("batch-generator"),
                            worker_init=watchdog.data_worker_init)


def _forward_step(reset_position_ids: bool, parallel: ParallelContext):
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

        def loss_func(losses):  # per-token losses [b, s] -> masked token mean
            total = (losses.float() * mask).sum()
            if cp == 1:
                num_tokens = mask.sum().clamp(min=1)
                loss = total / num_tokens
                return loss, {"lm loss": loss.detach()}
            # The token-loss sum and the token count of the whole sequence: summed over CP. Gradients flow through
            # this rank's sum only and are averaged over DP x CP, hence the factor CP (as Megatron does).
            stats = torch.stack([total.detach(), mask.sum()])
            dist.all_reduce(stats, group=cp_group)
            num_tokens = stats[1].clamp(min=1)
            return total * cp / num_tokens, {"lm loss": stats[0] / num_tokens}

        return output, loss_func

    return forward_step


def build_datasets(cfg):
    """Train, validation and test datasets (test: None when the split has no share). ``--mock-data`` here; files
    through the data package."""
    d = cfg.data
    if d.mock_data:
        return tuple(MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + i)
                     for i in range(3))
    from .data_wiring import build_file_datasets  # the data package, loaded only when files are used

    return build_file_datasets(cfg)


def _data_iterators(run: TrainContext, dataset, consumed: int, batches: list[dict] | None = None):
    """One iterator over this iteration's microbatches per model chunk (each chunk reads them in order): read
    here, or ``batches`` read ahead by the loader."""
    cfg = run.cfg
    if batches is not None:
        on_device = [{k: v.to(run.device, non_blocking=True) for k, v in b.items()} for b in batches]
        its = [iter(on_device) for _ in run.chunks]
    else:
        its = [_microbatches(dataset, consumed, cfg.train.micro_batch_size, cfg.num_microbatches, run.device,
                             run.parallel) for _ in run.chunks]
    return its[0] if len(its) == 1 else its


def _model_arg(run: TrainContext):
    return run.chunks if len(run.chunks) > 1 else run.chunks[0]


def evaluate(run: TrainContext, state: TrainState, dataset=None) -> float:
    """Mean validation loss over ``--eval-iters`` global batches (DP-averaged); evaluations continue
    through the validation set. Another ``dataset`` (the test split) is read from its start."""
    t = run.cfg.train
    test = dataset is not None
    dataset = run.valid_ds if dataset is None else dataset
    for c in run.chunks:
        c.eval()
    losses = []
    with torch.no_grad():
        for i in range(t.eval_iters):
            it = _data_iterators(run, dataset, i * t.global_batch_size if test else state.valid_consumed_samples)
            if not test:
                state.valid_consumed_samples += t.global_batch_size
            stats = run.schedule(run.forward_step, it, _model_arg(run), run.cfg.num_microbatches,
                                 forward_only=True)
            losses.append(_reported_loss(stats, run.parallel))
    for c in run.chunks:
        c.train()
    return sum(losses) / len(losses) if losses else float("nan")


def _enable_fp8(models, model_cfg):
    """``--fp8-format``: FP8 linears in every chunk's transformer layers, one manager over all of them."""
    recipe = Fp8Recipe.from_config(model_cfg)
    if recipe is None:
        return None
    linears, group = {}, None
    for m in models:
        manager = enable_fp8(m, recipe)
        linears.update(manager.linears)
        group = manager.group
    return Fp8Manager(recipe, linears, group)


def _tensor_shape(cfg):
    m = cfg.model
    return pipeline_tensor_shape(m.seq_length, cfg.train.micro_batch_size, m.hidden_size, tp=cfg.parallel.tp,
                                 cp=cfg.parallel.cp, sequence_parallel=cfg.sequence_parallel)


# ============================================================================================== set-up
def setup(cfg) -> tuple[TrainContext, TrainState]:
    """Everything before the first iteration, in the fixed order of the module docstring (collective)."""
    t, o = cfg.train, cfg.optim
    check_transformer_impl(cfg.model.transformer_impl)  # before any process group (TE needs CUDA)
    init_distributed(t.distributed_backend, t.distributed_timeout_minutes)
    watchdog.start(dist.get_rank(), dist.get_world_size())  # entry points only: a failed or lost rank ends the job
    hcp = cfg.model.hierarchical_context_parallel_sizes
    parallel = groups.initialize_model_parallel(cfg.parallel, timeout_minutes=t.distributed_timeout_minutes,
                                                hierarchical_cp_inner=hcp[0] if hcp else None)
    dev = device.current_device()
    set_random_seed(t.seed, pp_rank=parallel.pp_rank, tp_rank=parallel.tp_rank)

    models = build_model_chunks(cfg.model, parallel, sequence_parallel=cfg.sequence_parallel, device=dev,
                                params_dtype=o.params_dtype)
    for m in models:
        m.init_parameters(t.seed)  # the fp32 values of the one-process model, cast to the params dtype
    fp8 = _enable_fp8(models, cfg.model)
    chunks = [DistributedDataParallel(m, dp_group=parallel.dp_cp_group, overlap_grad_reduce=o.overlap_grad_reduce,
                                      bucket_size=o.ddp_bucket_size, grad_dtype=o.grad_dtype,
                                      use_distributed_optimizer=o.use_distributed_optimizer,
                                      overlap_param_gather=o.overlap_param_gather)
              for m in models]
    grad_scaler = build_grad_scaler(o.fp16, o.loss_scale, o.initial_loss_scale, o.min_loss_scale,
                                    o.loss_scale_window, o.hysteresis)
    optimizer = get_megatron_optimizer(chunks, o, grad_scaler=grad_scaler,
                                       use_distributed_optimizer=o.use_distributed_optimizer, parallel=parallel)
    schedule = functools.partial(get_forward_backward_func(cfg.parallel.pp, cfg.parallel.vp),
                                 dtype=o.params_dtype, grad_scale_func=optimizer.scale_loss if grad_scaler else None,
                                 tensor_shape=_tensor_shape(cfg), parallel=parallel)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_steps_from_config(cfg))
    train_ds, valid_ds, test_ds = build_datasets(cfg)
    timers = Timers(cfg.logging.timing_log_level, always=("forward-backward",) if cfg.logging.log_straggler else ())
    run = TrainContext(models, chunks, optimizer, scheduler, fp8, parallel=parallel, cfg=cfg, schedule=schedule,
                       forward_step=_forward_step(cfg.data.reset_position_ids, parallel), train_ds=train_ds,
                       valid_ds=valid_ds, test_ds=test_ds, timers=timers, device=dev)
    optimizer.timers = timers  # params-all-gather
    state = TrainState(context=run)
    run.checkpointer = setup_checkpointing(cfg, models, optimizer, scheduler, state, parallel=parallel,
                                           fp8=fp8)  # --load
    optimizer.reload_model_params()  # fp32 master copies from the (loaded) 16-bit model, unless loaded themselves
    print_rank0 = _print_rank0()
    estimate = report_theoretical_memory(cfg, optimizer, models, print_fn=print_rank0)
    run.memory = ActivationMeter([p for m in models for p in m.parameters()], estimate=estimate["activations"])
    return run, state


def _print_rank0():
    return lambda msg: print_rank_last(dist.get_rank() == 0, msg)  # the first stage is fullest


# ============================================================================================== one step
@dataclass
class StepResult:
    loss: float
    update_successful: bool
    grad_norm: float | None


def train_step(run: TrainContext, state: TrainState, timeline: PipelineTimeline | None = None,
               batches: list[dict] | None = None) -> StepResult:
    """One iteration on the global batch at ``state.consumed_samples`` (``batches``: its micro-batches, read ahead
    by the loader; None: read here); advances ``state``."""
    cfg = run.cfg
    timers = run.timers or Timers(0)
    for c in run.chunks:
        c.zero_grad_buffer()
    if batches is None:
        with timers("batch-generator"):
            batches = list(_microbatches(run.train_ds, state.consumed_samples, cfg.train.micro_batch_size,
                                         cfg.num_microbatches, torch.device("cpu"), run.parallel))
    it = _data_iterators(run, run.train_ds, state.consumed_samples, batches)
    with run.memory.measure(), timers("forward-backward"):  # saved-activation bytes / allocator peak, first iteration
        stats = run.schedule(run.forward_step, it, _model_arg(run), cfg.num_microbatches, timeline=timeline)
    run.memory.report(print_fn=_print_rank0())
    nan_check.inject_for_test(run.chunks, stats, state.iteration + 1)  # a test hook; nothing unless asked
    # --check-for-nan-in-loss-and-grad: before the optimizer step; before the data-parallel reduction where it has
    # not started yet (the rank that produced a NaN is named), after it under --overlap-grad-reduce
    check = functools.partial(nan_check.check_loss_and_grads, run.models, run.chunks, stats,
                              iteration=state.iteration + 1, check_grads=run.optimizer.grad_scaler is None)
    early = cfg.train.check_for_nan_in_loss_and_grad and not cfg.optim.overlap_grad_reduce
    if early:
        check()
    with timers("grads-reduce-scatter" if cfg.optim.use_distributed_optimizer else "grads-all-reduce"):
        finalize_model_grads(run.chunks, run.parallel)
    if cfg.train.check_for_nan_in_loss_and_grad and not early:
        check()
    loss = _reported_loss(stats, run.parallel)
    with timers("optimizer"):
        update_successful, grad_norm = run.optimizer.step()  # unscale/overflow check, clip, step, copy back
    if run.fp8 is not None:
        run.fp8.update()  # amax histories and next scales, once per optimizer step
    if update_successful:  # Megatron: the LR/WD schedule advances only with an applied update
        run.scheduler.step(increment=cfg.train.global_batch_size)
    state.iteration += 1
    state.consumed_samples += cfg.train.global_batch_size
    state.history.append((state.iteration, loss))
    return StepResult(loss, update_successful, grad_norm)


# ============================================================================================== logging
class TrainLogger:
    """Per-interval averages, one record per log interval written to the metrics sinks and printed as
    Megatron's log line; validation records."""

    def __init__(self, run: TrainContext, train_iters: int):
        cfg, lg = run.cfg, run.cfg.logging
        self.run, self.cfg, self.train_iters = run, cfg, train_iters
        self.logging_rank = _is_logging_rank(run.parallel)
        self.writer = MetricsWriter(self.logging_rank, lg.metrics_file, lg.tensorboard_dir, lg.wandb_project or None,
                                    lg.wandb_entity or None, lg.wandb_exp_name or None, lg.wandb_save_dir or None)
        self.flops_per_iter = num_floating_point_operations(cfg.model, cfg.train.global_batch_size)
        self.peak = device_peak_tflops(device.device_name())
        self.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        self.skipped = self.nan_iters = 0
        self.restart_window()

    def restart_window(self) -> None:
        self.window_losses, self.window_start = [], time.perf_counter()

    def after_step(self, state: TrainState, step: StepResult) -> None:
        if not step.update_successful:
            self.skipped += 1
            self.nan_iters += int(not math.isfinite(step.loss)
                                  or (step.grad_norm is not None and not math.isfinite(step.grad_norm)))
        self.window_losses.append(step.loss)
        if state.iteration % self.cfg.logging.log_interval == 0 or state.iteration == self.train_iters:
            self._log(state, step.grad_norm)

    def _log(self, state: TrainState, grad_norm: float | None) -> None:
        run, lg = self.run, self.cfg.logging
        device.synchronize()
        elapsed = (time.perf_counter() - self.window_start) / len(self.window_losses)
        tflops = self.flops_per_iter / elapsed / run.parallel.world_size / 1e12
        params_norm = None
        if lg.log_params_norm:
            run.optimizer.finish_param_sync()
            params_norm = global_norm([p for m in run.models for p in m.parameters()], use_grad=False,
                                      parallel=run.parallel)
        record = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                  "lm_loss": sum(self.window_losses) / len(self.window_losses),
                  "lr": run.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                  "loss_scale": run.optimizer.loss_scale, "elapsed_ms": elapsed * 1e3,
                  "tokens_per_sec": self.tokens_per_iter / elapsed, "tflops": tflops,
                  "skipped_iterations": self.skipped, "nan_iterations": self.nan_iters}
        if params_norm is not None:
            record["params_norm"] = params_norm
        timing, straggler = self._gather_timers(len(self.window_losses))
        if straggler is not None:
            record["straggler"] = straggler[1]
        self.writer.write(record, state.iteration)
        r = record
        print_rank_last(self.logging_rank, train_log_line(
            iteration=r["iteration"], train_iters=self.train_iters, consumed_samples=r["consumed_samples"],
            elapsed_ms=r["elapsed_ms"], tflops=r["tflops"] if lg.log_throughput else None,
            tokens_per_sec=r["tokens_per_sec"], lr=r["lr"],
            global_batch_size=self.cfg.train.global_batch_size, loss=r["lm_loss"], grad_norm=r["grad_norm"],
            loss_scale=r["loss_scale"], skipped=r["skipped_iterations"], nan=r["nan_iterations"],
            params_norm=params_norm, mfu=(tflops / self.peak) if self.peak else None))
        # Megatron prints the timers from the last rank; the straggler line with the log line
        if straggler is not None:
            print_rank_last(self.logging_rank, straggler[0])
        if timing:
            print_rank_last(dist.get_rank() == dist.get_world_size() - 1, timing)
        self.restart_window()

    def _gather_timers(self, iterations: int):
        """The interval's timers over all ranks (collective when --timing-log-level or --log-straggler asks)."""
        timers, lg = self.run.timers, self.cfg.logging
        if timers is None:
            return None, None
        names = timers.names()
        if not names:
            return None, None
        times = timers.gather(names)
        timing = timers.min_max_string(times, names, normalizer=iterations)
        straggler = None
        if lg.log_straggler:
            compute = times[:, names.index("forward-backward")].tolist()
            straggler = straggler_lines(compute, lg.straggler_minmax_count, normalizer=iterations)
        return timing, straggler

    def evaluate(self, state: TrainState, test: bool = False) -> None:
        """Validation (or, ``test``, the test split's evaluation at the end, as Megatron's ``on test set``)."""
        loss = evaluate(self.run, state, self.run.test_ds if test else None)
        ppl = math.exp(min(20.0, loss))
        (state.test_history if test else state.valid_history).append((state.iteration, loss))
        self.writer.write({"split": "test" if test else "valid", "iteration": state.iteration, "lm_loss": loss,
                           "ppl": ppl}, state.iteration)
        bar = "-" * 100
        where = " on test set" if test else ""
        print_rank_last(self.logging_rank, f"{bar}\n validation loss at iteration {state.iteration}{where} | lm "
                                           f"loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |\n{bar}")

    def close(self) -> None:
        self.writer.close()


def _write_timeline(run: TrainContext, timeline: PipelineTimeline) -> None:
    cfg = run.cfg
    events = gather_timeline(timeline)
    if dist.get_rank() == 0:
        write_chrome_trace(cfg.logging.pipeline_timeline, events,
                           metadata={"p": cfg.parallel.pp, "v": cfg.parallel.vp, "m": cfg.num_microbatches})


# ============================================================================================== the loop
def pretrain(cfg) -> TrainState:
    """Train (and evaluate) as configured by a :class:`megatronish.config.RunConfig`."""
    run, state = setup(cfg)
    t = cfg.train
    train_iters = 0 if t.skip_train else t.train_iters
    logger = TrainLogger(run, train_iters)
    exit_policy = ExitPolicy(cfg.checkpoint)
    loader = _train_loader(run, state, train_iters)
    try:
        while state.iteration < train_iters:
            last = state.iteration == train_iters - 1
            timeline = PipelineTimeline() if cfg.logging.pipeline_timeline and last else None
            step = train_step(run, state, timeline, loader.next_iteration())
            if timeline is not None:
                _write_timeline(run, timeline)
            logger.after_step(state, step)
            if t.eval_interval and t.eval_iters and state.iteration % t.eval_interval == 0 \
                    and state.iteration < train_iters:
                logger.evaluate(state)
                logger.window_start = time.perf_counter()  # evaluation time is not training time
            state.exit_reason = exit_policy.after_iteration(state, run.checkpointer)
            if state.exit_reason:
                break

        loader.close()
        if t.eval_iters and not state.exit_reason:
            logger.evaluate(state)
            if run.test_ds is not None and len(run.test_ds) > 0:
                logger.evaluate(state, test=True)
        run.optimizer.finish_param_sync()  # callers get complete parameters (--overlap-param-gather)
        run.checkpointer.finish(state)  # final save; waits for background writes
    finally:
        loader.close()
        exit_policy.release()
    logger.close()
    return state
