"""Command line with Megatron-LM's flag names, meanings and defaults, mapped to the dataclass configs.

``parse_args`` -> ``configs_from_args``: each config field takes the flag of its own name (``_rules`` lists the
few that do not), then :func:`validate` checks the configs and raises every problem at once, one line each, before
any process group starts (``validate_args`` runs the same checks without returning the configs). Megatron flags
whose feature is not available
yet are parsed with Megatron's names and defaults, and a non-default value is rejected by ``validate_args``
through the single table :data:`NOT_YET_SUPPORTED`; enabling a feature later means deleting its entry.

Differences from Megatron-LM are listed in ``docs/flags.md``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Callable, TypeVar

from .config import (
    ATTENTION_BACKENDS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    TrainingConfig,
    rampup_problems,
    rampup_steps,
)
from .errors import CommandLineParser, ConfigError, UserError
from .parallel.dims import ParallelDims
from .parallel.pipeline.schedules import check_interleaving
from .parallel_config import parallel_dims, validate_model, virtual_stages_from_layers

__all__ = ["build_parser", "parse_args", "validate", "validate_args", "configs_from_args", "exit_on_config_error",
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
        (None, NotYet("--tp-comm-overlap", (False,), "tensor-parallel communication overlap", _DROP)),
        (None, NotYet("--use-megatron-fsdp", (False,), "Megatron FSDP", _DROP)),
        # mixture of experts (the features of docs/moe.md are built; these are not)
        (None, NotYet("--moe-token-dispatcher-type", ("allgather", "alltoall"), "the flex (DeepEP/HybridEP) "
                      "token dispatcher", "use --moe-token-dispatcher-type alltoall or allgather")),
        (None, NotYet("--moe-enable-deepep", (False,), "the DeepEP dispatcher", _DROP)),
        (None, NotYet("--moe-flex-dispatcher-backend", (None,), "the flex dispatcher", _DROP)),
        (None, NotYet("--moe-permute-fusion", (False,), "Transformer Engine's fused token permutation", _DROP)),
        (None, NotYet("--moe-router-fusion", (False,), "Transformer Engine's fused router", _DROP)),
        (None, NotYet("--moe-shared-expert-overlap", (False,), "overlapping shared experts with dispatch", _DROP)),
        (None, NotYet("--moe-use-upcycling", (False,), "dense-to-MoE upcycling", _DROP)),
        (None, NotYet("--moe-input-jitter-eps", (None,), "router input jitter", _DROP)),
        (None, NotYet("--moe-layer-recompute", (False,), "MoE-layer recompute", "drop the flag (use "
                      "--recompute-granularity full)")),
        (None, NotYet("--moe-use-legacy-grouped-gemm", (False,), "the legacy grouped GEMM",
                      "drop the flag (--moe-grouped-gemm uses torch's grouped GEMM)")),
        (None, NotYet("--moe-router-force-load-balancing", (False,), "forced (random) routing", _DROP)),
        (None, NotYet("--moe-apply-probs-on-input", (False,), "applying router probs to the expert input", _DROP)),
        (None, NotYet("--moe-router-padding-for-fp8", (False,), "router padding for FP8", _DROP)),
        (None, NotYet("--moe-router-padding-for-quantization", (False,), "router padding for quantization",
                      _DROP)),
        (None, NotYet("--moe-latent-size", (None,), "MoE latent projections", _DROP)),
        (None, NotYet("--moe-extended-tp", (False,), "extended expert tensor parallelism",
                      "use --expert-tensor-parallel-size")),
        (None, NotYet("--multi-latent-attention", (False,), "multi-latent attention (MLA)", _DROP)),
        # batch
        (None, NotYet("--step-batch-size-schedule", (None,), "the step batch-size schedule (Megatron-LM after "
                      "core 0.17)", "use --rampup-batch-size START INCREMENT SAMPLES")),
        # precision
        (None, NotYet("--fp8-recipe", ("delayed", "tensorwise"), "this FP8 recipe",
                      "use --fp8-recipe delayed or tensorwise")),
        (None, NotYet("--fp8-interval", (1,), "an FP8 amax update interval other than every step", _DROP)),
        # checkpoints
        (None, NotYet("--ckpt-format", ("torch_dist",), "this checkpoint format",
                      "use --ckpt-format torch_dist (the default: torch.distributed.checkpoint, loads into any "
                      "parallel layout)")),
        # model features
        (None, NotYet("--position-embedding-type", ("learned_absolute", "rope", "none"),
                      "this position embedding type", "use learned_absolute, rope or none")),
        (None, NotYet("--squared-relu", (False,), "squared ReLU", _DROP)),
        (None, NotYet("--use-flash-attn", (False,), "flash attention", _DROP)),
        # data
        (None, NotYet("--tokenizer-type", (None,) + SUPPORTED_TOKENIZER_TYPES, "this tokenizer",
                      "choose one of " + ", ".join(SUPPORTED_TOKENIZER_TYPES))),
    ]
}


# ---------------------------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------------------------
def build_parser(prog: str = "pretrain_gpt.py", description: str = "Pretrain a GPT model (Megatron-LM flags).",
                 ) -> argparse.ArgumentParser:
    """All flags, with Megatron-LM's names and defaults (differences in docs/flags.md). Other entry points
    (text generation) take the same model and checkpoint flags and add their own group."""
    p = CommandLineParser(prog=prog, description=description, allow_abbrev=False)
    def flag(g, name, **kw):
        return g.add_argument(name, **kw)
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
    flag(g, "--qk-layernorm", **on, help="norm (--normalization) of each query and key head before RoPE")
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
         help="fused vocab-parallel cross entropy (--cross-entropy-fusion-impl picks which)")
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
    flag(g, "--context-parallel-size", type=int, default=1,
         help="split every sequence over this many ranks (docs/context_parallel.md)")
    flag(g, "--cp-comm-type", nargs="+", default=["p2p"], choices=["p2p", "a2a", "allgather", "a2a+p2p"],
         help="context-parallel attention communication: one type, or one per layer")
    flag(g, "--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
         help="a2a+p2p: the all-to-all size (adjacent ranks) and the ring size; their product is the CP size")
    flag(g, "--expert-model-parallel-size", type=int, default=1,
         help="experts of every MoE layer spread over this many ranks (docs/moe.md)")
    flag(g, "--expert-tensor-parallel-size", type=int, default=None,
         help="tensor parallelism inside each expert (default --tensor-model-parallel-size)")
    flag(g, "--distributed-backend", default=None, choices=["nccl", "gloo"],
         help="default: nccl on CUDA, gloo on CPU (Megatron's default is nccl)")
    flag(g, "--distributed-timeout-minutes", type=int, default=10)
    flag(g, "--use-distributed-optimizer", **on)
    flag(g, "--overlap-grad-reduce", **on, help="overlap the DP gradient reduce with backward, per bucket")
    flag(g, "--overlap-param-gather", **on)
    flag(g, "--ddp-bucket-size", type=int, default=None, help="elements per gradient bucket")
    flag(g, "--use-cpu-initialization", **on, help="accepted; initialization is layout-invariant either way")
    flag(g, "--tp-comm-overlap", **on)
    flag(g, "--use-torch-fsdp2", **on, help="shard parameters, gradients and optimizer state over DP with "
         "PyTorch FSDP2 (docs/fsdp.md)")
    flag(g, "--fsdp-reshard-after-forward", default="default", choices=["default", "always", "never"],
         help="FSDP2: free gathered parameters after each layer's forward (default: never under pipeline "
         "parallelism, else always; torchtitan's rule)")
    flag(g, "--fsdp-prefetch-layers", type=int, default=1,
         help="FSDP2: all-gather the next N layers' parameters ahead (0: FSDP2's implicit prefetch)")
    flag(g, "--torch-compile", **on, help="torch.compile each transformer layer and the loss (torchtitan's "
         "compile; docs/fsdp.md)")
    flag(g, "--use-megatron-fsdp", **on)

    g = p.add_argument_group("mixture of experts (docs/moe.md)")
    flag(g, "--num-experts", type=int, default=None, help="experts per MoE layer (default: dense model)")
    flag(g, "--moe-layer-freq", type=moe_layer_freq, default=1,
         help="every N-th layer is MoE, or a pattern like \"([1]*3+[0]*1)*2\" (1: MoE, 0: dense)")
    flag(g, "--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default --ffn-hidden-size)")
    flag(g, "--moe-router-topk", type=int, default=2, help="experts per token")
    flag(g, "--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    flag(g, "--moe-router-pre-softmax", **on, help="softmax over all experts before the top-k")
    flag(g, "--moe-router-topk-scaling-factor", type=float, default=None)
    flag(g, "--moe-router-num-groups", type=int, default=None, help="expert groups for group-limited routing")
    flag(g, "--moe-router-group-topk", type=int, default=None, help="groups each token may use")
    flag(g, "--moe-router-load-balancing-type", nargs="+", default="aux_loss",
         choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    flag(g, "--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    flag(g, "--moe-z-loss-coeff", type=float, default=None)
    flag(g, "--moe-router-enable-expert-bias", **on, help="aux-loss-free balancing (sigmoid scores)")
    flag(g, "--moe-router-bias-update-rate", type=float, default=1e-3)
    flag(g, "--moe-router-dtype", default=None, choices=["fp32", "fp64"], help="router computation dtype")
    flag(g, "--moe-expert-capacity-factor", type=float, default=None, help="token dropping above this capacity")
    flag(g, "--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    flag(g, "--moe-pad-expert-input-to-capacity", **on)
    flag(g, "--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    flag(g, "--moe-grouped-gemm", **on, help="all local experts in one grouped GEMM")
    flag(g, "--moe-shared-expert-intermediate-size", type=int, default=None)
    flag(g, "--moe-shared-expert-gate", **on, help="sigmoid gate on the shared experts' output")
    flag(g, "--moe-per-layer-logging", **on, help="log the MoE losses of every layer")
    # Megatron MoE flags of features not built here: rejected by NOT_YET_SUPPORTED
    flag(g, "--moe-enable-deepep", **on)
    flag(g, "--moe-flex-dispatcher-backend", default=None)
    flag(g, "--moe-permute-fusion", **on)
    flag(g, "--moe-router-fusion", **on)
    flag(g, "--moe-shared-expert-overlap", **on)
    flag(g, "--moe-use-upcycling", **on)
    flag(g, "--moe-input-jitter-eps", type=float, default=None)
    flag(g, "--moe-layer-recompute", **on)
    flag(g, "--moe-use-legacy-grouped-gemm", **on)
    flag(g, "--moe-router-force-load-balancing", **on)
    flag(g, "--moe-apply-probs-on-input", **on)
    flag(g, "--moe-router-padding-for-fp8", **on)
    flag(g, "--moe-router-padding-for-quantization", **on)
    flag(g, "--moe-latent-size", type=int, default=None)
    flag(g, "--moe-extended-tp", **on)
    flag(g, "--multi-latent-attention", **on)

    g = p.add_argument_group("batch and iterations")
    flag(g, "--micro-batch-size", type=int, default=None, help="samples per microbatch per rank (required)")
    flag(g, "--global-batch-size", type=int, default=None, help="samples per iteration (default micro x DP)")
    flag(g, "--train-iters", type=int, default=None)
    flag(g, "--train-samples", type=int, default=None)
    flag(g, "--eval-iters", type=int, default=100)
    flag(g, "--eval-interval", type=int, default=1000)
    flag(g, "--skip-train", **on)
    flag(g, "--check-for-nan-in-loss-and-grad", action="store_true", default=True,
         help="stop before the optimizer step on a NaN/Inf loss or gradient (default: on)")
    flag(g, "--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
         help="count non-finite iterations as skipped and go on")
    flag(g, "--seed", type=int, default=1234)

    g = p.add_argument_group("optimizer and schedule")
    flag(g, "--optimizer", default="adam", choices=["adam", "sgd"])
    flag(g, "--lr", type=float, default=None, help="peak learning rate (required)")
    flag(g, "--min-lr", type=float, default=0.0)
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
    flag(g, "--no-verify-checkpoint", **on, help="skip the CRC-32 check of the checkpoint data read on load")
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
    flag(g, "--timing-log-level", type=int, default=0, choices=[0, 1, 2],
         help="0: iteration time; 1: + forward-backward, gradient reduction, optimizer; 2: + batch reading "
              "((min, max) over ranks each log interval)")
    flag(g, "--log-straggler", **on, help="each log interval: every rank's compute time; name the slowest rank")
    flag(g, "--straggler-minmax-count", type=int, default=1,
         help="with --log-straggler: how many fastest and slowest ranks to name")
    flag(g, "--metrics-file", default=None, help="JSON lines: one object per logged iteration and per evaluation")
    flag(g, "--pipeline-timeline", default=None,
         help="write a Chrome trace (Perfetto) of the last training iteration's pipeline events to this path")
    _add_compat_flags(p)
    return p


def _add_compat_flags(p: argparse.ArgumentParser) -> None:
    """Flags of Megatron-LM's example scripts (attention backend, loss normalization, batch ramp-up, decoupled LR,
    memory and profiling controls), with Megatron's names and defaults (docs/flags.md)."""
    on = dict(action="store_true")
    g = p.add_argument_group("megatron-lm run-time options")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="core attention: auto (PyTorch picks), flash, fused (CUDA kernels of SDPA; on CPU as auto), "
                        "unfused (SDPA's math path), local (explicit softmax(QK^T)V)")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
                   help="with --cross-entropy-loss-fusion: native = fused PyTorch loss (any device); te = the Triton "
                        "kernel (CUDA, or TRITON_INTERPRET=1)")
    g.add_argument("--apply-layernorm-1p", **on, help="zero-centered norm weights: the norm scales by (1 + weight)")
    g.add_argument("--calculate-per-token-loss", **on,
                   help="normalize loss and gradients by the loss tokens of the whole global batch")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="ramp the global batch size from START by INCREMENT over SAMPLES samples")
    g.add_argument("--step-batch-size-schedule", default=None, help="not available yet (see docs/flags.md)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="own peak LR for the word embedding and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="own final LR for the word embedding and the output layer (default --min-lr)")
    g.add_argument("--manual-gc", **on, help="disable Python's automatic garbage collection; collect at fixed points")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N training iterations (0: never during training)")
    g.add_argument("--manual-gc-eval", dest="manual_gc_eval", action="store_true", default=True,
                   help="with --manual-gc: collect before and after each evaluation (the default)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval", action="store_false")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="free the allocator's cached blocks: 1 after backward (and each evaluation step), "
                        "2 also after the optimizer step")
    g.add_argument("--fp8-param-gather", **on,
                   help="accepted; parameters are all-gathered in their own dtype (noted in the log)")
    g.add_argument("--profile", **on, help="profile iterations [--profile-step-start, --profile-step-end)")
    g.add_argument("--use-pytorch-profiler", **on,
                   help="with --profile: torch.profiler, trace written to --tensorboard-dir (else the CUDA "
                        "profiler for nsys)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    g.add_argument("--use-mcore-models", **on, help="accepted (deprecated in Megatron-LM; the only model here)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false",
                   help="accepted: the data pipeline never builds attention masks (the model makes them)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read .bin files with plain file reads instead of a memory map")
    g.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                   help="TikTokenizer's split pattern (default v2)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); unknown flags exit 2 with one line."""
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# Flags -> configs: by field name (argparse dest == dataclass field), a rule only where the names differ
# ---------------------------------------------------------------------------------------------------------------
def _one_or_list(value):
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def moe_layer_freq(text: str):
    """``--moe-layer-freq``: an int N (every N-th layer is MoE) or Megatron's list expression such as
    ``"([1]*3+[0]*1)*2"`` (1: MoE layer, 0: dense). The expression is evaluated over lists, ints, ``+`` and ``*``
    only (never ``eval``)."""
    import ast

    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int or a list pattern, got {text!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise argparse.ArgumentTypeError(f"unsupported element in pattern {text!r} (use lists, ints, + and *)")

    try:
        value = ev(ast.parse(text, mode="eval"))
    except SyntaxError:
        raise argparse.ArgumentTypeError(f"cannot read pattern {text!r}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"pattern {text!r} is not a list")
    return value


def _rules(args, load_resolved: tuple[str, int | None] | None = None) -> dict[type, dict]:
    """The config fields whose value is not the flag of the same name: a renamed flag or Megatron's rule (and
    the ``--load`` checkpoint that ``--use-checkpoint-args`` resolved)."""
    constant_wd = args.weight_decay_incr_style == "constant"
    return {
        ModelConfig: dict(
            # Megatron uses --num-query-groups only under --group-query-attention (None: one group per head)
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
            transformer_impl=args.transformer_impl or "local",
            # Megatron: one load-balancing type (and coefficient) given as a list of one is that value
            moe_router_load_balancing_type=_one_or_list(args.moe_router_load_balancing_type),
            moe_aux_loss_coeff=_one_or_list(args.moe_aux_loss_coeff),
        ),
        OptimizerConfig: dict(
            start_weight_decay=args.weight_decay if constant_wd else args.start_weight_decay,
            end_weight_decay=args.weight_decay if constant_wd else args.end_weight_decay,
            loss_scale_window=int(args.loss_scale_window) if float(args.loss_scale_window).is_integer()
            else args.loss_scale_window,  # not whole: reported by _flag_problems
            # Megatron: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
            accumulate_allreduce_grads_in_fp32=(not args.grad_reduce_in_bf16) if args.bf16
            else args.accumulate_allreduce_grads_in_fp32,
        ),
        TrainingConfig: dict(notes=_notes(args)),
        DataConfig: dict(data_path=list(args.data_path or []),
                         split=args.split if args.split is not None else DataConfig.split,
                         vocab_size_flag=args.vocab_size),
        CheckpointConfig: dict(load_resolved=load_resolved),
    }


def _notes(args) -> list[str]:
    """One log line per flag that is accepted but does something different here (printed once at set-up)."""
    notes = []
    if args.fp8_param_gather:
        notes.append("--fp8-param-gather: parameters are kept and all-gathered in their own dtype; the FP8 linears "
                     "cast them on use (same training, twice the all-gather bytes of FP8 parameters)")
    if args.use_mcore_models:
        notes.append("--use-mcore-models: accepted; it is the only model here (the flag is deprecated in "
                     "Megatron-LM)")
    if args.vocab_size is not None and args.tokenizer_type not in (None, "NullTokenizer", "TikTokenizer"):
        notes.append(f"--vocab-size {args.vocab_size}: not used by --tokenizer-type {args.tokenizer_type} (the "
                     "vocabulary is the tokenizer's, as in Megatron-LM)")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern}: used by TikTokenizer only (this run's tokenizer "
                     f"is {args.tokenizer_type or 'the default'}), as in Megatron-LM")
    if args.mock_data and args.split is not None:
        notes.append(f"--split {args.split}: --mock-data draws its own synthetic samples for training and "
                     "validation; there is no corpus to split")
    return notes


def _from_flags(cls, args, rules: dict, **init_only):
    """``cls`` with every field taken from the flag of the same name, or from ``rules``."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in rules:
            kw[f.name] = rules[f.name]
        elif hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no flag of that name and no rule in arguments._rules")
    return cls(**kw, **init_only)


def _virtual_stages(args) -> int:
    """Virtual stages per pipeline rank from either virtual-pipeline flag (1 without them)."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and per_rank is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
                          "mutually exclusive; pass one")
    if per_rank is not None:
        return per_rank
    if per_stage is not None:
        return virtual_stages_from_layers(args.num_layers, args.pipeline_model_parallel_size, per_stage)
    return 1


def _parallel_dims(args, world_size: int, errors: list[str]) -> ParallelDims | None:
    try:
        vp = _virtual_stages(args)
    except ConfigError as e:
        errors.append(str(e))
        vp = 1
    try:
        return parallel_dims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, vp=vp, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                            tie_embeddings=not args.untie_embeddings_and_output_weights)
    except ConfigError as e:
        errors.append(str(e))
        return None


@dataclasses.dataclass
class _Draft:
    """The configs built from the flags before validation. ``model`` is built unchecked (its problems are
    listed with the others) with a placeholder vocabulary; ``model``/``parallel`` are None when the flags
    cannot make one (a required flag missing, impossible degrees: already reported), and then ``run`` is None."""

    model: ModelConfig | None
    parallel: ParallelDims | None
    train: TrainingConfig
    optim: OptimizerConfig
    logging: LoggingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    sequence_parallel_flag: bool
    run: RunConfig | None = None

    def __post_init__(self):
        if self.run is None and self.model is not None and self.parallel is not None:
            self.run = RunConfig(model=self.model, parallel=self.parallel, train=self.train, optim=self.optim,
                                 logging=self.logging, data=self.data, checkpoint=self.checkpoint,
                                 sequence_parallel_flag=self.sequence_parallel_flag)

    @classmethod
    def of(cls, cfg: RunConfig) -> "_Draft":
        return cls(cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.logging, cfg.data, cfg.checkpoint,
                   cfg.sequence_parallel_flag, run=cfg)


def _draft(args, world_size: int, errors: list[str], load_resolved=None) -> _Draft:
    rules = _rules(args, load_resolved)
    parallel = _parallel_dims(args, world_size, errors)
    model = None
    if not _missing_required(args):
        model = _from_flags(ModelConfig, args, {**rules[ModelConfig], "vocab_size": 1}, check=False)
    return _Draft(model=model, parallel=parallel, train=_from_flags(TrainingConfig, args, rules[TrainingConfig]),
                  optim=_from_flags(OptimizerConfig, args, rules[OptimizerConfig]),
                  logging=_from_flags(LoggingConfig, args, {}), data=_from_flags(DataConfig, args, rules[DataConfig]),
                  checkpoint=_from_flags(CheckpointConfig, args, rules[CheckpointConfig]),
                  sequence_parallel_flag=args.sequence_parallel)


# ---------------------------------------------------------------------------------------------------------------
# Validation. What only the command line shows (which flags were given) is checked on the flags; everything else
# on the configs (``validate``). Every problem is one line naming the flags.
# ---------------------------------------------------------------------------------------------------------------
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")


def _missing_required(args) -> list[str]:
    """One line for all the missing required flags."""
    missing = [f"--{dest.replace('_', '-')}" for dest in _REQUIRED if getattr(args, dest) is None]
    return [f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required"] if missing else []


def _flag_problems(args, for_training: bool = True) -> list[str]:
    """Rules about which flags were given: not-yet-available features, required flags, mutually exclusive and
    dependent flags whose difference the configs no longer show."""
    errors = [rule.message(getattr(args, dest)) for dest, rule in NOT_YET_SUPPORTED.items()
              if getattr(args, dest) not in rule.allowed]
    errors += _missing_required(args)
    iters, samples = args.train_iters, args.train_samples
    if for_training and iters is None and samples is None:
        errors.append("pass --train-iters or --train-samples (the training length)")
    elif iters is not None and samples is not None:
        errors.append(f"--train-iters {iters} and --train-samples {samples} are mutually exclusive; pass one")
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
    if args.weight_decay_incr_style == "constant":
        given = [f for f, v in (("--start-weight-decay", args.start_weight_decay),
                                ("--end-weight-decay", args.end_weight_decay)) if v is not None]
        if given:
            errors.append(f"{' and '.join(given)} need --weight-decay-incr-style linear or cosine (with the "
                          "constant style use --weight-decay)")
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        errors.append(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                      "--start-weight-decay and --end-weight-decay")
    if not args.loss_scale_window >= 1 or not float(args.loss_scale_window).is_integer():
        errors.append(f"--loss-scale-window must be a whole number >= 1, got {args.loss_scale_window}")
    _check_compat_flags(args, errors)
    _check_tokenizer_flags(args, errors)
    return errors


def _check_compat_flags(args, errors: list[str]) -> None:
    """Flag-level rules of the Megatron-LM compatibility flags."""
    if args.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        errors.append(f"--profile-step-start {args.profile_step_start} must be >= 0 and below --profile-step-end "
                      f"{args.profile_step_end}")
    if args.profile and args.use_pytorch_profiler and not args.tensorboard_dir:
        errors.append("--profile --use-pytorch-profiler writes its trace to --tensorboard-dir; pass it")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        errors.append("--decoupled-min-lr needs --decoupled-lr (the peak LR of the embedding and output layer)")
    elif args.decoupled_lr is not None:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if not 0 <= floor <= args.decoupled_lr or args.lr_warmup_init > args.decoupled_lr:
            errors.append(f"--decoupled-lr {args.decoupled_lr} must be >= --decoupled-min-lr (default --min-lr) "
                          f"{floor} >= 0 and >= --lr-warmup-init {args.lr_warmup_init}")


def _check_tokenizer_flags(args, errors: list[str]) -> None:
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


def _collect(errors: list[str], check: Callable[[], None]) -> bool:
    """Run ``check``; append its :class:`ConfigError` to ``errors``. True when it passed."""
    try:
        check()
    except ConfigError as e:
        errors.append(str(e))
        return False
    return True


def _problems(d: _Draft, errors: list[str], for_training: bool = True) -> list[str]:
    """``errors`` plus every problem of the configs, in the order of the flag groups."""
    m, dims = d.model, d.parallel
    fits = m is not None and dims is not None and _collect(errors, lambda: validate_model(
        dims, num_layers=m.num_layers, num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        seq_length=m.seq_length, sequence_parallel=d.run.sequence_parallel,
        hidden_size=m.hidden_size if m.kv_channels is None else None, ffn_hidden_size=m.ffn_hidden_size))
    if for_training:
        _check_batch(d.train, d.run if fits else None, errors)
        _check_schedule(d.optim, errors)
        if not errors and d.run is not None:
            _check_warmup_vs_decay(d.run, errors)
    _check_data(d.data, errors, for_training)
    _check_precision(d.optim, m, errors)
    _check_model(m, errors)
    _check_context_parallel(m, dims, errors)
    _check_moe(m, dims, d.run is not None and d.run.sequence_parallel, errors)
    _check_fsdp(d.optim, m, errors, d.train)
    _check_checkpoint(d.checkpoint, errors)
    _check_logging(d.logging, errors)
    if fits and not errors:
        errors += m.problems()
    return errors


def _check_fsdp(o: OptimizerConfig, m: ModelConfig | None, errors: list[str],
                t: TrainingConfig | None = None) -> None:
    if not o.use_torch_fsdp2:
        given = [f for f, on in (("--fsdp-reshard-after-forward", o.fsdp_reshard_after_forward != "default"),
                                 ("--fsdp-prefetch-layers", o.fsdp_prefetch_layers != 1)) if on]
        if given:
            errors.append(f"{' and '.join(given)} set FSDP2 options; add --use-torch-fsdp2 or drop them")
        return
    for flag, on in (("--overlap-grad-reduce", o.overlap_grad_reduce), ("--ddp-bucket-size", o.ddp_bucket_size)):
        if on:
            errors.append(f"{flag} is our DDP's; FSDP2 (--use-torch-fsdp2) reduce-scatters each layer's gradients "
                          "as its backward ends; drop the flag")
    if o.use_distributed_optimizer:
        errors.append("--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive (FSDP2 shards the "
                      "optimizer state itself); pass one")
    if o.fsdp_prefetch_layers < 0:
        errors.append(f"--fsdp-prefetch-layers must be >= 0, got {o.fsdp_prefetch_layers}")
    if m is not None and m.num_experts is not None:
        errors.append("--use-torch-fsdp2 with --num-experts: FSDP2 does not shard expert weights over expert-DP "
                      "yet (as in Megatron-LM); drop --use-torch-fsdp2 (use --use-distributed-optimizer)")
    if m is not None and m.fp8 is not None:
        errors.append("--use-torch-fsdp2 with --fp8-format is not available yet; drop one of them")
    if t is not None and t.calculate_per_token_loss:
        errors.append("--use-torch-fsdp2 with --calculate-per-token-loss is not available yet (FSDP2 averages the "
                      "gradients it reduce-scatters); drop one of them")


def _check_batch(t: TrainingConfig, run: RunConfig | None, errors: list[str]) -> None:
    mbs, gbs = t.micro_batch_size, t.global_batch_size
    if mbs is not None and mbs < 1:
        errors.append(f"--micro-batch-size must be >= 1, got {mbs}")
        return
    if gbs is not None and gbs < 1:
        errors.append(f"--global-batch-size must be >= 1, got {gbs}")
        return
    if run is None or mbs is None:
        return
    dims, per_step = run.parallel, run.data_parallel_batch_size
    if gbs % per_step:
        errors.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel "
                      f"size {dims.dp} = {per_step}")
    elif dims.vp > 1:
        _collect(errors, lambda: check_interleaving(dims.pp, dims.vp, run.num_microbatches, micro_batch_size=mbs,
                                                    global_batch_size=gbs, data_parallel_size=dims.dp))
    if t.rampup_batch_size is not None and not gbs % per_step:
        problems = rampup_problems(t.rampup_batch_size, gbs, per_step)
        errors += problems
        if not problems and dims.vp > 1:  # every ramp size must suit the interleaved schedule too
            for b in sorted({b for _, b in rampup_steps(t.rampup_batch_size, gbs)}):
                if not _collect(errors, lambda b=b: check_interleaving(
                        dims.pp, dims.vp, b // per_step, micro_batch_size=mbs, global_batch_size=b,
                        data_parallel_size=dims.dp)):
                    break


def _check_schedule(o: OptimizerConfig, errors: list[str]) -> None:
    if o.lr is None:
        errors.append("--lr is required (the peak learning rate)")
    elif o.min_lr > o.lr:
        errors.append(f"--min-lr {o.min_lr} is larger than --lr {o.lr}")
    elif o.lr_warmup_init > o.lr:
        errors.append(f"--lr-warmup-init {o.lr_warmup_init} is larger than --lr {o.lr}")
    if o.min_lr < 0:
        errors.append(f"--min-lr {o.min_lr} must be >= 0")
    if o.lr_warmup_fraction is not None and o.lr_warmup_iters:
        errors.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-iters "
                      f"{o.lr_warmup_iters} are mutually exclusive; pass one")
    if o.lr_warmup_fraction is not None and o.lr_warmup_samples:
        errors.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-samples "
                      f"{o.lr_warmup_samples} are mutually exclusive; pass one")
    if o.lr_decay_iters is not None and o.lr_decay_samples is not None:
        errors.append(f"--lr-decay-iters {o.lr_decay_iters} and --lr-decay-samples {o.lr_decay_samples} are "
                      "mutually exclusive; pass one")
    if o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_samples is not None:
        errors.append("--lr-wsd-decay-iters and --lr-wsd-decay-samples are mutually exclusive; pass one")
    if o.lr_decay_style == "WSD" and o.lr_wsd_decay_iters is None and o.lr_wsd_decay_samples is None:
        errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with "
                      "--train-samples)")
    if o.weight_decay_incr_style != "constant" and None not in (o.start_weight_decay, o.end_weight_decay) \
            and not 0 <= o.start_weight_decay <= o.end_weight_decay:
        errors.append(f"--start-weight-decay {o.start_weight_decay} must be >= 0 and <= "
                      f"--end-weight-decay {o.end_weight_decay}")


def _check_warmup_vs_decay(cfg: RunConfig, errors: list[str]) -> None:
    """Megatron asserts warm-up < decay (in samples); checked once the lengths are known."""
    t = cfg.train
    if (t.train_iters is None and t.train_samples is None) or t.global_batch_size is None:
        return
    from .optim.lr_schedule import scheduler_steps_from_config  # the schedule's own rule

    steps = scheduler_steps_from_config(cfg)
    warmup, decay, wsd = steps["lr_warmup_steps"], steps["lr_decay_steps"], steps["wsd_decay_steps"]
    if decay <= 0:
        errors.append(f"the LR decay length must be > 0 (got {decay} samples); check --lr-decay-iters/"
                      "--lr-decay-samples/--train-iters/--train-samples")
    elif warmup >= decay:
        errors.append(f"the LR warm-up ({warmup:g} samples) must be shorter than the LR decay ({decay} samples); "
                      "lower --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction or raise "
                      "--lr-decay-iters/--lr-decay-samples")
    if cfg.optim.lr_decay_style == "WSD" and wsd is not None and not 0 < wsd <= decay:
        errors.append(f"--lr-wsd-decay-iters/--lr-wsd-decay-samples gives {wsd} samples; it must be > 0 and at "
                      f"most the LR decay length ({decay} samples)")


def _check_data(d: DataConfig, errors: list[str], for_training: bool = True) -> None:
    per_split = d.train_data_path or d.valid_data_path or d.test_data_path
    if d.num_workers < 0:
        errors.append(f"--num-workers must be >= 0 (0: read batches in the training process), got {d.num_workers}")
    if d.mock_data and (d.data_path or per_split):
        errors.append("--mock-data and --data-path (or --train/valid/test-data-path) are mutually exclusive; pass one")
    elif d.data_path and per_split:
        errors.append("--data-path with --split and --train/valid/test-data-path are mutually exclusive; pass one")
    elif for_training and not d.mock_data and not d.data_path and not d.train_data_path:
        errors.append("no training data: pass --data-path PREFIX (or weighted prefixes), --train-data-path, "
                      "or --mock-data")
    if d.mock_data and d.reset_attention_mask:
        errors.append("--reset-attention-mask needs document boundaries from real data (--data-path); --mock-data "
                      "has none")


def _check_precision(o: OptimizerConfig, m: ModelConfig | None, errors: list[str]) -> None:
    if o.fp16 and o.bf16:
        errors.append("--fp16 and --bf16 are mutually exclusive; pass at most one")
    if o.overlap_param_gather and not o.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps that optimizer's "
                      "parameter all-gather)")
    elif o.overlap_param_gather and not o.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    if o.loss_scale is not None and o.loss_scale <= 0:
        errors.append(f"--loss-scale must be > 0, got {o.loss_scale}")
    if not 0 < o.min_loss_scale <= o.initial_loss_scale:
        errors.append(f"--min-loss-scale {o.min_loss_scale} must be > 0 and <= --initial-loss-scale "
                      f"{o.initial_loss_scale}")
    if o.hysteresis < 1:
        errors.append(f"--hysteresis must be >= 1, got {o.hysteresis}")
    if m is None:
        return
    if m.fp8 is not None:
        from .precision.fp8 import Fp8Recipe  # only with --fp8-format

        _collect(errors, lambda: Fp8Recipe(
            fp8_format=m.fp8, fp8_recipe=m.fp8_recipe if m.fp8_recipe in ("delayed", "tensorwise") else "delayed",
            fp8_margin=m.fp8_margin, fp8_amax_history_len=m.fp8_amax_history_len,
            fp8_amax_compute_algo=m.fp8_amax_compute_algo))
    if m.transformer_impl != "local":
        from .precision.fp8 import check_transformer_impl  # imports TE lazily

        _collect(errors, lambda: check_transformer_impl(m.transformer_impl))


def _check_model(m: ModelConfig | None, errors: list[str]) -> None:
    if m is None:
        return
    mpe, s = m.max_position_embeddings, m.seq_length
    if m.position_embedding_type == "learned_absolute" and mpe < s:
        errors.append(f"--max-position-embeddings {mpe} is smaller than --seq-length {s} with learned absolute "
                      "positions; raise --max-position-embeddings")
    if m.swiglu and m.openai_gelu:
        errors.append("--swiglu and --openai-gelu are mutually exclusive; pass one")
    # The fused Triton kernels need triton and CUDA, or TRITON_INTERPRET=1 (kernels on CPU).
    asked = [f for f, on in (("--use-triton-kernels", m.use_triton_kernels),
                             ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
                              m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "te")) if on]
    if asked:
        from .kernels import check_kernels_available  # only when asked for

        _collect(errors, lambda: check_kernels_available(asked))


def _check_context_parallel(m: ModelConfig | None, dims: ParallelDims | None, errors: list[str]) -> None:
    if m is None:
        return
    types, sizes = m.cp_comm_types, m.hierarchical_context_parallel_sizes
    if len(types) not in (1, m.num_layers):
        errors.append(f"--cp-comm-type takes one type or one per layer (--num-layers {m.num_layers}), got "
                      f"{len(types)}")
    if sizes is not None and "a2a+p2p" not in types:
        errors.append("--hierarchical-context-parallel-sizes goes with --cp-comm-type a2a+p2p; drop it or use that "
                      "type")
    if dims is None or dims.cp == 1:
        return
    cp, tp, flag = dims.cp, dims.tp, f"--context-parallel-size {dims.cp}"
    if m.attention_dropout:
        errors.append(f"{flag} needs --attention-dropout 0 (attention dropout inside context-parallel attention is "
                      f"not available yet; Megatron's default is 0.1)")
    heads, groups = m.num_attention_heads, m.num_query_groups
    if "a2a" in types and ((heads // tp) % cp or (groups // tp) % cp):
        errors.append(f"--cp-comm-type a2a scatters the local attention heads over {flag}: the heads per TP rank "
                      f"({heads} / {tp}) and the query groups per TP rank ({groups} / {tp}) must divide by {cp}")
    if "a2a+p2p" in types:
        if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != cp or min(sizes) < 1:
            errors.append(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes INNER OUTER with INNER "
                          f"x OUTER = {flag} (INNER adjacent ranks use all-to-all, the ring spans OUTER), got "
                          f"{sizes}")
        elif (heads // tp) % sizes[0] or (groups // tp) % sizes[0]:
            errors.append(f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}: the heads per TP rank "
                          f"({heads} / {tp}) and the query groups per TP rank ({groups} / {tp}) must divide by the "
                          f"all-to-all size {sizes[0]}")


def _check_moe(m: ModelConfig | None, dims: ParallelDims | None, sequence_parallel: bool,
               errors: list[str]) -> None:
    """Mixture of experts against the layout (the MoE flags' own problems are ``ModelConfig.moe_problems``)."""
    if m is None or dims is None:
        return
    ep, etp = dims.ep, dims.expert_tp
    if m.num_experts is None:
        given = [f for f, on in ((f"--expert-model-parallel-size {ep}", ep > 1),
                                 (f"--expert-tensor-parallel-size {dims.etp}", dims.etp not in (None, dims.tp)))
                 if on]
        if given:
            errors.append(f"{' and '.join(given)} need --num-experts (a mixture-of-experts model)")
        return
    if m.num_experts < 1:
        return  # named by moe_problems
    if m.num_experts % ep:
        errors.append(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}; every "
                      "expert-parallel rank holds the same number of experts")
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if ffn % etp:
        errors.append(f"--moe-ffn-hidden-size {ffn} is not divisible by the expert tensor-parallel size {etp} "
                      "(--expert-tensor-parallel-size, default --tensor-model-parallel-size)")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % dims.tp:
        errors.append(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                      f"--tensor-model-parallel-size {dims.tp}")
    if dims.tp > 1 and not sequence_parallel:
        errors.append(f"--num-experts with --tensor-model-parallel-size {dims.tp} needs --sequence-parallel (as in "
                      "Megatron-LM: the expert layers take each tensor-parallel rank's own tokens)")
    if dims.cp > 1:
        errors.append(f"--num-experts with --context-parallel-size {dims.cp} is not available yet in this version; "
                      "use --context-parallel-size 1")


def _check_logging(lg: LoggingConfig, errors: list[str]) -> None:
    if lg.straggler_minmax_count < 1:
        errors.append(f"--straggler-minmax-count must be >= 1, got {lg.straggler_minmax_count}")
    if lg.log_interval is not None and lg.log_interval < 1:
        errors.append(f"--log-interval must be >= 1, got {lg.log_interval}")


def _check_checkpoint(c: CheckpointConfig, errors: list[str]) -> None:
    for name in ("save_interval", "exit_interval", "exit_duration_in_mins"):
        value = getattr(c, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if c.use_checkpoint_args and not c.load:
        errors.append("--use-checkpoint-args needs --load (the checkpoint to take the model flags from)")


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))


def validate(cfg: RunConfig) -> None:
    """Check a run configuration against itself and its parallel layout; raise one :class:`ConfigError` listing
    every problem, one line each, naming the flags."""
    _raise(_problems(_Draft.of(cfg), []))


def _validated(args: argparse.Namespace, world_size: int, for_training: bool = True,
               load_resolved: tuple[str, int | None] | None = None) -> RunConfig:
    if not for_training and args.micro_batch_size is None:  # generation: one sequence per micro-batch
        args = copy.copy(args)  # the caller's namespace stays as given
        args.micro_batch_size = 1
    errors = _flag_problems(args, for_training)
    draft = _draft(args, world_size, errors, load_resolved)
    _raise(_problems(draft, errors, for_training))
    return draft.run


def validate_args(args: argparse.Namespace, world_size: int, *, for_training: bool = True) -> None:
    """Check every flag against the others and the world size; raise one :class:`ConfigError` listing every
    problem, one line each, naming the flags. Does not modify ``args``. ``for_training=False`` (text
    generation from a checkpoint): the batch, schedule and training-data flags are not needed."""
    _validated(args, world_size, for_training)


def configs_from_args(args: argparse.Namespace, world_size: int, *, for_training: bool = True) -> RunConfig:
    """Validate ``args`` and build the :class:`RunConfig` (derived values filled as Megatron-LM does).
    ``for_training=False``: see :func:`validate_args` (the micro-batch size defaults to 1). Under
    ``--use-checkpoint-args`` the ``--load`` checkpoint is resolved once, here: its stored config fills the flags
    (of a copy: ``args`` stays as given) and the loader loads that iteration (``CheckpointConfig.load_resolved``)."""
    load_resolved = None
    if getattr(args, "use_checkpoint_args", False) and args.load:  # without --load: validation names it
        from .checkpoint.args import checkpoint_arg_values, resolve_load  # reads the checkpoint's config

        load_resolved = resolve_load(args.load)
        values = checkpoint_arg_values(args, load_resolved[0])
        args = copy.copy(args)
        for dest, value in values.items():
            setattr(args, dest, value)
    cfg = _validated(args, world_size, for_training, load_resolved)
    # The model's true vocabulary is the tokenizer's, built here once (it may read files) and kept on cfg.data.
    cfg.model = dataclasses.replace(cfg.model, vocab_size=int(cfg.data.tokenizer.vocab_size))
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Entry-point helper
# ---------------------------------------------------------------------------------------------------------------
def exit_on_config_error(fn: Callable[[], T], *, once_per_node: bool = False) -> T:
    """Run ``fn()``; on a :class:`~megatronish.errors.UserError` (a flag, data file, tokenizer or checkpoint
    problem) print ``error: <line>`` per problem to stderr (no traceback) and exit 2.

    ``once_per_node``: for checks every process makes identically (flag validation under a launcher), only local
    rank 0 prints, so the message appears once per node instead of once per process."""
    try:
        return fn()
    except UserError as e:
        if not once_per_node or os.environ.get("LOCAL_RANK", "0") == "0":
            lines = str(e).splitlines() or [repr(e)]
            sys.stderr.write("".join(f"error: {line}\n" for line in lines))
            sys.stderr.flush()
        raise SystemExit(2) from None
