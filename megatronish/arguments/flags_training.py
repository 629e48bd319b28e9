"""Flag groups of training: batch and iterations, optimizer and schedule, mixed precision."""
from __future__ import annotations

from ._group import flag, on


def add_batch_flags(p) -> None:
    """Batch sizes, iterations, evaluation and the seed."""
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
    # Megatron's rerun engine (training/rerun.py, docs/reliability.md)
    flag(g, "--rerun-mode", default="validate_results", choices=["disabled", "validate_results", "report_stats"],
         help="validate_results: rerun a suspicious iteration to tell a faulty rank from a divergence; "
              "report_stats: run every iteration twice and report how much the results differ")
    flag(g, "--check-for-spiky-loss", **on, help="a loss 10x the largest of the first 100 is suspicious")
    flag(g, "--check-for-large-grads", **on, help="a gradient norm 10x the largest of the first 100 is suspicious")
    flag(g, "--error-injection-rate", type=int, default=0,
         help="testing: inject a fault into about one iteration in N (0: none)")
    flag(g, "--error-injection-type", default="transient_error",
         choices=["correct_result", "transient_error", "persistent_error"],
         help="testing: what a rerun of an injected iteration sees")
    flag(g, "--seed", type=int, default=1234)


def add_optimizer_flags(p) -> None:
    """Optimizer, learning-rate and weight-decay schedule."""
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
    flag(g, "--enable-optimizer-post-validation", **on,
         help="take the optimizer step before the pipeline stages agree on the gradient norm and validate it one "
         "iteration later, rolled back and taken again where clipping or a skip was due: no synchronization "
         "between iterations (the zero-bubble schedules' last bubble, docs/pipeline.md)")
    flag(g, "--adam-beta1", type=float, default=0.9)
    flag(g, "--adam-beta2", type=float, default=0.999)
    flag(g, "--adam-eps", type=float, default=1e-8)
    flag(g, "--sgd-momentum", type=float, default=0.9)
    flag(g, "--override-opt_param-scheduler", **on)
    flag(g, "--use-checkpoint-opt_param-scheduler", **on)


def add_precision_flags(p) -> None:
    """fp16/bf16 and the loss scaler, FP8."""
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


