"""Dataclass configs. Field names follow Megatron-LM's flags (``--hidden-size`` -> ``hidden_size``)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from .errors import ConfigError

# The model's config and its groups live in model_config; re-exported here, where every config is found.
from .model_config import (  # noqa: F401
    ATTENTION_BACKENDS,
    GROUP_OF,
    GROUPS,
    AttentionConfig,
    KernelConfig,
    ModelConfig,
    MoEConfig,
    PrecisionConfig,
    RecomputeConfig,
    config_dict,
    default_ffn_hidden_size,
    gpt2,
    llama,
    padded_vocab_size,
)
from .parallel.dims import ParallelDims


# ---------------------------------------------------------------------------------------------------------------
# --rampup-batch-size: Megatron's RampupBatchsizeNumMicroBatchesCalculator, as pure functions of consumed samples
# ---------------------------------------------------------------------------------------------------------------
def rampup_global_batch_size(consumed_samples: int, start: int, increment: int, rampup_samples: int,
                             global_batch_size: int) -> int:
    """The global batch size after ``consumed_samples`` under ``--rampup-batch-size start increment samples``:
    ``global_batch_size`` past ``rampup_samples``, else ``start + increment * int(consumed / per_increment)`` with
    ``per_increment = rampup_samples / ((global_batch_size - start) / increment)`` (a float, as Megatron's)."""
    if consumed_samples > rampup_samples:
        return global_batch_size
    per_increment = rampup_samples / ((global_batch_size - start) // increment)
    return start + int(consumed_samples / per_increment) * increment


def rampup_problems(rampup, global_batch_size: int, per_step: int, flag: str = "--rampup-batch-size") -> list[str]:
    """What is wrong with ``--rampup-batch-size`` for this ``--global-batch-size`` and micro batch x DP
    (``per_step``); every batch size the ramp reaches must divide by ``per_step`` (Megatron asserts it when the
    ramp gets there; this checks it up front)."""
    if len(rampup) != 3:
        return [f"{flag} takes three numbers: <start batch size> <batch size increment> <ramp-up samples>, got "
                f"{len(rampup)}"]
    start, inc, samples = rampup
    shown = f"{flag} {start} {inc} {samples}"
    if start < 1 or inc < 1 or samples < 1:
        return [f"{shown}: the start batch size, the increment and the ramp-up samples must be >= 1"]
    if start >= global_batch_size or (global_batch_size - start) % inc:
        return [f"{shown}: --global-batch-size {global_batch_size} minus the start batch size must be a positive "
                f"multiple of the increment {inc}"]
    bad = sorted({b for _, b in rampup_steps(rampup, global_batch_size) if b % per_step})
    if bad:
        return [f"{shown}: the ramp reaches global batch size(s) {', '.join(map(str, bad[:5]))} not divisible by "
                f"--micro-batch-size x data-parallel size = {per_step}; pick a start and increment that are "
                f"multiples of {per_step}"]
    return []


def rampup_steps(rampup, global_batch_size: int, until_samples: int | None = None) -> list[tuple[int, int]]:
    """``(consumed samples, global batch size)`` of every iteration of the ramp, in order: the iterations that
    start at or before the ramp-up samples (and, if given, at or before ``until_samples``)."""
    start, inc, samples = (int(v) for v in rampup)
    out, consumed = [], 0
    while consumed <= samples and (until_samples is None or consumed <= until_samples):
        b = rampup_global_batch_size(consumed, start, inc, samples, global_batch_size)
        out.append((consumed, b))
        consumed += b
    return out


def rampup_train_iters(train_samples: int, rampup, global_batch_size: int) -> int:
    """Megatron's ``update_train_iters`` with a ramp: the ramp's iterations, then whole global batches of the
    remaining samples (a partial last batch is dropped)."""
    steps = rampup_steps(rampup, global_batch_size, until_samples=train_samples)
    consumed = sum(b for _, b in steps)
    iters = len(steps)
    if train_samples > consumed:
        iters += (train_samples - consumed) // global_batch_size
    return iters


# ---------------------------------------------------------------------------------------------------------------
# Run configuration built from the command line (``megatronish.arguments.configs_from_args``).
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, iterations, evaluation, seeds and the process-group settings."""

    micro_batch_size: int
    global_batch_size: int | None = None  # None: micro x DP, filled by RunConfig
    train_iters: int | None = None  # with --train-samples: train_samples // global_batch_size (RunConfig fills it)
    train_samples: int | None = None
    eval_iters: int = 100
    eval_interval: int | None = 1000
    skip_train: bool = False
    seed: int = 1234
    log_interval: int = 100
    distributed_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    distributed_timeout_minutes: int = 10
    use_cpu_initialization: bool = False
    # Megatron-LM compatibility flags (docs/flags.md)
    rampup_batch_size: list | None = None  # [start, increment, ramp-up samples]: see RunConfig.global_batch_size_at
    calculate_per_token_loss: bool = False  # normalize by the global batch's loss tokens, not per microbatch
    manual_gc: bool = False  # Python's garbage collector off; collections at fixed points
    manual_gc_interval: int = 0  # with --manual-gc: collect every N iterations (0: never during training)
    manual_gc_eval: bool = True  # with --manual-gc: collect before and after each evaluation
    empty_unused_memory_level: int = 0  # 1: free the allocator cache after backward, 2: also after the step
    profile: bool = False  # --profile: profile iterations [profile_step_start, profile_step_end)
    use_pytorch_profiler: bool = False  # torch.profiler (TensorBoard trace); else the CUDA profiler (nsys)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    notes: list = field(default_factory=list)  # one log line each for flags accepted with a note (docs/flags.md)
    torch_compile: bool = False  # compile each transformer layer and the loss (docs/fsdp.md)
    check_for_nan_in_loss_and_grad: bool = True  # stop before the optimizer step on a NaN/Inf loss or gradient
    # the rerun engine (training/rerun.py): rerun a suspicious iteration (disabled | validate_results | report_stats)
    rerun_mode: str = "validate_results"
    check_for_spiky_loss: bool = False  # a loss 10x the largest of the first 100 is suspicious
    check_for_large_grads: bool = False  # a gradient norm 10x the largest of the first 100 is suspicious
    error_injection_rate: int = 0  # testing: a fault in about one iteration in N
    error_injection_type: str = "transient_error"  # correct_result | transient_error | persistent_error


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, LR / weight-decay schedules and gradient reduction (Megatron flag names)."""

    optimizer: str = "adam"  # adam (AdamW: decoupled weight decay) | sgd
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    weight_decay: float = 0.01
    start_weight_decay: float = 0.01  # = weight_decay under --weight-decay-incr-style constant
    end_weight_decay: float = 0.01
    weight_decay_incr_style: str = "constant"
    clip_grad: float = 1.0
    # the step taken before the stages agree on its norm, validated one iteration later (optim/post_validation.py)
    enable_optimizer_post_validation: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    overlap_grad_reduce: bool = False
    overlap_p2p_comm: bool = False  # pipeline receives posted ahead, waited for when used (docs/pipeline.md)
    ddp_bucket_size: int | None = None  # None: DDP's default (Megatron's rule)
    # mixed precision (docs/precision.md)
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # --loss-scale: constant scale; None: dynamic (fp16 only)
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    accumulate_allreduce_grads_in_fp32: bool = False  # forced on under --bf16 unless --grad-reduce-in-bf16
    grad_reduce_in_bf16: bool = False
    # distributed optimizer (ZeRO-1 over DP)
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    # Megatron-LM compatibility flags (docs/flags.md)
    decoupled_lr: float | None = None  # own peak LR for the word embedding and output layer
    decoupled_min_lr: float | None = None  # and their own final LR (default --min-lr)
    # FSDP2 (docs/fsdp.md)
    use_torch_fsdp2: bool = False
    fsdp_reshard_after_forward: str = "default"  # default (never under PP, else always) | always | never
    fsdp_prefetch_layers: int = 1

    @property
    def params_dtype(self):
        import torch
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def grad_dtype(self):
        """The DDP gradient buffer's dtype: fp32 for fp32 models and with fp32 accumulation, else the params'."""
        import torch
        if self.params_dtype == torch.float32 or self.accumulate_allreduce_grads_in_fp32:
            return torch.float32
        return self.params_dtype


@dataclass(frozen=True)
class LoggingConfig:
    """Console log line, JSON-lines metrics file, TensorBoard, W&B and MLflow."""

    log_interval: int = 100
    log_throughput: bool = False
    log_params_norm: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str = ""
    wandb_entity: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    mlflow_experiment_name: str | None = None  # MLflow logging on (training/mlflow_run.py)
    mlflow_run_name: str | None = None  # a new run's name (None: MLflow picks one)
    mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else file:<--save or .>/mlruns
    timing_log_level: int = 0
    moe_per_layer_logging: bool = False  # the MoE losses of every layer, not only their mean
    log_straggler: bool = False  # each log interval: every rank's compute time, the slowest rank named
    straggler_minmax_count: int = 1  # how many fastest/slowest ranks --log-straggler names
    metrics_file: str | None = None
    pipeline_timeline: str | None = None  # Chrome trace of the last training iteration's pipeline events
    report_plan: bool = False  # the planner's prediction at start, the first log window's measurement beside it
    report_plan_gpu: str | None = None  # the planner's hardware kind for it (None: this machine's)


@dataclass(frozen=True)
class DataConfig:
    """Training data and tokenizer. The sequence length is the model's (``ModelConfig.seq_length``); the true
    vocabulary size is the tokenizer's, ``ModelConfig.vocab_size``."""

    mock_data: bool = False
    data_path: list[str] = field(default_factory=list)
    split: str = "969, 30, 1"
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    num_workers: int = 2
    tokenizer_type: str | None = None  # None: NullTokenizer with --vocab-size, else GPT2BPETokenizer
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size_flag: int | None = None  # --vocab-size as given (NullTokenizer: vocab_size = this + 1)
    vocab_extra_ids: int = 0
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # Megatron-LM compatibility flags (docs/flags.md)
    mmap_bin_files: bool = True  # --no-mmap-bin-files: read .bin files with file reads instead of a memmap
    tiktoken_pattern: str | None = None  # TikTokenizer's split pattern (v1 | v2; None: v2)

    def __post_init__(self):
        if self.tokenizer_type is None:  # the construction's own default (configs are frozen after it)
            object.__setattr__(self, "tokenizer_type",
                               "NullTokenizer" if self.vocab_size_flag is not None else "GPT2BPETokenizer")

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer, built once on first use (it may read files): the model's vocabulary size and the data
        pipeline's eod/pad ids both come from this object. Not a dataclass field, so never serialized."""
        from .data.tokenizers import build_tokenizer  # reads tokenizer files; only when used

        try:
            return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                                   tokenizer_model=self.tokenizer_model, vocab_size=self.vocab_size_flag,
                                   vocab_extra_ids=self.vocab_extra_ids, tiktoken_pattern=self.tiktoken_pattern or "v2")
        except (ValueError, OSError) as e:
            raise ConfigError(str(e).splitlines()[0] if str(e) else f"--tokenizer-type {self.tokenizer_type}: "
                              f"{e!r}") from e


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint saving/loading and the exit conditions that save (Megatron flag names; docs/checkpoint.md)."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    async_save: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    use_checkpoint_args: bool = False
    no_verify_checkpoint: bool = False  # skip the CRC-32 check of the tensor data read on load
    ckpt_format: str = "torch_dist"
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"  # SIGTERM | SIGINT | SIGUSR1 | SIGUSR2
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    # (iteration directory, iteration) of the --load checkpoint, resolved once when --use-checkpoint-args read its
    # config (checkpoint.args.resolve_load); the loader loads that one. None: the loader resolves --load itself.
    load_resolved: tuple[str, int | None] | None = None
    # --load names a Hugging Face model directory (checkpoint.layout.is_hf_model_dir): its weights are read into
    # this run's layout (convert/hf_load.py) and training starts at iteration 0 with a fresh optimizer
    load_hf: bool = False
    save_hf: str | None = None  # write the model as a Hugging Face directory (convert/hf_save.py)
    save_hf_interval: int | None = None  # None: at every checkpoint save (and the end of training)


@dataclass(frozen=True)
class RunConfig:
    """Everything ``pretrain()`` needs, validated before any process group starts
    (``megatronish.arguments.validate``).

    Derived values live here, each in one place: the global batch size default (``micro x DP``) and
    ``train_iters`` from ``--train-samples`` are filled into ``train`` on construction; ``sequence_parallel``,
    ``fsdp_active`` and ``num_microbatches`` are properties. Model-shape defaults (FFN size, max positions, head
    size, query groups) are :class:`ModelConfig`'s; layers per (virtual) stage are
    ``parallel.layers_per_stage(model.num_layers)``.
    """

    model: ModelConfig
    parallel: ParallelDims
    train: TrainingConfig
    optim: OptimizerConfig
    logging: LoggingConfig
    data: DataConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sequence_parallel_flag: bool = False  # --sequence-parallel as given; see the sequence_parallel property

    def __post_init__(self):
        # The derived batch values, filled into a copy of ``train`` (the given TrainingConfig is not changed)
        t = self.train
        fill = {}
        gbs = t.global_batch_size
        if gbs is None and t.micro_batch_size is not None:
            gbs = fill["global_batch_size"] = self.data_parallel_batch_size
        if t.train_iters is None and t.train_samples is not None and gbs:
            if t.rampup_batch_size is not None and not rampup_problems(t.rampup_batch_size, gbs, 1):
                fill["train_iters"] = rampup_train_iters(t.train_samples, t.rampup_batch_size, gbs)
            else:
                fill["train_iters"] = t.train_samples // gbs  # as Megatron-LM
        if fill:
            object.__setattr__(self, "train", dataclasses.replace(t, **fill))

    @property
    def sequence_parallel(self) -> bool:
        """Effective sequence parallelism: ``--sequence-parallel`` with TP > 1 (a no-op at TP 1, as in Megatron).

        The one place of this rule: validation, the model and its layers, the pipeline tensor shape and the memory
        report take this resolved boolean."""
        return bool(self.sequence_parallel_flag) and self.parallel.tp > 1

    @property
    def fsdp_active(self) -> bool:
        """FSDP2 wraps the model: ``--use-torch-fsdp2`` with more than one data-parallel (x CP) rank to shard over
        (with one it runs as DDP). The one place of this rule: the wrapping, the model's dtype, the memory report."""
        return bool(self.optim.use_torch_fsdp2) and self.parallel.dp * self.parallel.cp > 1

    @property
    def data_parallel_batch_size(self) -> int:
        """Samples of one microbatch step over all data-parallel ranks: ``micro_batch_size x DP``."""
        return self.train.micro_batch_size * self.parallel.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per iteration on each rank: ``global_batch_size // (micro_batch_size x DP)`` (under
        ``--rampup-batch-size`` the final one; :meth:`num_microbatches_at` gives each iteration's)."""
        return self.train.global_batch_size // self.data_parallel_batch_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Samples of the iteration that starts after ``consumed_samples``: ``--global-batch-size``, or under
        ``--rampup-batch-size`` the ramp's size (Megatron's num-microbatches calculator)."""
        t = self.train
        if t.rampup_batch_size is None:
            return t.global_batch_size
        start, inc, samples = t.rampup_batch_size
        return rampup_global_batch_size(consumed_samples, start, inc, samples, t.global_batch_size)

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Microbatches per rank of the iteration that starts after ``consumed_samples``."""
        return self.global_batch_size_at(consumed_samples) // self.data_parallel_batch_size

    @property
    def parallel_backend(self) -> str | None:
        """``--distributed-backend`` (None: nccl on CUDA, gloo on CPU)."""
        return self.train.distributed_backend
