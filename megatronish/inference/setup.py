"""From the command line to a ready :class:`~megatronish.inference.engine.Generator`: the flags of
``pretrain_gpt.py`` (model shape, parallel layout, tokenizer, ``--load``) plus a generation group, then
distributed init, the parallel context, this rank's model slice and the checkpoint (any saved layout loads)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from .. import device
from ..arguments import build_parser, configs_from_args
from ..checkpoint import layout
from ..checkpoint.manager import Checkpointer
from ..model.build import build_model_chunks
from ..parallel import groups
from ..parallel.context import ParallelContext
from ..parallel.dims import ConfigError
from .engine import Generator
from .server import add_server_args

__all__ = ["GenerationSession", "add_generation_args", "build_generation_parser", "configs_for_generation",
           "load_generator"]


def add_generation_args(parser: argparse.ArgumentParser, *, server: bool = False, cli: bool = False):
    """The text-generation flags (Megatron-LM's names where it has them)."""
    g = parser.add_argument_group("text generation")
    g.add_argument("--inference-max-requests", type=int, default=8,
                   help="most prompts generated together (the KV cache's batch)")
    g.add_argument("--inference-max-sequence-length", type=int, default=None,
                   help="prompt + generated tokens per sequence (the KV cache's length; default and maximum with "
                        "learned positions: --max-position-embeddings)")
    if server:
        g.add_argument("--port", type=int, default=5000, help="port of the HTTP server (rank 0)")
        g.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: this machine only; 0.0.0.0 serves the network)")
        add_server_args(g)
    if cli:
        g.add_argument("--prompts", nargs="+", default=None, metavar="PROMPT", help="prompts, each one argument")
        g.add_argument("--prompt-file", default=None,
                       help="one prompt per line ('-': standard input; the default without --prompts)")
        g.add_argument("--num-tokens-to-generate", type=int, default=30, help="tokens to generate per prompt")
        g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
        g.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=1,
                       help="sample from the k most likely tokens; 1 (the default): greedy; 0: no limit")
        g.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0,
                       help="nucleus sampling: the smallest set of tokens with this probability (needs --top_k 0)")
        g.add_argument("--return-log-probs", action="store_true",
                       help="print JSON lines with the tokens' log-probabilities")
        g.add_argument("--stop-strings", nargs="*", default=[], help="stop a sequence once its text holds one")
        g.add_argument("--no-stop-at-eod", action="store_true", help="keep generating after end-of-document")
    return parser


def build_generation_parser(prog: str, description: str, *, server: bool = False, cli: bool = False):
    return add_generation_args(build_parser(prog, description), server=server, cli=cli)


def configs_for_generation(args: argparse.Namespace, world_size: int):
    """Validate the flags for generation and build the :class:`~megatronish.config.RunConfig`; every problem
    is one line of the raised :class:`ConfigError`."""
    errors = []
    if not args.load:
        errors.append("--load is required: the checkpoint directory to generate from")
    elif layout.resolve(args.load) is None and not layout.is_hf_model_dir(args.load):
        errors.append(f"--load {args.load}: no checkpoint there (no {layout.TRACKER} and not an iter_XXXXXXX or "
                      "release directory); point --load at a checkpoint directory or a Hugging Face model directory")
    if args.num_layers_per_virtual_pipeline_stage or args.num_virtual_stages_per_pipeline_rank:
        errors.append("generation runs one model chunk per pipeline rank: drop --num-layers-per-virtual-pipeline-"
                      "stage / --num-virtual-stages-per-pipeline-rank (the checkpoint loads at any layout)")
    if args.inference_max_requests < 1:
        errors.append(f"--inference-max-requests must be >= 1, got {args.inference_max_requests}")
    if args.inference_max_sequence_length is not None and args.inference_max_sequence_length < 1:
        errors.append(f"--inference-max-sequence-length must be >= 1, got {args.inference_max_sequence_length}")
    for flag, dest in (("--num-tokens-to-generate", "num_tokens_to_generate"), ("--top_k", "top_k")):
        if getattr(args, dest, 0) < 0:
            errors.append(f"{flag} must be >= 0, got {getattr(args, dest)}")
    if getattr(args, "temperature", 1.0) <= 0:
        errors.append(f"--temperature must be > 0, got {args.temperature}")
    if not 0 <= getattr(args, "top_p", 0.0) <= 1:
        errors.append(f"--top_p must be in [0, 1], got {args.top_p}")
    elif getattr(args, "top_p", 0.0) > 0 and getattr(args, "top_k", 0) > 1:
        errors.append("--top_k and --top_p cannot both be set: pass --top_k 0 with --top_p")
    if errors:
        raise ConfigError("\n".join(errors))
    args.exit_on_missing_checkpoint = True  # generating from random weights is never what was meant
    args.no_load_optim = args.no_load_rng = True
    cfg = configs_from_args(args, world_size, for_training=False)
    if cfg.parallel.dp > 1:
        raise ConfigError(f"generation uses tensor x pipeline parallel ranks only: start "
                          f"{cfg.parallel.tp * cfg.parallel.pp} processes (--tensor-model-parallel-size x "
                          f"--pipeline-model-parallel-size), not {world_size}")
    m = cfg.model
    if args.inference_max_sequence_length is not None and m.attention.position_embedding_type == "learned_absolute" \
            and args.inference_max_sequence_length > m.max_position_embeddings:
        raise ConfigError(f"--inference-max-sequence-length {args.inference_max_sequence_length} exceeds "
                          f"--max-position-embeddings {m.max_position_embeddings} (learned positions); lower it")
    return cfg


@dataclass
class GenerationSession:
    """What the tools need: the configs, this rank's context, the generator and the tokenizer."""

    cfg: object
    parallel: ParallelContext
    generator: Generator
    tokenizer: object


def load_generator(cfg, args) -> GenerationSession:
    """Distributed init, parallel context, this rank's model slice (bf16/fp16 with ``--bf16``/``--fp16``,
    else fp32; on CUDA when available), checkpoint load (collective)."""
    from ..training.initialize import init_distributed

    init_distributed(cfg.train.distributed_backend, cfg.train.distributed_timeout_minutes)
    ctx = groups.initialize_model_parallel(cfg.parallel)
    dtype = torch.bfloat16 if cfg.optim.bf16 else torch.float16 if cfg.optim.fp16 else torch.float32
    dev = device.current_device()
    (model,) = build_model_chunks(cfg.model, ctx, sequence_parallel=False, device=dev, params_dtype=dtype)
    ck = dataclasses.replace(cfg.checkpoint, no_load_optim=True, no_load_rng=True, finetune=True,
                             exit_on_missing_checkpoint=True)
    if ck.load_hf:  # a Hugging Face model directory: each rank reads its own blocks
        from ..convert.hf_load import load_hf_weights

        load_hf_weights([model], cfg, ctx, ck.load)
    else:
        Checkpointer(dataclasses.replace(cfg, checkpoint=ck), [model], None, None, parallel=ctx).load(
            argparse.Namespace(iteration=0, consumed_samples=0, valid_consumed_samples=0))
    model.eval()
    max_seq = args.inference_max_sequence_length or cfg.model.max_position_embeddings
    gen = Generator(model, ctx, max_batch=args.inference_max_requests, max_sequence=max_seq,
                    cache_mla_latents=args.cache_mla_latents)
    return GenerationSession(cfg, ctx, gen, cfg.data.tokenizer)  # the run's one tokenizer
