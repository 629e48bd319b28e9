"""``setup(cfg)``: everything before the first iteration, in a fixed order: distributed init -> the parallel
context (every process group) -> RNG seeds -> model (layout-invariant init) -> DDP or FSDP2 wrapper
(``training/wrap.py``) -> ``--torch-compile`` -> optimizer and LR/WD scheduler -> datasets -> checkpoint load ->
memory report. It returns the run's live objects (:class:`~megatronish.training.state.TrainContext`) and the
loop's state."""
from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta

import torch.distributed as dist

from .. import device
from ..checkpoint.manager import setup_checkpointing
from ..convert.hf_load import load_hf_weights
from ..convert.hf_save import HFExport
from ..data.mock import MockGPTDataset
from ..model.build import build_model_chunks
from ..optim.grad_scaler import build_grad_scaler
from ..optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from ..optim.optimizer import get_megatron_optimizer
from ..optim.post_validation import PostValidation
from ..parallel import groups
from ..parallel.pipeline.choose import forward_backward_func
from ..parallel.pipeline.schedules import pipeline_tensor_shape
from ..parallel.random import RNGStatesTracker, set_random_seed
from ..precision.fp8 import Fp8Manager, Fp8Recipe, check_transformer_impl, enable_fp8
from .attempt import attempt_store, uses_agent_store
from .compile import Compiler
from .memory import ActivationMeter, report_theoretical_memory
from .rerun import make_rerun
from .state import TrainContext, TrainState
from .step import in_region, make_forward_step, print_rank0
from .timers import Timers
from .watchdog import Watch
from .wrap import model_params_dtype, wrap_model_chunks

__all__ = ["setup", "init_distributed", "build_datasets", "enable_fp8_linears", "run_notes"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str | None, timeout_minutes: float) -> int:
    """Initialize ``torch.distributed`` from torchrun's environment (no-op if already initialized). Returns the
    job's attempt (0, or the restarts so far where torchrun's agent store outlives the workers: the process group
    then keeps its keys apart from the earlier attempts', ``training/attempt.py``)."""
    if dist.is_initialized():
        return 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device.set_device_for_local_rank(local_rank)
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one, on a free local port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    timeout = timedelta(minutes=timeout_minutes)
    backend = backend or device.default_backend()
    if not uses_agent_store():
        dist.init_process_group(backend, timeout=timeout)
        return 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt, store = attempt_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size,
                                   timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return attempt


def build_datasets(cfg):
    """Train, validation and test datasets (test: None when the split has no share). ``--mock-data`` here; files
    through the data package."""
    d = cfg.data
    if d.mock_data:
        return tuple(MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + i)
                     for i in range(3))
    from .data_wiring import build_file_datasets  # the data package, loaded only when files are used

    return build_file_datasets(cfg)


def enable_fp8_linears(models, model_cfg):
    """``--fp8-format``: FP8 linears in every chunk's transformer layers, one manager over all of them.
    ``--transformer-impl transformer_engine``: those linears run through Transformer Engine (FP8 or not)."""
    p = model_cfg.precision
    if p.transformer_impl == "transformer_engine":
        from ..precision.te_layers import TeManager, enable_te  # imports TE lazily

        managers = [enable_te(m, p.fp8, p.fp8_recipe, margin=p.fp8_margin, amax_history_len=p.fp8_amax_history_len,
                              amax_compute_algo=p.fp8_amax_compute_algo) for m in models]
        first = managers[0]
        return TeManager(first.recipe, {k: v for mg in managers for k, v in mg.linears.items()}, first.group,
                         first.recipe_name)
    recipe = Fp8Recipe.from_config(p)
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



def setup(cfg, watch: Watch | None = None) -> tuple[TrainContext, TrainState]:
    """Everything before the first iteration, in the fixed order of the module docstring (collective). ``watch``:
    the entry point's watchdog, started here once the process group is up (None: none, as for test harnesses)."""
    t, o = cfg.train, cfg.optim
    check_transformer_impl(cfg.model.precision.transformer_impl)  # before any process group (TE needs CUDA)
    attempt = init_distributed(t.distributed_backend, t.distributed_timeout_minutes)
    if watch is not None:  # entry points: a failed or lost rank ends the job
        watch.start(dist.get_rank(), dist.get_world_size(), attempt=attempt)
    if attempt:  # torchrun --max-restarts started every rank again (training/attempt.py)
        print_rank0()(f"attempt {attempt} of this job: the launcher restarted its ranks")
    parallel = groups.initialize_model_parallel(cfg.parallel, timeout_minutes=t.distributed_timeout_minutes)
    dev = device.current_device()
    rng_tracker = RNGStatesTracker()  # the run's RNG streams: the model's dropout and recompute, the checkpoint
    set_random_seed(t.seed, pp_rank=parallel.pp_rank, tp_rank=parallel.tp_rank, ep_rank=parallel.ep_rank,
                    etp_rank=parallel.etp_rank, tracker=rng_tracker)

    models = build_model_chunks(cfg.model, parallel, sequence_parallel=cfg.sequence_parallel, device=dev,
                                params_dtype=model_params_dtype(cfg), rng_tracker=rng_tracker)
    for m in models:
        m.init_parameters(t.seed)  # the fp32 values of the one-process model, cast to the params dtype
    fp8 = enable_fp8_linears(models, cfg.model)
    chunks = wrap_model_chunks(models, cfg, parallel, print_fn=print_rank0())  # DDP, or FSDP2
    compiler = None
    if t.torch_compile:  # compiled layers and loss (training/compile.py)
        compiler = Compiler(dev.type, print_fn=print_rank0())
        compiler.apply(models)
    grad_scaler = build_grad_scaler(o.fp16, o.loss_scale, o.initial_loss_scale, o.min_loss_scale,
                                    o.loss_scale_window, o.hysteresis)
    optimizer = get_megatron_optimizer(chunks, o, grad_scaler=grad_scaler,
                                       use_distributed_optimizer=o.use_distributed_optimizer, parallel=parallel)
    schedule = functools.partial(forward_backward_func(cfg.parallel.pp, cfg.parallel.vp,
                                                       cfg.parallel.pipeline_schedule),
                                 dtype=o.params_dtype, grad_scale_func=optimizer.scale_loss if grad_scaler else None,
                                 tensor_shape=_tensor_shape(cfg), parallel=parallel,
                                 per_token_loss=t.calculate_per_token_loss, overlap_p2p_comm=o.overlap_p2p_comm)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_steps_from_config(cfg))
    train_ds, valid_ds, test_ds = build_datasets(cfg)
    timers = Timers(cfg.logging.timing_log_level, always=("forward-backward",) if cfg.logging.log_straggler else ())
    forward_step = make_forward_step(cfg.data.reset_position_ids, parallel, t.calculate_per_token_loss,
                                     cfg.model.mtp_loss_scaling_factor)
    if hasattr(fp8, "autocast"):  # --transformer-impl transformer_engine: one TE autocast a forward
        forward_step = in_region(forward_step, fp8.autocast)
    run = TrainContext(models, chunks, optimizer, scheduler, fp8, parallel=parallel, cfg=cfg, schedule=schedule,
                       forward_step=forward_step,
                       train_ds=train_ds, valid_ds=valid_ds, test_ds=test_ds, timers=timers, device=dev,
                       compiler=compiler, rng_tracker=rng_tracker)
    optimizer.timers = timers  # params-all-gather
    run.rerun = make_rerun(cfg, parallel)  # --rerun-mode: a suspicious iteration runs again (training/rerun.py)
    if o.enable_optimizer_post_validation:  # the step validated one iteration later (optim/post_validation.py)
        run.post_validation = PostValidation(optimizer, scheduler)
    state = TrainState()
    if cfg.checkpoint.save_hf:  # --save-hf: written at checkpoint saves or its own interval (convert/hf_save.py)
        run.hf_export = HFExport(cfg, models, parallel)
    run.checkpointer = setup_checkpointing(cfg, models, optimizer, scheduler, state, parallel=parallel,
                                           fp8=fp8, rng_tracker=rng_tracker,
                                           on_save=run.hf_export.on_checkpoint_saved if run.hf_export else None)
    if cfg.checkpoint.load_hf:  # --load <HF directory>: each rank reads its own blocks (convert/hf_load.py)
        load_hf_weights(models, cfg, parallel, cfg.checkpoint.load)
    optimizer.reload_model_params()  # fp32 master copies from the (loaded) 16-bit model, unless loaded themselves
    say = print_rank0()
    for line in run_notes(cfg):
        say(f"note: {line}")
    estimate = report_theoretical_memory(cfg, optimizer, models, print_fn=say)
    run.memory = ActivationMeter([p for m in models for p in m.parameters()], estimate=estimate["activations"])
    return run, state


def run_notes(cfg) -> list[str]:
    """The set-up's log lines for flags accepted with a note: those of the flags themselves
    (``TrainingConfig.notes``) and what depends on this device (attention backend, profiler, allocator cache)."""
    from ..model.attention import resolve_attention_backend

    t, notes = cfg.train, list(cfg.train.notes)
    asked = cfg.model.attention.attention_backend
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


