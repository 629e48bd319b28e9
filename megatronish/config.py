"""Dataclass configs. Field names follow Megatron-LM's flags (``--hidden-size`` -> ``hidden_size``)."""
from __future__ import annotations

import functools
import math
from dataclasses import InitVar, dataclass, field

from .errors import ConfigError
from .parallel.dims import ParallelDims, effective_sequence_parallel


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padding: round up to a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def default_ffn_hidden_size(hidden_size: int, swiglu: bool = False) -> int:
    """``--ffn-hidden-size`` when not given: 4h, or Megatron's SwiGLU default ``int(8h/3 / 64) * 64``."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclass
class ModelConfig:
    """The GPT model's shape. GPT-2 and Llama are two settings of these fields (see ``gpt2``/``llama``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # true tokenizer vocabulary; the embedding is padded past it
    seq_length: int = 1024
    ffn_hidden_size: int | None = None  # default 4h, or Megatron's SwiGLU default int(8h/3 / 64) * 64
    kv_channels: int | None = None  # default h / heads
    num_query_groups: int | None = None  # default heads (no GQA)
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # or "rope" / "none"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # activation recompute (Megatron's flags)
    recompute_granularity: str | None = None  # "full" | "selective" (core attention)
    recompute_method: str | None = None  # "uniform" | "block"
    recompute_num_layers: int | None = None
    # FP8 (Megatron's flags; megatronish.precision.fp8.Fp8Recipe.from_config reads them)
    fp8: str | None = None  # --fp8-format: None (off) | "e4m3" | "hybrid"
    fp8_recipe: str = "delayed"  # "delayed" | "tensorwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # "most_recent" | "max"
    transformer_impl: str = "local"  # "local" | "transformer_engine"
    # fused Triton kernels (megatronish.kernels, docs/kernels.md)
    use_triton_kernels: bool = False  # --use-triton-kernels: RMSNorm/LayerNorm, RoPE, SwiGLU
    cross_entropy_loss_fusion: bool = False  # --cross-entropy-loss-fusion: the vocab-parallel loss
    cp_comm_type: str | list = "p2p"  # --cp-comm-type: p2p | a2a | allgather | a2a+p2p, or one per layer
    hierarchical_context_parallel_sizes: list | None = None  # a2a+p2p: [inner (a2a), outer (ring)]

    # False: fill the defaults only, and leave every problem to problems() (argument validation lists them all)
    check: InitVar[bool] = True

    def __post_init__(self, check: bool = True):
        h = self.hidden_size
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(h, self.swiglu)
        if self.kv_channels is None and self.num_attention_heads > 0 and h % self.num_attention_heads == 0:
            self.kv_channels = h // self.num_attention_heads  # else left None: problems() names the flags
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if check:
            problems = self.problems()
            if problems:
                raise ConfigError("\n".join(problems))

    def problems(self) -> list[str]:
        """This model's own problems, one line each (its fit to the parallel layout is
        :meth:`ParallelDims.validate_model`'s)."""
        out = []
        if self.kv_channels is None:
            out.append(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                       f"{self.num_attention_heads}; set --kv-channels or change one of them")
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            out.append(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                       f"--num-query-groups {self.num_query_groups}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            out.append(f"--position-embedding-type {self.position_embedding_type!r}: choose "
                       "learned_absolute, rope or none")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            out.append(f"--normalization {self.normalization!r}: choose LayerNorm or RMSNorm")
        if self.recompute_granularity not in (None, "full", "selective"):
            out.append(f"--recompute-granularity {self.recompute_granularity!r}: choose full or selective")
        if self.recompute_granularity == "selective" and self.recompute_method is not None:
            out.append("--recompute-method is not supported with --recompute-granularity selective "
                       "(it recomputes core attention in every layer); drop --recompute-method")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                out.append("--recompute-granularity full needs --recompute-method uniform or block")
            elif not self.recompute_num_layers or self.recompute_num_layers < 1:
                out.append("--recompute-granularity full needs --recompute-num-layers >= 1")
        return out

    @property
    def cp_comm_types(self) -> list[str]:
        """``--cp-comm-type`` as a list: one type for every layer, or one per layer."""
        return [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type)

    def cp_comm_type_of(self, layer_number: int) -> str:
        types = self.cp_comm_types
        return types[layer_number] if len(types) > 1 else types[0]

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def padded_vocab_size(self, tp: int = 1) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def gpt2(**kw) -> ModelConfig:
    """GPT-2 flavor: LayerNorm, learned absolute positions, GELU, biases, tied embeddings."""
    return ModelConfig(**kw)


def llama(**kw) -> ModelConfig:
    """Llama flavor: RMSNorm, RoPE, SwiGLU, no biases, untied output layer (GQA via num_query_groups)."""
    base = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True)
    base.update(kw)
    return ModelConfig(**base)


# ---------------------------------------------------------------------------------------------------------------
# Run configuration built from the command line (``megatronish.arguments.configs_from_args``).
# ---------------------------------------------------------------------------------------------------------------
@dataclass
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
    check_for_nan_in_loss_and_grad: bool = True  # stop before the optimizer step on a NaN/Inf loss or gradient


@dataclass
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
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    overlap_grad_reduce: bool = False
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


@dataclass
class LoggingConfig:
    """Console log line, JSON-lines metrics file, TensorBoard and W&B."""

    log_interval: int = 100
    log_throughput: bool = False
    log_params_norm: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str = ""
    wandb_entity: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    timing_log_level: int = 0
    log_straggler: bool = False  # each log interval: every rank's compute time, the slowest rank named
    straggler_minmax_count: int = 1  # how many fastest/slowest ranks --log-straggler names
    metrics_file: str | None = None
    pipeline_timeline: str | None = None  # Chrome trace of the last training iteration's pipeline events


@dataclass
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

    def __post_init__(self):
        if self.tokenizer_type is None:
            self.tokenizer_type = "NullTokenizer" if self.vocab_size_flag is not None else "GPT2BPETokenizer"

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer, built once on first use (it may read files): the model's vocabulary size and the data
        pipeline's eod/pad ids both come from this object. Not a dataclass field, so never serialized."""
        from .data.tokenizers import build_tokenizer  # reads tokenizer files; only when used

        try:
            return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                                   tokenizer_model=self.tokenizer_model, vocab_size=self.vocab_size_flag,
                                   vocab_extra_ids=self.vocab_extra_ids)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e).splitlines()[0] if str(e) else f"--tokenizer-type {self.tokenizer_type}: "
                              f"{e!r}") from e


@dataclass
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
    ckpt_format: str = "torch_dist"
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"  # SIGTERM | SIGINT | SIGUSR1 | SIGUSR2
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None


@dataclass
class RunConfig:
    """Everything ``pretrain()`` needs, validated before any process group starts
    (``megatronish.arguments.validate``).

    Derived values live here, each in one place: the global batch size default (``micro x DP``) and
    ``train_iters`` from ``--train-samples`` are filled into ``train`` on construction; ``sequence_parallel`` and
    ``num_microbatches`` are properties. Model-shape defaults (FFN size, max positions, head size, query groups)
    are :class:`ModelConfig`'s; layers per (virtual) stage are ``parallel.layers_per_stage(model.num_layers)``.
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
        t = self.train
        if t.global_batch_size is None and t.micro_batch_size is not None:
            t.global_batch_size = self.data_parallel_batch_size
        if t.train_iters is None and t.train_samples is not None and t.global_batch_size:
            t.train_iters = t.train_samples // t.global_batch_size  # as Megatron-LM

    @property
    def sequence_parallel(self) -> bool:
        """Effective sequence parallelism: ``--sequence-parallel`` with TP > 1 (a no-op at TP 1, as in Megatron)."""
        return effective_sequence_parallel(self.sequence_parallel_flag, self.parallel.tp)

    @property
    def data_parallel_batch_size(self) -> int:
        """Samples of one microbatch step over all data-parallel ranks: ``micro_batch_size x DP``."""
        return self.train.micro_batch_size * self.parallel.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per iteration on each rank: ``global_batch_size // (micro_batch_size x DP)``."""
        return self.train.global_batch_size // self.data_parallel_batch_size

    @property
    def parallel_backend(self) -> str | None:
        """``--distributed-backend`` (None: nccl on CUDA, gloo on CPU)."""
        return self.train.distributed_backend
