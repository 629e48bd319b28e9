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
import gc
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
from ..model.moe import stats as moe_stats
from ..optim.clip_grads import global_norm
from ..optim.grad_scaler import build_grad_scaler
from ..optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from ..optim.optimizer import get_megatron_optimizer
from ..parallel import comm_log as comm
from ..parallel import groups
from ..parallel.context import ParallelContext
from ..parallel.context_parallel import split_for_context_parallel
from ..parallel.ddp import finalize_model_grads
from ..parallel.pipeline.schedules import get_forward_backward_func, pipeline_tensor_shape
from ..parallel.pipeline.timeline import PipelineTimeline, gather_timeline, write_chrome_trace
from ..parallel.random import set_random_seed
from ..precision.fp8 import Fp8Manager, Fp8Recipe, check_transformer_impl, enable_fp8
from . import nan_check, watchdog
from .compile import Compiler
from .exit import ExitPolicy
from .flops import device_peak_tflops, num_floating_point_operations
from .memory import ActivationMeter, report_theoretical_memory
from .metrics import MetricsWriter, print_rank_last, train_log_line
from .timers import Timers, straggler_lines
from .wrap import model_params_dtype, wrap_model_chunks


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
    compiler: object = None  # megatronish.training.compile.Compiler under --torch-compile


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


def _loss_sums(stats: list[dict], parallel: ParallelContext) -> torch.Tensor:
    """``[sum of token losses, loss tokens]`` of the whole global batch (Megatron's reporting: each microbatch
    reports both, summed over microbatches and DP x CP), on every rank (sent from the last pipeline stage)."""
    sums = torch.zeros(2, dtype=torch.float32, device=device.current_device())
    if parallel.is_last_stage:
        sums = torch.stack([s["lm loss"].float() for s in stats]).sum(0)
        group = parallel.dp_cp_group
        if group is not None and group.size() > 1:
            comm.all_reduce(sums, group=group)
    if parallel.pp_size > 1:
        comm.broadcast(sums, src=parallel.ranks("pp")[-1], group=parallel.pp_group)
    return sums


def _reported_loss(stats: list[dict], parallel: ParallelContext) -> float:
    """The iteration's loss: the token-weighted mean over the global batch (Megatron's), on every rank."""
    total, tokens = _loss_sums(stats, parallel).tolist()
    return total / max(tokens, 1.0)


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
    (the same batches for every worker count; under ``--rampup-batch-size`` each iteration's ramped batch)."""
    cfg = run.cfg
    return MicroBatchLoader(_batch_reader(run.train_ds), consumed=state.consumed_samples,
                            micro_batch_size=cfg.train.micro_batch_size, dp_size=run.parallel.dp_size,
                            dp_rank=run.parallel.dp_rank, global_batch_size=cfg.global_batch_size_at,
                            iterations=max(0, train_iters - state.iteration), num_workers=cfg.data.num_workers,
                            pin_memory=run.device.type == "cuda", timer=run.timers("batch-generator"),
                            worker_init=watchdog.data_worker_init)


def _forward_step(reset_position_ids: bool, parallel: ParallelContext, per_token_loss: bool = False):
    """Megatron's ``forward_step``/``loss_func``. Each microbatch reports ``[token-loss sum, loss tokens]`` of
    this rank's tokens. The loss back-propagated is the microbatch's token mean (the schedule divides it by the
    number of microbatches), or under ``per_token_loss`` the token sum (the gradients are divided by the global
    batch's token count after the backward)."""
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
            total = (losses.float() * mask).sum()
            report = {"lm loss": torch.stack([total.detach(), mask.sum()])}
            if per_token_loss:
                return total, report
            if cp == 1:
                return total / mask.sum().clamp(min=1), report
            # The token count of the whole sequence: summed over CP. Gradients flow through this rank's sum only
            # and are averaged over DP x CP, hence the factor CP.
            num_tokens = mask.sum()
            comm.all_reduce(num_tokens, group=cp_group)
            return total * cp / num_tokens.clamp(min=1), report

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


def _data_iterators(run: TrainContext, dataset, consumed: int, num_microbatches: int | None = None,
                    batches: list[dict] | None = None):
    """One iterator over this iteration's microbatches per model chunk (each chunk reads them in order): read
    here, or ``batches`` read ahead by the loader."""
    cfg = run.cfg
    num_mb = cfg.num_microbatches if num_microbatches is None else num_microbatches
    if batches is not None:
        on_device = [{k: v.to(run.device, non_blocking=True) for k, v in b.items()} for b in batches]
        its = [iter(on_device) for _ in run.chunks]
    else:
        its = [_microbatches(dataset, consumed, cfg.train.micro_batch_size, num_mb, run.device, run.parallel)
               for _ in run.chunks]
    return its[0] if len(its) == 1 else its


def _model_arg(run: TrainContext):
    return run.chunks if len(run.chunks) > 1 else run.chunks[0]


def evaluate(run: TrainContext, state: TrainState, dataset=None) -> float:
    """Validation loss over ``--eval-iters`` global batches: token losses summed over all of them divided by
    their loss tokens (Megatron's); evaluations continue through the validation set. Another ``dataset`` (the test
    split) is read from its start."""
    t = run.cfg.train
    test = dataset is not None
    dataset = run.valid_ds if dataset is None else dataset
    gc_around = t.manual_gc and t.manual_gc_eval
    if gc_around:
        gc.collect()
    for c in run.chunks:
        c.eval()
    sums = None
    with torch.no_grad():
        for i in range(t.eval_iters):
            it = _data_iterators(run, dataset, i * t.global_batch_size if test else state.valid_consumed_samples)
            if not test:
                state.valid_consumed_samples += t.global_batch_size
            stats = run.schedule(run.forward_step, it, _model_arg(run), run.cfg.num_microbatches,
                                 forward_only=True)
            batch = _loss_sums(stats, run.parallel)
            sums = batch if sums is None else sums + batch
            if t.empty_unused_memory_level >= 1:
                device.empty_cache()
    for c in run.chunks:
        c.train()
    if gc_around:
        gc.collect()
    if sums is None:
        return float("nan")
    total, tokens = sums.tolist()
    return total / max(tokens, 1.0)


def _enable_fp8(models, model_cfg):
    """``--fp8-format``: FP8 linears in every chunk's transformer layers, one manager over all of them.
    ``--transformer-impl transformer_engine``: those linears run through Transformer Engine (FP8 or not)."""
    if model_cfg.transformer_impl == "transformer_engine":
        from ..precision.te_layers import TeManager, enable_te  # imports TE lazily

        managers = [enable_te(m, model_cfg.fp8, model_cfg.fp8_recipe, margin=model_cfg.fp8_margin,
                              amax_history_len=model_cfg.fp8_amax_history_len,
                              amax_compute_algo=model_cfg.fp8_amax_compute_algo) for m in models]
        first = managers[0]
        return TeManager(first.recipe, {k: v for mg in managers for k, v in mg.linears.items()}, first.group,
                         first.recipe_name)
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
    set_random_seed(t.seed, pp_rank=parallel.pp_rank, tp_rank=parallel.tp_rank, ep_rank=parallel.ep_rank,
                    etp_rank=parallel.etp_rank)

    models = build_model_chunks(cfg.model, parallel, sequence_parallel=cfg.sequence_parallel, device=dev,
                                params_dtype=model_params_dtype(cfg))
    for m in models:
        m.init_parameters(t.seed)  # the fp32 values of the one-process model, cast to the params dtype
    fp8 = _enable_fp8(models, cfg.model)
    chunks = wrap_model_chunks(models, cfg, parallel, print_fn=_print_rank0())  # DDP, or FSDP2
    compiler = None
    if t.torch_compile:  # compiled layers and loss (training/compile.py)
        compiler = Compiler(dev.type, print_fn=_print_rank0())
        compiler.apply(models)
    grad_scaler = build_grad_scaler(o.fp16, o.loss_scale, o.initial_loss_scale, o.min_loss_scale,
                                    o.loss_scale_window, o.hysteresis)
    optimizer = get_megatron_optimizer(chunks, o, grad_scaler=grad_scaler,
                                       use_distributed_optimizer=o.use_distributed_optimizer, parallel=parallel)
    schedule = functools.partial(get_forward_backward_func(cfg.parallel.pp, cfg.parallel.vp),
                                 dtype=o.params_dtype, grad_scale_func=optimizer.scale_loss if grad_scaler else None,
                                 tensor_shape=_tensor_shape(cfg), parallel=parallel,
                                 per_token_loss=t.calculate_per_token_loss)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_steps_from_config(cfg))
    train_ds, valid_ds, test_ds = build_datasets(cfg)
    timers = Timers(cfg.logging.timing_log_level, always=("forward-backward",) if cfg.logging.log_straggler else ())
    run = TrainContext(models, chunks, optimizer, scheduler, fp8, parallel=parallel, cfg=cfg, schedule=schedule,
                       forward_step=_forward_step(cfg.data.reset_position_ids, parallel, t.calculate_per_token_loss),
                       train_ds=train_ds, valid_ds=valid_ds, test_ds=test_ds, timers=timers, device=dev,
                       compiler=compiler)
    optimizer.timers = timers  # params-all-gather
    state = TrainState(context=run)
    run.checkpointer = setup_checkpointing(cfg, models, optimizer, scheduler, state, parallel=parallel,
                                           fp8=fp8)  # --load
    optimizer.reload_model_params()  # fp32 master copies from the (loaded) 16-bit model, unless loaded themselves
    print_rank0 = _print_rank0()
    for line in run_notes(cfg):
        print_rank0(f"note: {line}")
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
    global_batch_size: int = 0  # samples of this iteration (ramping under --rampup-batch-size)
    moe: dict | None = None  # mixture of experts: moe_stats.step_metrics


def compute_gradients(run: TrainContext, state: TrainState, timeline: PipelineTimeline | None = None,
                      batches: list[dict] | None = None) -> float:
    """Forward and backward of the global batch at ``state.consumed_samples`` (its size from the ramp under
    ``--rampup-batch-size``; ``batches``: its micro-batches read ahead by the loader, None: read here), the NaN
    check and the gradient finalization; returns the iteration's loss. The gradients are then in the DDP buffers
    (``param.main_grad``)."""
    cfg = run.cfg
    timers = run.timers or Timers(0)
    num_mb = cfg.num_microbatches_at(state.consumed_samples)
    for c in run.chunks:
        c.zero_grad_buffer()
    if batches is None:
        with timers("batch-generator"):
            batches = list(_microbatches(run.train_ds, state.consumed_samples, cfg.train.micro_batch_size, num_mb,
                                         torch.device("cpu"), run.parallel))
    it = _data_iterators(run, run.train_ds, state.consumed_samples, num_mb, batches)
    if cfg.model.num_experts is not None:  # the routers' losses take the main loss's backward scale
        per_token = cfg.train.calculate_per_token_loss
        moe_stats.start_step(run.models, run.optimizer.loss_scale / (1 if per_token else num_mb), per_token)
    with run.memory.measure(), timers("forward-backward"):  # saved-activation bytes / allocator peak, first iteration
        stats = run.schedule(run.forward_step, it, _model_arg(run), num_mb, timeline=timeline)
    if run.checkpointer is not None:  # --async-save: the snapshot is taken before anything below changes the state
        run.checkpointer.wait_for_snapshot()
    run.memory.report(print_fn=_print_rank0())
    if run.compiler is not None:
        run.compiler.report()  # the compile time, once
    nan_check.inject_for_test(run.chunks, stats, state.iteration + 1)  # a test hook; nothing unless asked
    # --check-for-nan-in-loss-and-grad: before the optimizer step; before the data-parallel reduction where it has
    # not started yet (the rank that produced a NaN is named), after it under --overlap-grad-reduce and FSDP2 (whose
    # backward reduce-scatters)
    check = functools.partial(nan_check.check_loss_and_grads, run.models, run.chunks, stats,
                              iteration=state.iteration + 1, check_grads=run.optimizer.grad_scaler is None)
    early = cfg.train.check_for_nan_in_loss_and_grad and not cfg.optim.overlap_grad_reduce \
        and all(hasattr(c, "grad_buffer") for c in run.chunks)
    if early:
        check()
    num_tokens = None
    if cfg.train.calculate_per_token_loss:  # this rank's loss tokens (last stage; finalize sends them on)
        num_tokens = torch.zeros((), dtype=torch.float32, device=device.current_device())
        if stats:
            num_tokens = torch.stack([s["lm loss"][1].float() for s in stats]).sum()
    with timers("grads-reduce-scatter" if cfg.optim.use_distributed_optimizer else "grads-all-reduce"):
        finalize_model_grads(run.chunks, run.parallel, num_tokens)
    if cfg.train.check_for_nan_in_loss_and_grad and not early:
        check()
    if cfg.model.num_experts is not None:
        moe_stats.update_expert_biases(run.models, run.parallel)
    if cfg.train.empty_unused_memory_level >= 1:
        device.empty_cache()
    return _reported_loss(stats, run.parallel)


def apply_update(run: TrainContext, state: TrainState, loss: float) -> StepResult:
    """The optimizer step on the finalized gradients, FP8 scales, the LR/WD schedule; advances ``state``."""
    batch = run.cfg.global_batch_size_at(state.consumed_samples)
    with (run.timers or Timers(0))("optimizer"):
        update_successful, grad_norm = run.optimizer.step()  # unscale/overflow check, clip, step, copy back
    if run.fp8 is not None:
        run.fp8.update()  # amax histories and next scales, once per optimizer step
    if update_successful:  # Megatron: the LR/WD schedule advances only with an applied update
        run.scheduler.step(increment=batch)
    if run.cfg.train.empty_unused_memory_level >= 2:
        device.empty_cache()
    state.iteration += 1
    state.consumed_samples += batch
    state.history.append((state.iteration, loss))
    return StepResult(loss, update_successful, grad_norm, batch)


def train_step(run: TrainContext, state: TrainState, timeline: PipelineTimeline | None = None,
               batches: list[dict] | None = None) -> StepResult:
    """One iteration on the global batch at ``state.consumed_samples`` (``batches``: its micro-batches, read ahead
    by the loader; None: read here); advances ``state``."""
    loss = compute_gradients(run, state, timeline, batches)
    cfg = run.cfg
    moe = None
    if cfg.model.num_experts is not None:  # collective: every rank, before the update advances the state
        moe = moe_stats.step_metrics(run.models, run.parallel, cfg.model,
                                     cfg.num_microbatches_at(state.consumed_samples))
    result = apply_update(run, state, loss)
    result.moe = moe
    return result


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
        self.peak = device_peak_tflops(device.device_name())
        self.skipped = self.nan_iters = 0
        self.restart_window()

    def restart_window(self) -> None:
        self.window_losses, self.window_batches, self.window_start = [], [], time.perf_counter()
        self.window_moe: list[dict] = []

    def after_step(self, state: TrainState, step: StepResult) -> None:
        if not step.update_successful:
            self.skipped += 1
            self.nan_iters += int(not math.isfinite(step.loss)
                                  or (step.grad_norm is not None and not math.isfinite(step.grad_norm)))
        self.window_losses.append(step.loss)
        self.window_batches.append(step.global_batch_size or self.cfg.train.global_batch_size)
        if step.moe is not None:
            self.window_moe.append(step.moe)
        if state.iteration % self.cfg.logging.log_interval == 0 or state.iteration == self.train_iters:
            self._log(state, step.grad_norm)

    def _log(self, state: TrainState, grad_norm: float | None) -> None:
        run, lg = self.run, self.cfg.logging
        device.synchronize()
        elapsed = (time.perf_counter() - self.window_start) / len(self.window_losses)
        batch = sum(self.window_batches) / len(self.window_batches)  # mean samples per iteration of the window
        tflops = num_floating_point_operations(self.cfg.model, batch) / elapsed / run.parallel.world_size / 1e12
        params_norm = None
        if lg.log_params_norm:
            run.optimizer.finish_param_sync()
            params_norm = global_norm([p for m in run.models for p in m.parameters()], use_grad=False,
                                      parallel=run.parallel, experts=self.cfg.model.num_experts is not None)
        record = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                  "lm_loss": sum(self.window_losses) / len(self.window_losses),
                  "lr": run.scheduler.lr, "grad_norm": grad_norm,
                  "loss_scale": run.optimizer.loss_scale, "elapsed_ms": elapsed * 1e3,
                  "tokens_per_sec": batch * self.cfg.model.seq_length / elapsed, "tflops": tflops,
                  "skipped_iterations": self.skipped, "nan_iterations": self.nan_iters}
        if params_norm is not None:
            record["params_norm"] = params_norm
        moe_line = self._moe_record(record)
        timing, straggler = self._gather_timers(len(self.window_losses))
        if straggler is not None:
            record["straggler"] = straggler[1]
        self.writer.write(record, state.iteration)
        r = record
        print_rank_last(self.logging_rank, train_log_line(
            iteration=r["iteration"], train_iters=self.train_iters, consumed_samples=r["consumed_samples"],
            elapsed_ms=r["elapsed_ms"], tflops=r["tflops"] if lg.log_throughput else None,
            tokens_per_sec=r["tokens_per_sec"], lr=r["lr"],
            global_batch_size=self.window_batches[-1], loss=r["lm_loss"], grad_norm=r["grad_norm"],
            loss_scale=r["loss_scale"], skipped=r["skipped_iterations"], nan=r["nan_iterations"],
            params_norm=params_norm, mfu=(tflops / self.peak) if self.peak else None, extra=moe_line))
        # Megatron prints the timers from the last rank; the straggler line with the log line
        if straggler is not None:
            print_rank_last(self.logging_rank, straggler[0])
        if timing:
            print_rank_last(dist.get_rank() == dist.get_world_size() - 1, timing)
        self.restart_window()
    def _moe_record(self, record: dict) -> dict:
        """The MoE metrics averaged over the log window, added to ``record`` (``moe/...`` keys); returns the
        losses for the log line (every layer's too with ``--moe-per-layer-logging``)."""
        if not self.window_moe:
            return {}
        n, line = len(self.window_moe), {}
        names = moe_stats.loss_names(self.cfg.model)
        for key in self.window_moe[0]:
            values = [m[key] for m in self.window_moe if key in m]
            if key.endswith("_layers"):
                if self.cfg.logging.moe_per_layer_logging:
                    for i, v in enumerate(values[0]):
                        if v is not None:
                            mean = sum(m[key][i] for m in self.window_moe) / n
                            record[f"moe/{key[:-len('_layers')]}_layer_{i}"] = mean
                            line[f"{key[:-len('_layers')]} layer {i}"] = mean
                continue
            record[f"moe/{key}"] = sum(values) / len(values)
            if key in names:
                line[key] = record[f"moe/{key}"]
        for key, shown in (("tokens_per_expert_min", "tokens per expert min"),
                           ("tokens_per_expert_max", "tokens per expert max"),
                           ("expert_imbalance", "expert imbalance (max/mean)"),
                           ("dropped_token_fraction", "dropped tokens")):
            if f"moe/{key}" in record:
                line[shown] = record[f"moe/{key}"]
        return line

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


def run_notes(cfg) -> list[str]:
    """The set-up's log lines for flags accepted with a note: those of the flags themselves
    (``TrainingConfig.notes``) and what depends on this device (attention backend, profiler, allocator cache)."""
    from ..model.attention import resolve_attention_backend

    t, notes = cfg.train, list(cfg.train.notes)
    asked = cfg.model.attention_backend
    used, why = resolve_attention_backend(asked, device.device_type())
    if used != asked:
        notes.append(f"--attention-backend {asked}: {why}; running as {used}")
    if t.profile and not t.use_pytorch_profiler and device.device_type() != "cuda":
        notes.append("--profile without --use-pytorch-profiler drives the CUDA profiler (nsys); there is no CUDA "
                     "device, so nothing is recorded (add --use-pytorch-profiler for a torch.profiler trace)")
    if t.empty_unused_memory_level and device.device_type() != "cuda":
        notes.append(f"--empty-unused-memory-level {t.empty_unused_memory_level}: the CPU allocator keeps no cache; "
                     "nothing to free")
    return notes


class _Profiler:
    """``--profile``: iterations ``[--profile-step-start, --profile-step-end)`` of the ranks in ``--profile-ranks``,
    with torch.profiler (``--use-pytorch-profiler``: a TensorBoard trace in ``--tensorboard-dir``) or the CUDA
    profiler (``nsys ... --capture-range=cudaProfilerApi``), as Megatron-LM does."""

    def __init__(self, cfg):
        t = cfg.train
        self.on = t.profile and dist.get_rank() in t.profile_ranks
        self.start_step, self.end_step, self.torch_profiler = t.profile_step_start, t.profile_step_end, None
        self.cuda = self.on and not t.use_pytorch_profiler and device.device_type() == "cuda"
        if self.on and t.use_pytorch_profiler:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start_step - 1, 0),
                                                 warmup=1 if self.start_step > 0 else 0,
                                                 active=self.end_step - self.start_step, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.logging.tensorboard_dir),
                record_shapes=True, with_stack=True)
            self.torch_profiler.start()

    def before_iteration(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.cuda and iteration == self.start_step:
            device.cuda_profiler(True)

    def after_iteration(self, iteration: int) -> None:
        if iteration != self.end_step:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda:
            device.cuda_profiler(False)


# ============================================================================================== the loop
def pretrain(cfg) -> TrainState:
    """Train (and evaluate) as configured by a :class:`megatronish.config.RunConfig`."""
    run, state = setup(cfg)
    t = cfg.train
    train_iters = 0 if t.skip_train else t.train_iters
    logger = TrainLogger(run, train_iters)
    exit_policy = ExitPolicy(cfg.checkpoint)
    profiler = _Profiler(cfg)
    if t.manual_gc:  # Megatron: collections only at fixed points, aligned across ranks
        gc.disable()
        gc.collect()
    num_mb = cfg.num_microbatches_at(state.consumed_samples)
    # --num-workers: micro-batches read ahead (under --rampup-batch-size, each iteration's ramped batch)
    loader = _train_loader(run, state, train_iters)
    try:
        while state.iteration < train_iters:
            profiler.before_iteration(state.iteration)
            if cfg.num_microbatches_at(state.consumed_samples) != num_mb and state.iteration and cfg.checkpoint.save:
                run.checkpointer.save(state)  # Megatron saves when the ramp changes the number of microbatches
            num_mb = cfg.num_microbatches_at(state.consumed_samples)
            last = state.iteration == train_iters - 1
            timeline = PipelineTimeline() if cfg.logging.pipeline_timeline and last else None
            step = train_step(run, state, timeline, loader.next_iteration() if loader else None)
            if timeline is not None:
                _write_timeline(run, timeline)
            logger.after_step(state, step)
            if t.eval_interval and t.eval_iters and state.iteration % t.eval_interval == 0 \
                    and state.iteration < train_iters:
                logger.evaluate(state)
                logger.window_start = time.perf_counter()  # evaluation time is not training time
            state.exit_reason = exit_policy.after_iteration(state, run.checkpointer)
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
    finally:
        if loader is not None:
            loader.close()
        exit_policy.release()
        if t.manual_gc:
            gc.enable()
    logger.close()
    return state
