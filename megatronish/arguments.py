"""Command line with Megatron-LM's flag names, meanings and defaults, mapped to the dataclass configs.

``parse_args`` -> ``validate_args`` (every error at once, one line each, before any process group starts) ->
``configs_from_args`` (a :class:`megatronish.config.RunConfig`). Megatron flags whose feature is not available
yet are parsed with Megatron's names and defaults, and a non-default value is rejected by ``validate_args``
through the single table :data:`NOT_YET_SUPPORTED`; enabling a feature later means deleting its entry.

Differences from Megatron-LM are listed in ``docs/flags.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, TypeVar

from .config import (CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, RunConfig,
                     TrainingConfig)
from .parallel.dims import ConfigError, ParallelDims
from .parallel.pipeline.schedules import check_interleaving

__all__ = ["build_parser", "parse_args", "validate_args", "configs_from_args", "exit_on_config_error",
           "NOT_YET_SUPPORTED", "NotYet", "TOKENIZER_TYPES", "SUPPORTED_TOKENIZER_TYPES"]

T = TypeVar("T")

# Megatron-LM's --tokenizer-type choices, and the ones megatronish.data.tokenizers implements.
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")
SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                             "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")
_TOKENIZER_MODEL_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                          "Llama2Tokenizer", "TikTokenizer")


# ---------------------------------------------------------------------------------------------------------------
# The one table of Megatron flags we parse but whose feature is not available yet.
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NotYet:
    """``flag``'s values outside ``allowed`` name a feature that is not available yet; ``fix`` says what to do."""

    flag: str
    allowed: tuple
    feature: str
    fix: str

    def message(self, value) -> str:
        shown = self.flag if isinstance(value, bool) else f"{self.flag} {_show(value)}"
        return f"{shown}: {self.feature} is not available yet in this version; {self.fix}"


def _show(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


_DROP = "drop the flag"
NOT_YET_SUPPORTED: dict[str, NotYet] = {
    nt.flag.lstrip("-").replace("-", "_") if dest is None else dest: nt
    for dest, nt in [
        # parallelism
        (None, NotYet("--context-parallel-size", (1,), "context parallelism", "use 1")),
        (None, NotYet("--expert-model-parallel-size", (1,), "expert parallelism (mixture of experts)", "use 1")),
        (None, NotYet("--tp-comm-overlap", (False,), "tensor-parallel communication overlap", _DROP)),
        (None, NotYet("--use-torch-fsdp2", (False,), "FSDP2", _DROP)),
        (None, NotYet("--use-megatron-fsdp", (False,), "Megatron FSDP", _DROP)),
        # batch
        (None, NotYet("--rampup-batch-size", (None,), "batch-size ramp-up", "drop the flag (constant "
                      "--global-batch-size)")),
        # precision
        (None, NotYet("--fp8-recipe", ("delayed", "tensorwise"), "this FP8 recipe",
                      "use --fp8-recipe delayed or tensorwise")),
        (None, NotYet("--fp8-interval", (1,), "an FP8 amax update interval other than every step", _DROP)),
        (None, NotYet("--fp8-param-gather", (False,), "FP8 parameter all-gather", _DROP)),
        # checkpoints
        (None, NotYet("--ckpt-format", ("torch_dist",), "this checkpoint format",
                      "use --ckpt-format torch_dist (the default: torch.distributed.checkpoint, loads into any "
                      "parallel layout)")),
        # model features
        (None, NotYet("--position-embedding-type", ("learned_absolute", "rope", "none"),
                      "this position embedding type", "use learned_absolute, rope or none")),
        (None, NotYet("--qk-layernorm", (False,), "query/key layer norm", _DROP)),
        (None, NotYet("--squared-relu", (False,), "squared ReLU", _DROP)),
        (None, NotYet("--apply-layernorm-1p", (False,), "zero-centered (1p) layer norm", _DROP)),
        (None, NotYet("--use-flash-attn", (False,), "flash attention", _DROP)),
        (None, NotYet("--decoupled-lr", (None,), "a decoupled LR for the embedding and output layers", _DROP)),
        # data
        (None, NotYet("--reset-attention-mask", (False,), "document-masked attention",
                      "drop the flag (attention stays causal across documents)")),
        (None, NotYet("--tokenizer-type", (None,) + SUPPORTED_TOKENIZER_TYPES, "this tokenizer",
                      "choose one of " + ", ".join(SUPPORTED_TOKENIZER_TYPES))),
    ]
}


# ---------------------------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line plus a usage hint, exit status 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"error: {message}\n(run with --help for the list of flags)\n")


def build_parser(prog: str = "pretrain_gpt.py", description: str = "Pretrain a GPT model (Megatron-LM flags).",
                 ) -> argparse.ArgumentParser:
    """All flags, with Megatron-LM's names and defaults (differences in docs/flags.md). Other entry points
    (text generation) take the same model and checkpoint flags and add their own group."""
    p = _Parser(prog=prog, description=description, allow_abbrev=False)
    flag = lambda g, name, **kw: g.add_argument(name, **kw)  # noqa: E731
    on = dict(action="store_true")

    g = p.add_argument_group("model")
    flag(g, "--num-layers", type=int, default=None, help="number of transformer layers (required)")
    flag(g, "--hidden-size", type=int, default=None, help="transformer hidden size (required)")
    flag(g, "--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4h; SwiGLU int(8h/3/64)*64)")
    flag(g, "--num-attention-heads", type=int, default=None, help="attention heads (required)")
    flag(g, "--kv-channels", type=int, default=None, help="head dimension (default hidden/heads)")
    flag(g, "--group-query-attention", **on, help="use grouped-query attention (--num-query-groups)")
    flag(g, "--num-query-groups", type=int, default=1, help="query groups, used only with --group-query-attention")
    flag(g, "--seq-length", type=int, default=None, help="sequence length (required)")
    flag(g, "--max-position-embeddings", type=int, default=None,
         help="position embedding table size (default: --seq-length)")
    flag(g, "--position-embedding-type", default="learned_absolute",
         choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    flag(g, "--rotary-base", type=int, default=10000)
    flag(g, "--rotary-percent", type=float, default=1.0)
    flag(g, "--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    flag(g, "--norm-epsilon", type=float, default=1e-5)
    flag(g, "--swiglu", **on, help="gated SiLU MLP")
    flag(g, "--openai-gelu", **on, help="tanh-approximated GELU")
    flag(g, "--squared-relu", **on)
    flag(g, "--apply-layernorm-1p", **on)
    flag(g, "--qk-layernorm", **on)
    flag(g, "--untie-embeddings-and-output-weights", **on)
    flag(g, "--disable-bias-linear", action="store_false", dest="add_bias_linear", help="no biases in linears")
    flag(g, "--add-qkv-bias", **on, help="bias in the QKV projection even with --disable-bias-linear")
    flag(g, "--attention-dropout", type=float, default=0.1)
    flag(g, "--hidden-dropout", type=float, default=0.1)
    flag(g, "--init-method-std", type=float, default=0.02)
    flag(g, "--make-vocab-size-divisible-by", type=int, default=128,
         help="pad the vocabulary to a multiple of this x TP")
    flag(g, "--transformer-impl", default=None, choices=["local", "transformer_engine"],
         help="layer implementation (ours: local; Megatron's default is transformer_engine)")
    flag(g, "--use-flash-attn", **on)
    flag(g, "--use-triton-kernels", **on,
         help="fused Triton RMSNorm/LayerNorm, RoPE and SwiGLU (CUDA, or TRITON_INTERPRET=1 on CPU)")
    flag(g, "--cross-entropy-loss-fusion", **on,
         help="fused vocab-parallel cross entropy (a Triton kernel: CUDA, or TRITON_INTERPRET=1 on CPU)")
    flag(g, "--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
         help="native: this package's Triton kernel")
    flag(g, "--recompute-granularity", default=None, choices=["full", "selective"])
    flag(g, "--recompute-method", default=None, choices=["uniform", "block"])
    flag(g, "--recompute-num-layers", type=int, default=None)
    flag(g, "--recompute-activations", **on, help="selective recompute (Megatron's shorthand)")

    g = p.add_argument_group("parallelism")
    flag(g, "--tensor-model-parallel-size", type=int, default=1)
    flag(g, "--pipeline-model-parallel-size", type=int, default=1)
    flag(g, "--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    flag(g, "--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    flag(g, "--sequence-parallel", **on, help="sequence parallelism in TP regions (no-op at TP 1)")
    flag(g, "--context-parallel-size", type=int, default=1)
    flag(g, "--expert-model-parallel-size", type=int, default=1)
    flag(g, "--distributed-backend", default=None, choices=["nccl", "gloo"],
         help="default: nccl on CUDA, gloo on CPU (Megatron's default is nccl)")
    flag(g, "--distributed-timeout-minutes", type=int, default=10)
    flag(g, "--use-distributed-optimizer", **on)
    flag(g, "--overlap-grad-reduce", **on, help="overlap the DP gradient reduce with backward, per bucket")
    flag(g, "--overlap-param-gather", **on)
    flag(g, "--ddp-bucket-size", type=int, default=None, help="elements per gradient bucket")
    flag(g, "--use-cpu-initialization", **on, help="accepted; initialization is layout-invariant either way")
    flag(g, "--tp-comm-overlap", **on)
    flag(g, "--use-torch-fsdp2", **on)
    flag(g, "--use-megatron-fsdp", **on)

    g = p.add_argument_group("batch and iterations")
    flag(g, "--micro-batch-size", type=int, default=None, help="samples per microbatch per rank (required)")
    flag(g, "--global-batch-size", type=int, default=None, help="samples per iteration (default micro x DP)")
    flag(g, "--rampup-batch-size", nargs="*", default=None)
    flag(g, "--train-iters", type=int, default=None)
    flag(g, "--train-samples", type=int, default=None)
    flag(g, "--eval-iters", type=int, default=100)
    flag(g, "--eval-interval", type=int, default=1000)
    flag(g, "--skip-train", **on)
    flag(g, "--seed", type=int, default=1234)

    g = p.add_argument_group("optimizer and schedule")
    flag(g, "--optimizer", default="adam", choices=["adam", "sgd"])
    flag(g, "--lr", type=float, default=None, help="peak learning rate (required)")
    flag(g, "--min-lr", type=float, default=0.0)
    flag(g, "--decoupled-lr", type=float, default=None)
    flag(g, "--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root",
                                                             "WSD"])
    flag(g, "--lr-decay-iters", type=int, default=None)
    flag(g, "--lr-decay-samples", type=int, default=None)
    flag(g, "--lr-warmup-fraction", type=float, default=None)
    flag(g, "--lr-warmup-iters", type=int, default=0)
    flag(g, "--lr-warmup-samples", type=int, default=0)
    flag(g, "--lr-warmup-init", type=float, default=0.0)
    flag(g, "--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    flag(g, "--lr-wsd-decay-iters", type=int, default=None)
    flag(g, "--lr-wsd-decay-samples", type=int, default=None)
    flag(g, "--weight-decay", type=float, default=0.01)
    flag(g, "--start-weight-decay", type=float, default=None)
    flag(g, "--end-weight-decay", type=float, default=None)
    flag(g, "--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    flag(g, "--clip-grad", type=float, default=1.0)
    flag(g, "--adam-beta1", type=float, default=0.9)
    flag(g, "--adam-beta2", type=float, default=0.999)
    flag(g, "--adam-eps", type=float, default=1e-8)
    flag(g, "--sgd-momentum", type=float, default=0.9)
    flag(g, "--override-opt_param-scheduler", **on)
    flag(g, "--use-checkpoint-opt_param-scheduler", **on)

    g = p.add_argument_group("mixed precision")
    flag(g, "--fp16", **on, help="fp16 parameters with fp32 master weights and a loss scaler")
    flag(g, "--bf16", **on, help="bf16 parameters with fp32 master weights and fp32 gradient accumulation")
    flag(g, "--loss-scale", type=float, default=None, help="constant fp16 loss scale (default: dynamic)")
    flag(g, "--initial-loss-scale", type=float, default=2 ** 32, help="dynamic loss scale's start value")
    flag(g, "--min-loss-scale", type=float, default=1.0, help="dynamic loss scale's floor")
    flag(g, "--loss-scale-window", type=float, default=1000,
         help="clean steps before the dynamic loss scale doubles")
    flag(g, "--hysteresis", type=int, default=2, help="overflows tolerated before the loss scale halves")
    flag(g, "--accumulate-allreduce-grads-in-fp32", **on,
         help="fp32 gradient buffers (accumulation and reduction); implied by --bf16")
    flag(g, "--grad-reduce-in-bf16", **on, help="with --bf16: accumulate and reduce gradients in bf16")
    flag(g, "--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
    flag(g, "--fp8-recipe", default="delayed", choices=["tensorwise", "delayed", "mxfp8", "blockwise"])
    flag(g, "--fp8-margin", type=int, default=0)
    flag(g, "--fp8-interval", type=int, default=1)
    flag(g, "--fp8-amax-history-len", type=int, default=1)
    flag(g, "--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])
    flag(g, "--fp8-param-gather", **on)

    g = p.add_argument_group("checkpointing and exit")
    flag(g, "--save", default=None, help="directory to save checkpoints to")
    flag(g, "--load", default=None, help="directory to resume from (its latest complete checkpoint)")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="save every N iterations")
    flag(g, "--async-save", **on, help="write checkpoints in the background while training continues")
    flag(g, "--no-save-optim", **on, help="leave the optimizer state out of saved checkpoints")
    flag(g, "--no-save-rng", **on, help="leave the RNG states out of saved checkpoints")
    flag(g, "--no-load-optim", **on, help="do not load the optimizer state (nor the LR/WD schedule position)")
    flag(g, "--no-load-rng", **on, help="do not load the RNG states")
    flag(g, "--finetune", **on, help="load the model only: iteration 0, fresh optimizer, schedule and RNG")
    flag(g, "--exit-on-missing-checkpoint", **on, help="with --load: a missing checkpoint is an error")
    flag(g, "--use-checkpoint-args", **on, help="take the model-shape flags from the --load checkpoint")
    flag(g, "--ckpt-format", default="torch_dist",
         choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
         help="checkpoint format (only torch_dist is available)")
    flag(g, "--exit-signal-handler", **on, help="on --exit-signal: finish the iteration, save, exit 0")
    flag(g, "--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    flag(g, "--exit-duration-in-mins", type=int, default=None, help="save and exit after this many minutes")
    flag(g, "--exit-interval", type=int, default=None, help="save and exit after an iteration divisible by this")

    g = p.add_argument_group("data and tokenizer")
    flag(g, "--mock-data", **on, help="synthetic, learnable data (no files)")
    flag(g, "--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    flag(g, "--split", default=None, help="train, valid, test weights (default '969, 30, 1')")
    flag(g, "--train-data-path", nargs="*", default=None, help="training prefixes (instead of --data-path/--split)")
    flag(g, "--valid-data-path", nargs="*", default=None)
    flag(g, "--test-data-path", nargs="*", default=None)
    flag(g, "--data-cache-path", default=None)
    flag(g, "--num-workers", type=int, default=2)
    flag(g, "--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES))
    flag(g, "--vocab-file", default=None)
    flag(g, "--merge-file", default=None)
    flag(g, "--tokenizer-model", default=None)
    flag(g, "--vocab-size", type=int, default=None, help="NullTokenizer: token ids 0..N-1, eod N")
    flag(g, "--vocab-extra-ids", type=int, default=0)
    flag(g, "--eod-mask-loss", **on)
    flag(g, "--reset-position-ids", **on)
    flag(g, "--reset-attention-mask", **on)

    g = p.add_argument_group("logging")
    flag(g, "--log-interval", type=int, default=100)
    flag(g, "--log-throughput", **on)
    flag(g, "--log-params-norm", **on)
    flag(g, "--tensorboard-dir", default=None)
    flag(g, "--wandb-project", default="")
    flag(g, "--wandb-entity", default="")
    flag(g, "--wandb-exp-name", default="")
    flag(g, "--wandb-save-dir", default="")
    flag(g, "--timing-log-level", type=int, default=0, choices=[0, 1, 2])
    flag(g, "--metrics-file", default=None, help="JSON lines: one object per logged iteration and per evaluation")
    flag(g, "--pipeline-timeline", default=None,
         help="write a Chrome trace (Perfetto) of the last training iteration's pipeline events to this path")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); unknown flags exit 2 with one line."""
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------
def _virtual_stages(args, errors: list[str]) -> int:
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and per_rank is not None:
        errors.append("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
                      "mutually exclusive; pass one")
        return 1
    if per_rank is not None:
        return per_rank
    if per_stage is not None:
        pp, layers = args.pipeline_model_parallel_size, args.num_layers
        if per_stage < 1 or layers is None or pp < 1 or layers % pp or (layers // pp) % per_stage:
            errors.append(f"--num-layers {layers} / --pipeline-model-parallel-size {pp} is not a multiple of "
                          f"--num-layers-per-virtual-pipeline-stage {per_stage}")
            return 1
        return (layers // pp) // per_stage
    return 1


def _ffn_hidden_size(args) -> int:
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    h = args.hidden_size
    return int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h


def _query_groups(args) -> int:
    """Megatron uses --num-query-groups only under --group-query-attention; otherwise one group per head."""
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _model_kwargs(args, vocab_size: int) -> dict:
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, num_query_groups=_query_groups(args),
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, openai_gelu=args.openai_gelu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        transformer_impl=args.transformer_impl or "local",
        use_triton_kernels=args.use_triton_kernels, cross_entropy_loss_fusion=args.cross_entropy_loss_fusion)


def _check_required(args, errors: list[str], for_training: bool = True) -> bool:
    ok = True
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") + \
            (("micro_batch_size",) if for_training else ()):
        if getattr(args, dest) is None:
            errors.append(f"--{dest.replace('_', '-')} is required")
            ok = False
    return ok


def _check_parallel(args, world_size: int, errors: list[str], shapes_ok: bool) -> ParallelDims | None:
    vp = _virtual_stages(args, errors)
    try:
        dims = ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, vp=vp, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size,
                            tie_embeddings=not args.untie_embeddings_and_output_weights)
    except ConfigError as e:
        errors.append(str(e))
        return None
    if shapes_ok:
        try:
            dims.validate_model(num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                                num_query_groups=_query_groups(args), seq_length=args.seq_length,
                                sequence_parallel=args.sequence_parallel,
                                hidden_size=args.hidden_size if args.kv_channels is None else None,
                                ffn_hidden_size=_ffn_hidden_size(args))
        except ConfigError as e:
            errors.append(str(e))
            return None
    return dims


def _check_batch(args, dims: ParallelDims | None, errors: list[str]) -> None:
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if mbs is not None and mbs < 1:
        errors.append(f"--micro-batch-size must be >= 1, got {mbs}")
        return
    if gbs is not None and gbs < 1:
        errors.append(f"--global-batch-size must be >= 1, got {gbs}")
        return
    if mbs is not None and gbs is not None and dims is not None and gbs % (mbs * dims.dp):
        errors.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel "
                      f"size {dims.dp} = {mbs * dims.dp}")
    elif mbs is not None and gbs is not None and dims is not None and dims.vp > 1:
        try:
            check_interleaving(dims.pp, dims.vp, gbs // (mbs * dims.dp), micro_batch_size=mbs,
                               global_batch_size=gbs, data_parallel_size=dims.dp)
        except ConfigError as e:
            errors.append(str(e))


def _check_schedule(args, errors: list[str]) -> None:
    iters, samples = args.train_iters, args.train_samples
    if iters is None and samples is None:
        errors.append("pass --train-iters or --train-samples (the training length)")
    elif iters is not None and samples is not None:
        errors.append(f"--train-iters {iters} and --train-samples {samples} are mutually exclusive; pass one")
    if args.lr is None:
        errors.append("--lr is required (the peak learning rate)")
    elif args.min_lr > args.lr:
        errors.append(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    elif args.lr_warmup_init > args.lr:
        errors.append(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")
    if args.min_lr < 0:
        errors.append(f"--min-lr {args.min_lr} must be >= 0")

    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        errors.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
                      f"{args.lr_warmup_iters} are mutually exclusive; pass one")
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        errors.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-samples "
                      f"{args.lr_warmup_samples} are mutually exclusive; pass one")
    if args.lr_decay_iters is not None and args.lr_decay_samples is not None:
        errors.append(f"--lr-decay-iters {args.lr_decay_iters} and --lr-decay-samples {args.lr_decay_samples} are "
                      "mutually exclusive; pass one")
    if args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_samples is not None:
        errors.append("--lr-wsd-decay-iters and --lr-wsd-decay-samples are mutually exclusive; pass one")

    # Iteration-based flags go with --train-iters, sample-based ones with --train-samples (Megatron's rule).
    iter_flags = [f"--{n.replace('_', '-')}" for n in ("lr_decay_iters", "lr_wsd_decay_iters")
                  if getattr(args, n) is not None] + (["--lr-warmup-iters"] if args.lr_warmup_iters else [])
    sample_flags = [f"--{n.replace('_', '-')}" for n in ("lr_decay_samples", "lr_wsd_decay_samples")
                    if getattr(args, n) is not None] + (["--lr-warmup-samples"] if args.lr_warmup_samples else [])
    if samples is not None and iter_flags:
        errors.append(f"{', '.join(iter_flags)} count iterations but --train-samples counts samples; use the "
                      "*-samples flags with --train-samples")
    if iters is not None and sample_flags:
        errors.append(f"{', '.join(sample_flags)} count samples but --train-iters counts iterations; use the "
                      "*-iters flags with --train-iters")

    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with "
                      "--train-samples)")

    if args.weight_decay_incr_style == "constant":
        given = [f for f, v in (("--start-weight-decay", args.start_weight_decay),
                                ("--end-weight-decay", args.end_weight_decay)) if v is not None]
        if given:
            errors.append(f"{' and '.join(given)} need --weight-decay-incr-style linear or cosine (with the "
                          "constant style use --weight-decay)")
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            errors.append(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                          "--start-weight-decay and --end-weight-decay")
        elif not 0 <= args.start_weight_decay <= args.end_weight_decay:
            errors.append(f"--start-weight-decay {args.start_weight_decay} must be >= 0 and <= "
                          f"--end-weight-decay {args.end_weight_decay}")


def _check_warmup_vs_decay(args, errors: list[str], gbs: int | None) -> None:
    """Megatron asserts warm-up < decay (in samples); checked once the lengths are known."""
    if gbs is None or (args.train_iters is None) == (args.train_samples is None):
        return
    from .optim.lr_schedule import scheduler_steps_from_args

    probe = argparse.Namespace(**{**vars(args), "global_batch_size": gbs})
    warmup, decay, wsd, _ = scheduler_steps_from_args(probe)
    if decay <= 0:
        errors.append(f"the LR decay length must be > 0 (got {decay} samples); check --lr-decay-iters/"
                      "--lr-decay-samples/--train-iters/--train-samples")
    elif warmup >= decay:
        errors.append(f"the LR warm-up ({warmup:g} samples) must be shorter than the LR decay ({decay} samples); "
                      "lower --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction or raise "
                      "--lr-decay-iters/--lr-decay-samples")
    if args.lr_decay_style == "WSD" and wsd is not None and not 0 < wsd <= decay:
        errors.append(f"--lr-wsd-decay-iters/--lr-wsd-decay-samples gives {wsd} samples; it must be > 0 and at "
                      f"most the LR decay length ({decay} samples)")


def _check_data(args, errors: list[str], for_training: bool = True) -> None:
    per_split = args.train_data_path or args.valid_data_path or args.test_data_path
    if args.mock_data and (args.data_path or per_split):
        errors.append("--mock-data and --data-path (or --train/valid/test-data-path) are mutually exclusive; pass one")
    elif args.data_path and per_split:
        errors.append("--data-path with --split and --train/valid/test-data-path are mutually exclusive; pass one")
    elif for_training and not args.mock_data and not args.data_path and not args.train_data_path:
        errors.append("no training data: pass --data-path PREFIX (or weighted prefixes), --train-data-path, "
                      "or --mock-data")
    t = args.tokenizer_type
    if t is None:
        if args.vocab_size is None and not (args.vocab_file and args.merge_file):
            errors.append("no tokenizer: pass --tokenizer-type NullTokenizer --vocab-size N (mock data), or "
                          "--tokenizer-type with its files (--vocab-file/--merge-file or --tokenizer-model)")
    elif t == "NullTokenizer":
        if args.vocab_size is None:
            errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    elif t == "GPT2BPETokenizer":
        if not (args.vocab_file and args.merge_file):
            errors.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    elif t in _TOKENIZER_MODEL_TYPES and not args.tokenizer_model:
        errors.append(f"--tokenizer-type {t} needs --tokenizer-model")
    if args.vocab_size is not None and args.vocab_size < 1:
        errors.append(f"--vocab-size must be >= 1, got {args.vocab_size}")


def _check_precision(args, errors: list[str]) -> None:
    if args.fp16 and args.bf16:
        errors.append("--fp16 and --bf16 are mutually exclusive; pass at most one")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps that optimizer's "
                      "parameter all-gather)")
    elif args.overlap_param_gather and not args.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    if args.loss_scale is not None and args.loss_scale <= 0:
        errors.append(f"--loss-scale must be > 0, got {args.loss_scale}")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        errors.append(f"--min-loss-scale {args.min_loss_scale} must be > 0 and <= --initial-loss-scale "
                      f"{args.initial_loss_scale}")
    if args.loss_scale_window < 1 or args.loss_scale_window != int(args.loss_scale_window):
        errors.append(f"--loss-scale-window must be a whole number >= 1, got {args.loss_scale_window}")
    if args.hysteresis < 1:
        errors.append(f"--hysteresis must be >= 1, got {args.hysteresis}")
    if args.fp8 is not None:
        from .precision.fp8 import Fp8Recipe  # noqa: PLC0415 - only with --fp8-format

        try:
            Fp8Recipe(fp8_format=args.fp8, fp8_recipe=args.fp8_recipe if args.fp8_recipe in ("delayed", "tensorwise")
                      else "delayed", fp8_margin=args.fp8_margin, fp8_amax_history_len=args.fp8_amax_history_len,
                      fp8_amax_compute_algo=args.fp8_amax_compute_algo)
        except ConfigError as e:
            errors.append(str(e))
    if (args.transformer_impl or "local") != "local":
        from .precision.fp8 import check_transformer_impl  # noqa: PLC0415 - imports TE lazily

        try:
            check_transformer_impl(args.transformer_impl)
        except ConfigError as e:
            errors.append(str(e))


def _check_model(args, errors: list[str]) -> None:
    _check_precision(args, errors)
    mpe, s = args.max_position_embeddings, args.seq_length
    if mpe is not None and s is not None and args.position_embedding_type == "learned_absolute" and mpe < s:
        errors.append(f"--max-position-embeddings {mpe} is smaller than --seq-length {s} with learned absolute "
                      "positions; raise --max-position-embeddings")
    if args.swiglu and args.openai_gelu:
        errors.append("--swiglu and --openai-gelu are mutually exclusive; pass one")
    _check_kernels(args, errors)


def _check_kernels(args, errors: list[str]) -> None:
    """The fused Triton kernels need triton and CUDA, or TRITON_INTERPRET=1 (kernels on CPU)."""
    asked = [f for f, on in (("--use-triton-kernels", args.use_triton_kernels),
                             ("--cross-entropy-loss-fusion", args.cross_entropy_loss_fusion)) if on]
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl != "native":
        errors.append(f"--cross-entropy-fusion-impl {args.cross_entropy_fusion_impl}: Transformer Engine's fused "
                      "cross entropy is not available in this version; use --cross-entropy-fusion-impl native "
                      "(the Triton kernel)")
    if asked:
        from .kernels import check_kernels_available  # noqa: PLC0415 - only when asked for

        try:
            check_kernels_available(asked)
        except ConfigError as e:
            errors.append(str(e))


def _check_checkpoint(args, errors: list[str]) -> None:
    for name in ("save_interval", "exit_interval", "exit_duration_in_mins"):
        value = getattr(args, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.use_checkpoint_args and not args.load:
        errors.append("--use-checkpoint-args needs --load (the checkpoint to take the model flags from)")


def validate_args(args: argparse.Namespace, world_size: int, *, for_training: bool = True) -> None:
    """Check every flag against the others and the world size; raise one :class:`ConfigError` listing every
    problem, one line each, naming the flags. Does not modify ``args``. ``for_training=False`` (text
    generation from a checkpoint): the batch, schedule and training-data flags are not needed."""
    errors: list[str] = []
    for dest, rule in NOT_YET_SUPPORTED.items():
        value = getattr(args, dest)
        if value not in rule.allowed:
            errors.append(rule.message(value))
    shapes_ok = _check_required(args, errors, for_training)
    dims = _check_parallel(args, world_size, errors, shapes_ok)
    if for_training:
        _check_batch(args, dims, errors)
        _check_schedule(args, errors)
        gbs = args.global_batch_size
        if gbs is None and dims is not None and args.micro_batch_size:
            gbs = args.micro_batch_size * dims.dp
        if not errors:
            _check_warmup_vs_decay(args, errors, gbs)
    _check_data(args, errors, for_training)
    _check_model(args, errors)
    _check_checkpoint(args, errors)
    if shapes_ok and dims is not None and not errors:
        try:  # the model's own checks (recompute flags, names), with a placeholder vocabulary
            ModelConfig(**_model_kwargs(args, vocab_size=1))
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        seen: dict[str, None] = dict.fromkeys(errors)
        raise ConfigError("\n".join(seen))


# ---------------------------------------------------------------------------------------------------------------
# Namespace -> RunConfig
# ---------------------------------------------------------------------------------------------------------------
def _tokenizer_vocab_size(args) -> int:
    """The tokenizer's true vocabulary size. NullTokenizer (also implied by --vocab-size without
    --tokenizer-type): ids 0..N-1 plus eod = N, so N + 1 (as Megatron-LM's NullTokenizer)."""
    t = args.tokenizer_type
    if t == "NullTokenizer" or (t is None and args.vocab_size is not None):
        return args.vocab_size + 1
    from .data.tokenizers import build_tokenizer  # reads the tokenizer files; only for file tokenizers

    try:
        tok = build_tokenizer(t or "GPT2BPETokenizer", vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                              vocab_extra_ids=args.vocab_extra_ids)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e).splitlines()[0] if str(e) else f"--tokenizer-type {t}: {e!r}") from e
    return int(tok.vocab_size)


def configs_from_args(args: argparse.Namespace, world_size: int, *, for_training: bool = True) -> RunConfig:
    """Validate ``args`` and build the :class:`RunConfig` (derived values filled as Megatron-LM does).
    ``for_training=False``: see :func:`validate_args` (the micro-batch size defaults to 1)."""
    if getattr(args, "use_checkpoint_args", False):
        from .checkpoint.args import apply_checkpoint_args  # reads the --load checkpoint's config

        apply_checkpoint_args(args)
    validate_args(args, world_size, for_training=for_training)
    if not for_training and args.micro_batch_size is None:
        args.micro_batch_size = 1
    vp = _virtual_stages(args, [])
    parallel = ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, vp=vp, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size,
                            tie_embeddings=not args.untie_embeddings_and_output_weights)
    vocab_size = _tokenizer_vocab_size(args)
    model = ModelConfig(**_model_kwargs(args, vocab_size))

    gbs = args.global_batch_size or args.micro_batch_size * parallel.dp
    train_iters = args.train_iters
    if args.train_samples is not None:  # Megatron: train_iters = train_samples // global_batch_size
        train_iters = args.train_samples // gbs
    train = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=gbs, train_iters=train_iters,
        train_samples=args.train_samples, eval_iters=args.eval_iters, eval_interval=args.eval_interval,
        skip_train=args.skip_train, seed=args.seed, log_interval=args.log_interval,
        distributed_backend=args.distributed_backend, distributed_timeout_minutes=args.distributed_timeout_minutes,
        use_cpu_initialization=args.use_cpu_initialization)

    constant_wd = args.weight_decay_incr_style == "constant"
    optim = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters, lr_decay_samples=args.lr_decay_samples,
        lr_warmup_fraction=args.lr_warmup_fraction, lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_samples=args.lr_warmup_samples, lr_warmup_init=args.lr_warmup_init,
        lr_wsd_decay_style=args.lr_wsd_decay_style, lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        lr_wsd_decay_samples=args.lr_wsd_decay_samples, weight_decay=args.weight_decay,
        start_weight_decay=args.weight_decay if constant_wd else args.start_weight_decay,
        end_weight_decay=args.weight_decay if constant_wd else args.end_weight_decay,
        weight_decay_incr_style=args.weight_decay_incr_style, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
        fp16=args.fp16, bf16=args.bf16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=int(args.loss_scale_window),
        hysteresis=args.hysteresis, grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        # Megatron: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
        accumulate_allreduce_grads_in_fp32=(not args.grad_reduce_in_bf16) if args.bf16
        else args.accumulate_allreduce_grads_in_fp32,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_param_gather=args.overlap_param_gather)

    logging = LoggingConfig(
        log_interval=args.log_interval, log_throughput=args.log_throughput, log_params_norm=args.log_params_norm,
        tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project, wandb_entity=args.wandb_entity,
        wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        timing_log_level=args.timing_log_level, metrics_file=args.metrics_file,
        pipeline_timeline=args.pipeline_timeline)

    data = DataConfig(
        seq_length=args.seq_length, vocab_size=vocab_size, mock_data=args.mock_data,
        data_path=list(args.data_path or []), split=args.split if args.split is not None else "969, 30, 1",
        train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path,
        data_cache_path=args.data_cache_path, num_workers=args.num_workers,
        tokenizer_type=args.tokenizer_type or ("NullTokenizer" if args.vocab_size is not None
                                               else "GPT2BPETokenizer"),
        vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
        vocab_size_flag=args.vocab_size, vocab_extra_ids=args.vocab_extra_ids, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask)

    checkpoint = CheckpointConfig(
        save=args.save, load=args.load, save_interval=args.save_interval, async_save=args.async_save,
        no_save_optim=args.no_save_optim, no_save_rng=args.no_save_rng, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, finetune=args.finetune,
        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        use_checkpoint_args=args.use_checkpoint_args, ckpt_format=args.ckpt_format,
        exit_signal_handler=args.exit_signal_handler, exit_signal=args.exit_signal,
        exit_duration_in_mins=args.exit_duration_in_mins, exit_interval=args.exit_interval)

    return RunConfig(model=model, parallel=parallel,
                     sequence_parallel=args.sequence_parallel and parallel.tp > 1,
                     train=train, optim=optim, logging=logging, data=data,
                     num_microbatches=gbs // (args.micro_batch_size * parallel.dp), checkpoint=checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# Entry-point helper
# ---------------------------------------------------------------------------------------------------------------
def exit_on_config_error(fn: Callable[[], T], *, once_per_node: bool = False) -> T:
    """Run ``fn()``; on :class:`ConfigError` print ``error: <line>`` per problem to stderr (no traceback) and exit 2.

    ``once_per_node``: for checks every process makes identically (flag validation under a launcher), only local
    rank 0 prints, so the message appears once per node instead of once per process."""
    try:
        return fn()
    except ConfigError as e:
        if not once_per_node or os.environ.get("LOCAL_RANK", "0") == "0":
            lines = str(e).splitlines() or [repr(e)]
            sys.stderr.write("".join(f"error: {line}\n" for line in lines))
            sys.stderr.flush()
        raise SystemExit(2) from None
