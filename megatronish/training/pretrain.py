"""``pretrain(cfg)``: the training loop behind ``pretrain_gpt.py``.

Set-up order (fixed): distributed init -> process groups -> RNG seeds -> model (layout-invariant init) ->
DDP wrapper -> optimizer and LR/WD scheduler -> datasets. Then each iteration runs the schedule over
``num_microbatches`` microbatches, finalizes gradients (DP, SP, embedding group), clips, steps, and logs.
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import device
from ..checkpoint.manager import setup_checkpointing
from ..data.mock import MockGPTDataset
from ..data.sampler import collate, global_batch_indices
from ..model.build import build_model_chunks
from ..optim.clip_grads import global_norm
from ..optim.grad_scaler import build_grad_scaler
from ..optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from ..optim.optimizer import get_megatron_optimizer
from ..parallel import groups
from ..parallel.ddp import DistributedDataParallel, finalize_model_grads
from ..parallel.pipeline.schedules import get_forward_backward_func, pipeline_tensor_shape
from ..parallel.pipeline.timeline import PipelineTimeline, gather_timeline, write_chrome_trace
from ..parallel.random import set_random_seed
from ..precision.fp8 import Fp8Manager, Fp8Recipe, check_transformer_impl, enable_fp8
from .flops import device_peak_tflops, num_floating_point_operations
from .memory import ActivationMeter, report_theoretical_memory
from .metrics import MetricsWriter, print_rank_last, train_log_line


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    history: list = field(default_factory=list)  # (iteration, lm loss) of every iteration, for callers
    valid_history: list = field(default_factory=list)
    valid_consumed_samples: int = 0  # evaluations continue through the validation set, as Megatron's do
    exit_reason: str | None = None  # set when --exit-interval / --exit-duration-in-mins / a signal ended training
    context: "TrainContext | None" = field(default=None, repr=False)  # models, optimizer, scheduler, fp8 manager


@dataclass
class TrainContext:
    """The run's live objects, reachable from ``pretrain`` (and by callers through ``TrainState.context``)."""

    models: list
    chunks: list
    optimizer: object
    scheduler: object = None
    fp8: object = None  # megatronish.precision.fp8.Fp8Manager under --fp8-format (its state is checkpointed)
    memory: object = None  # megatronish.training.memory.ActivationMeter: estimate and first-iteration measurement


def init_distributed(backend: str | None, timeout_minutes: float) -> None:
    """Initialize ``torch.distributed`` from torchrun's environment (no-op if already initialized)."""
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device.set_device_for_local_rank(local_rank)
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    dist.init_process_group(backend or device.default_backend(), timeout=timedelta(minutes=timeout_minutes))


def _is_logging_rank() -> bool:
    return (groups.is_pipeline_last_stage() and groups.get_tensor_model_parallel_rank() == 0
            and groups.get_data_parallel_rank(with_context_parallel=True) == 0)


def _reported_loss(stats: list[dict]) -> float:
    """The iteration's loss: mean over microbatches on the last stage, averaged over DP, then sent to every
    pipeline rank (so every rank can report it)."""
    loss = torch.zeros((), dtype=torch.float32, device=device.current_device())
    if groups.is_pipeline_last_stage():
        loss = torch.stack([s["lm loss"].float() for s in stats]).mean()
        group = groups.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
    if groups.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(loss, src=groups.get_group_ranks("pp")[-1], group=groups.get_pipeline_model_parallel_group())
    return loss.item()


def _microbatches(dataset, consumed: int, mbs: int, num_mb: int, dev):
    dp_size = groups.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = groups.get_data_parallel_rank(with_context_parallel=True)
    for idx in global_batch_indices(consumed, mbs, dp_size, dp_rank, num_mb):
        batch = collate([{k: torch.as_tensor(v) for k, v in dataset[i].items()} for i in idx])
        yield {k: v.to(dev) for k, v in batch.items()}


def _forward_step(reset_position_ids: bool):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        position_ids = batch["position_ids"].long() if reset_position_ids else None
        output = model(batch["tokens"].long(), position_ids=position_ids, labels=batch["labels"].long())
        mask = batch["loss_mask"].float()

        def loss_func(losses):  # per-token losses [b, s] -> masked token mean
            total = (losses.float() * mask).sum()
            num_tokens = mask.sum().clamp(min=1)
            loss = total / num_tokens
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return forward_step


def build_datasets(cfg):
    """Train and validation datasets. ``--mock-data`` here; files through the data package."""
    d = cfg.data
    if d.mock_data:
        return (MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed),
                MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + 1))
    from .data_wiring import build_file_datasets  # the data package, loaded only when files are used

    return build_file_datasets(cfg)


def _data_iterators(dataset, consumed: int, cfg, num_chunks: int, dev):
    """One iterator over this iteration's microbatches per model chunk (each chunk reads them in order)."""
    t = cfg.train
    its = [_microbatches(dataset, consumed, t.micro_batch_size, cfg.num_microbatches, dev) for _ in range(num_chunks)]
    return its[0] if num_chunks == 1 else its


def evaluate(chunks, dataset, cfg, state: TrainState, forward_step, schedule, dev) -> float:
    """Mean validation loss over ``--eval-iters`` global batches (DP-averaged); evaluations continue
    through the validation set."""
    t = cfg.train
    for c in chunks:
        c.eval()
    losses = []
    with torch.no_grad():
        for _ in range(t.eval_iters):
            it = _data_iterators(dataset, state.valid_consumed_samples, cfg, len(chunks), dev)
            state.valid_consumed_samples += t.global_batch_size
            stats = schedule(forward_step, it, chunks if len(chunks) > 1 else chunks[0], cfg.num_microbatches,
                             forward_only=True, tensor_shape=_tensor_shape(cfg))
            losses.append(_reported_loss(stats))
    for c in chunks:
        c.train()
    return sum(losses) / len(losses) if losses else float("nan")


def _enable_fp8(models, model_cfg):
    """``--fp8-format``: FP8 linears in every chunk's transformer layers, one manager over all of them."""
    recipe = Fp8Recipe.from_config(model_cfg)
    if recipe is None:
        return None
    linears = {}
    for m in models:
        linears.update(enable_fp8(m, recipe).linears)
    return Fp8Manager(recipe, linears)


def _tensor_shape(cfg):
    m = cfg.model
    return pipeline_tensor_shape(m.seq_length, cfg.train.micro_batch_size, m.hidden_size,
                                 tp=cfg.parallel.tp, sequence_parallel=cfg.sequence_parallel)


def pretrain(cfg) -> TrainState:
    """Train (and evaluate) as configured by a :class:`megatronish.config.RunConfig`."""
    t, o, lg = cfg.train, cfg.optim, cfg.logging
    check_transformer_impl(cfg.model.transformer_impl)  # before any process group (TE needs CUDA)
    init_distributed(t.distributed_backend, t.distributed_timeout_minutes)
    if not groups.is_initialized():
        groups.initialize_model_parallel(cfg.parallel, timeout_minutes=t.distributed_timeout_minutes)
    dev = device.current_device()
    set_random_seed(t.seed, pp_rank=groups.get_pipeline_model_parallel_rank(),
                    tp_rank=groups.get_tensor_model_parallel_rank())

    models = build_model_chunks(cfg.model, cfg.parallel, groups.get_pipeline_model_parallel_rank(),
                                sequence_parallel=cfg.sequence_parallel, device=dev, params_dtype=o.params_dtype)
    for m in models:
        m.init_parameters(t.seed)  # the fp32 values of the one-process model, cast to the params dtype
    fp8 = _enable_fp8(models, cfg.model)
    chunks = [DistributedDataParallel(m, overlap_grad_reduce=o.overlap_grad_reduce, bucket_size=o.ddp_bucket_size,
                                      grad_dtype=o.grad_dtype, use_distributed_optimizer=o.use_distributed_optimizer,
                                      overlap_param_gather=o.overlap_param_gather)
              for m in models]
    params = [p for m in models for p in m.parameters()]
    grad_scaler = build_grad_scaler(o.fp16, o.loss_scale, o.initial_loss_scale, o.min_loss_scale,
                                    o.loss_scale_window, o.hysteresis)
    optimizer = get_megatron_optimizer(chunks, o, grad_scaler=grad_scaler,
                                       use_distributed_optimizer=o.use_distributed_optimizer)
    schedule = functools.partial(get_forward_backward_func(cfg.parallel.pp, cfg.parallel.vp),
                                 dtype=o.params_dtype, grad_scale_func=optimizer.scale_loss if grad_scaler else None)
    model_arg = chunks if len(chunks) > 1 else chunks[0]
    tensor_shape = _tensor_shape(cfg)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_steps_from_config(cfg))
    train_ds, valid_ds = build_datasets(cfg)
    forward_step = _forward_step(cfg.data.reset_position_ids)

    logging_rank = _is_logging_rank()
    writer = MetricsWriter(logging_rank, lg.metrics_file, lg.tensorboard_dir, lg.wandb_project or None,
                           lg.wandb_entity or None, lg.wandb_exp_name or None, lg.wandb_save_dir or None)
    state = TrainState()
    state.context = TrainContext(models, chunks, optimizer, scheduler, fp8)
    checkpointer = setup_checkpointing(cfg, models, optimizer, scheduler, state, fp8=fp8)  # --load; --save below
    optimizer.reload_model_params()  # fp32 master copies from the (loaded) 16-bit model, unless loaded themselves
    print_rank0 = lambda msg: print_rank_last(dist.get_rank() == 0, msg)  # noqa: E731 - the first stage is fullest
    estimate = report_theoretical_memory(cfg, optimizer, models, print_fn=print_rank0)
    meter = state.context.memory = ActivationMeter(params, estimate=estimate["activations"])
    train_iters = t.train_iters
    flops_per_iter = num_floating_point_operations(cfg.model, t.global_batch_size)
    peak = device_peak_tflops(device.device_name())
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    skipped = nan_iters = 0
    window_losses, window_start, window_iters = [], time.perf_counter(), 0

    if t.skip_train:
        train_iters = 0
    while state.iteration < train_iters:
        for c in chunks:
            c.zero_grad_buffer()
        it = _data_iterators(train_ds, state.consumed_samples, cfg, len(chunks), dev)
        timeline = PipelineTimeline() if lg.pipeline_timeline and state.iteration == train_iters - 1 else None
        with meter.measure():  # saved-activation bytes (CPU) / allocator peak (CUDA), first iteration
            stats = schedule(forward_step, it, model_arg, cfg.num_microbatches, tensor_shape=tensor_shape,
                             timeline=timeline)
        meter.report(print_fn=print_rank0)
        if lg.pipeline_timeline and state.iteration == train_iters - 1:
            events = gather_timeline(timeline)
            if dist.get_rank() == 0:
                write_chrome_trace(lg.pipeline_timeline, events,
                                   metadata={"p": cfg.parallel.pp, "v": cfg.parallel.vp, "m": cfg.num_microbatches})
        finalize_model_grads(chunks)
        loss = _reported_loss(stats)
        update_successful, grad_norm = optimizer.step()  # unscale/overflow check, clip, step, copy back
        if fp8 is not None:
            fp8.update()  # amax histories and next scales, once per optimizer step
        if update_successful:  # Megatron: the LR/WD schedule advances only with an applied update
            scheduler.step(increment=t.global_batch_size)
        else:
            skipped += 1
            nan_iters += int(not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)))
        state.iteration += 1
        state.consumed_samples += t.global_batch_size
        state.history.append((state.iteration, loss))
        window_losses.append(loss)
        window_iters += 1

        if state.iteration % lg.log_interval == 0 or state.iteration == train_iters:
            device.synchronize()
            elapsed = (time.perf_counter() - window_start) / window_iters
            world = dist.get_world_size()
            tflops = flops_per_iter / elapsed / world / 1e12
            avg_loss = sum(window_losses) / len(window_losses)
            if lg.log_params_norm:
                optimizer.finish_param_sync()
            params_norm = global_norm(params, use_grad=False) if lg.log_params_norm else None
            lr = optimizer.param_groups[0]["lr"]
            record = {"iteration": state.iteration, "consumed_samples": state.consumed_samples, "lm_loss": avg_loss,
                      "lr": lr, "grad_norm": grad_norm, "loss_scale": optimizer.loss_scale,
                      "elapsed_ms": elapsed * 1e3,
                      "tokens_per_sec": tokens_per_iter / elapsed, "tflops": tflops,
                      "skipped_iterations": skipped, "nan_iterations": nan_iters}
            if params_norm is not None:
                record["params_norm"] = params_norm
            writer.write(record, state.iteration)
            print_rank_last(logging_rank, train_log_line(
                iteration=state.iteration, train_iters=train_iters, consumed_samples=state.consumed_samples,
                elapsed_ms=elapsed * 1e3, tflops=tflops, tokens_per_sec=tokens_per_iter / elapsed, lr=lr,
                global_batch_size=t.global_batch_size, loss=avg_loss, grad_norm=grad_norm,
                loss_scale=optimizer.loss_scale,
                skipped=skipped, nan=nan_iters, params_norm=params_norm,
                mfu=(tflops / peak) if peak else None))
            window_losses, window_start, window_iters = [], time.perf_counter(), 0

        if t.eval_interval and t.eval_iters and state.iteration % t.eval_interval == 0 \
                and state.iteration < train_iters:
            _run_eval(chunks, valid_ds, cfg, state, forward_step, schedule, dev, writer, logging_rank)
            window_start = time.perf_counter()
        state.exit_reason = checkpointer.after_iteration(state)  # --save-interval, exit conditions
        if state.exit_reason:
            break

    if t.eval_iters and not state.exit_reason:
        _run_eval(chunks, valid_ds, cfg, state, forward_step, schedule, dev, writer, logging_rank)
    optimizer.finish_param_sync()  # callers get complete parameters (--overlap-param-gather)
    checkpointer.finish(state)  # final save; waits for background writes
    writer.close()
    return state


def _run_eval(chunks, dataset, cfg, state, forward_step, schedule, dev, writer, logging_rank) -> None:
    loss = evaluate(chunks, dataset, cfg, state, forward_step, schedule, dev)
    ppl = math.exp(min(20.0, loss))
    state.valid_history.append((state.iteration, loss))
    writer.write({"split": "valid", "iteration": state.iteration, "lm_loss": loss, "ppl": ppl}, state.iteration)
    bar = "-" * 100
    print_rank_last(logging_rank, f"{bar}\n validation loss at iteration {state.iteration} | lm loss value: "
                                  f"{loss:.6E} | lm loss PPL: {ppl:.6E} |\n{bar}")
