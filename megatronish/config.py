"""Dataclass configs. Field names follow Megatron-LM's flags (``--hidden-size`` -> ``hidden_size``)."""
from __future__ import annotations

import functools
import math
from dataclasses import InitVar, dataclass, field

from .errors import ConfigError
from .parallel.dims import ParallelDims

# --attention-backend choices (Megatron's AttnBackend)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


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
    qk_layernorm: bool = False  # --qk-layernorm: norm of each query/key head before RoPE (Qwen3)
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
    # mixture of experts (Megatron's flags and defaults; docs/moe.md)
    num_experts: int | None = None  # None: dense MLPs
    moe_layer_freq: int | list = 1  # every N-th layer is MoE, or a 1/0 pattern per layer
    moe_ffn_hidden_size: int | None = None  # default --ffn-hidden-size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_load_balancing_type: str | list = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float | list = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: str | None = None  # None (the activations') | fp32 | fp64
    moe_expert_capacity_factor: float | None = None  # None: no token dropping
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # Megatron-LM compatibility flags (docs/flags.md)
    attention_backend: str = "auto"  # --attention-backend: auto | flash | fused | unfused | local
    cross_entropy_fusion_impl: str = "native"  # with --cross-entropy-loss-fusion: native (PyTorch) | te (Triton)
    apply_layernorm_1p: bool = False  # zero-centered norm weights: the norm multiplies by (1 + weight)

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
        if self.num_experts and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if check:
            problems = self.problems()
            if problems:
                raise ConfigError("\n".join(problems))

    def problems(self) -> list[str]:
        """This model's own problems, one line each (its fit to the parallel layout is
        :func:`megatronish.parallel_config.validate_model`'s)."""
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
        if self.attention_backend not in ATTENTION_BACKENDS:
            out.append(f"--attention-backend {self.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        if self.cross_entropy_fusion_impl not in ("native", "te"):
            out.append(f"--cross-entropy-fusion-impl {self.cross_entropy_fusion_impl!r}: choose native or te")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                out.append("--recompute-granularity full needs --recompute-method uniform or block")
            elif not self.recompute_num_layers or self.recompute_num_layers < 1:
                out.append("--recompute-granularity full needs --recompute-num-layers >= 1")
        out += self.moe_problems()
        return out

    def moe_problems(self) -> list[str]:
        """The mixture-of-experts flags' own problems (their fit to the layout is ``validate``'s)."""
        if self.num_experts is None:
            return []
        out = []
        e, k = self.num_experts, self.moe_router_topk
        if e < 1:
            out.append(f"--num-experts must be >= 1, got {e}")
            return out
        if not 1 <= k <= e:
            out.append(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            out.append(f"--moe-router-score-function {self.moe_router_score_function!r}: choose softmax or sigmoid")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            out.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (aux-loss-free "
                       "balancing biases sigmoid scores)")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            out.append("--moe-router-pre-softmax applies to --moe-router-score-function softmax only")
        if self.moe_router_group_topk:
            g = self.moe_router_num_groups
            if not g:
                out.append("--moe-router-group-topk needs --moe-router-num-groups")
            elif e % g:
                out.append(f"--num-experts {e} is not divisible by --moe-router-num-groups {g}")
            elif self.moe_router_group_topk > g:
                out.append(f"--moe-router-group-topk {self.moe_router_group_topk} exceeds --moe-router-num-groups {g}")
            elif k % self.moe_router_group_topk:
                out.append(f"--moe-router-topk {k} is not divisible by --moe-router-group-topk "
                           f"{self.moe_router_group_topk}")
        types = self.moe_router_load_balancing_type
        types = [types] if isinstance(types, str) else list(types)
        coeffs = self.moe_aux_loss_coeff
        for t in types:
            if t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
                out.append(f"--moe-router-load-balancing-type {t!r}: choose aux_loss, seq_aux_loss, "
                           "global_aux_loss or none (Sinkhorn balancing is not available in this version)")
        if not isinstance(coeffs, (int, float)) and len(coeffs) != len(types):
            out.append(f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(types)} load-balancing types; "
                       "give one per type")
        cf = self.moe_expert_capacity_factor
        if cf is not None and not cf > 0:
            out.append(f"--moe-expert-capacity-factor must be > 0, got {cf} (omit the flag for no token dropping)")
        if self.moe_pad_expert_input_to_capacity and cf is None:
            out.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_token_drop_policy not in ("probs", "position"):
            out.append(f"--moe-token-drop-policy {self.moe_token_drop_policy!r}: choose probs or position")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            out.append(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: choose allgather or "
                       "alltoall (the flex/DeepEP dispatcher is not available in this version)")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            out.append(f"--moe-router-dtype {self.moe_router_dtype!r}: choose fp32 or fp64")
        if self.add_bias_linear:
            out.append("--num-experts: expert linear layers have no biases in this version; pass "
                       "--disable-bias-linear")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                out.append(f"--moe-layer-freq must be >= 1, got {freq}")
        elif len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
            out.append(f"--moe-layer-freq pattern must hold one 0 or 1 per layer ({self.num_layers}), got "
                       f"{len(freq)} values")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size < 1:
            out.append("--moe-shared-expert-intermediate-size must be >= 1")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            out.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
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


@dataclass
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
    # Megatron-LM compatibility flags (docs/flags.md)
    mmap_bin_files: bool = True  # --no-mmap-bin-files: read .bin files with file reads instead of a memmap
    tiktoken_pattern: str | None = None  # TikTokenizer's split pattern (v1 | v2; None: v2)

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
                                   vocab_extra_ids=self.vocab_extra_ids, tiktoken_pattern=self.tiktoken_pattern or "v2")
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
    no_verify_checkpoint: bool = False  # skip the CRC-32 check of the tensor data read on load
    ckpt_format: str = "torch_dist"
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"  # SIGTERM | SIGINT | SIGUSR1 | SIGUSR2
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    # (iteration directory, iteration) of the --load checkpoint, resolved once when --use-checkpoint-args read its
    # config (checkpoint.args.resolve_load); the loader loads that one. None: the loader resolves --load itself.
    load_resolved: tuple[str, int | None] | None = None


@dataclass
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
        t = self.train
        if t.global_batch_size is None and t.micro_batch_size is not None:
            t.global_batch_size = self.data_parallel_batch_size
        if t.train_iters is None and t.train_samples is not None and t.global_batch_size:
            if t.rampup_batch_size is not None and not rampup_problems(t.rampup_batch_size, t.global_batch_size, 1):
                t.train_iters = rampup_train_iters(t.train_samples, t.rampup_batch_size, t.global_batch_size)
            else:
                t.train_iters = t.train_samples // t.global_batch_size  # as Megatron-LM

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
