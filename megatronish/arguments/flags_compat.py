"""Flag group of Megatron-LM's run-time options (its example scripts' flags)."""
from __future__ import annotations

import argparse

from ..config import ATTENTION_BACKENDS


def add_compat_flags(p: argparse.ArgumentParser) -> None:
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
