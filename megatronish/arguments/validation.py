"""Validation and the entry points' use of it: every problem at once, one line each, before any process group starts."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Callable, TypeVar

from ..config import RunConfig
from ..errors import ConfigError, UserError
from ..parallel_config import validate_model
from .checks import (
    _check_batch,
    _check_checkpoint,
    _check_context_parallel,
    _check_data,
    _check_fsdp,
    _check_logging,
    _check_model,
    _check_moe,
    _check_pipeline_schedule,
    _check_post_validation,
    _check_precision,
    _check_rerun,
    _check_schedule,
    _check_warmup_vs_decay,
    _collect,
)
from .flag_checks import _flag_problems
from .mapping import _Draft, _draft

T = TypeVar("T")

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
        _check_rerun(d.train, errors)
        _check_post_validation(d.optim, d.train, errors)
        if not errors and d.run is not None:
            _check_warmup_vs_decay(d.run, errors)
    _check_data(d.data, errors, for_training)
    _check_precision(d.optim, m, errors)
    _check_model(m, errors)
    _check_context_parallel(m, dims, d.hierarchical_cp_sizes, errors)
    _check_moe(m, dims, d.run is not None and d.run.sequence_parallel, errors)
    _check_fsdp(d.optim, m, errors, d.train)
    _check_pipeline_schedule(dims, d.train, errors, for_training)
    _check_checkpoint(d.checkpoint, errors)
    _check_logging(d.logging, errors)
    if fits and not errors:
        errors += m.problems()
    return errors


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
    from ..checkpoint.layout import is_hf_model_dir

    load_resolved, hf_vocab = None, None
    if is_hf_model_dir(args.load):  # a Hugging Face model directory: its config.json gives the model flags
        from .hf_args import hf_arg_values
        from .parser import build_parser

        values, hf_vocab = hf_arg_values(args, args.load, build_parser())
        args = copy.copy(args)
        for dest, value in values.items():
            setattr(args, dest, value)
    elif getattr(args, "use_checkpoint_args", False) and args.load:  # without --load: validation names it
        from ..checkpoint.args import checkpoint_arg_values, resolve_load  # reads the checkpoint's config

        load_resolved = resolve_load(args.load)
        values = checkpoint_arg_values(args, load_resolved[0])
        args = copy.copy(args)
        for dest, value in values.items():
            setattr(args, dest, value)
    cfg = _validated(args, world_size, for_training, load_resolved)
    # The model's true vocabulary is the tokenizer's, built here once (it may read files) and kept on cfg.data;
    # a Hugging Face model keeps its own (every embedding row; the tokenizer must fit in it).
    vocab = int(cfg.data.tokenizer.vocab_size)
    if hf_vocab is not None:
        if vocab > hf_vocab:
            raise ConfigError(f"the tokenizer has {vocab} tokens, more than the vocabulary of --load {args.load} "
                              f"({hf_vocab}, config.json vocab_size); use the model's tokenizer")
        vocab = hf_vocab
    return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=vocab))


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
