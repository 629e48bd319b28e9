"""The parser: every flag group, in the order ``--help`` lists them."""
from __future__ import annotations

import argparse

from ..errors import CommandLineParser
from .flags_compat import add_compat_flags
from .flags_model import add_mla_flags, add_model_flags, add_moe_flags
from .flags_parallel import add_parallel_flags
from .flags_run import add_checkpoint_flags, add_data_flags, add_logging_flags
from .flags_training import add_batch_flags, add_optimizer_flags, add_precision_flags


def build_parser(prog: str = "pretrain_gpt.py", description: str = "Pretrain a GPT model (Megatron-LM flags).",
                 ) -> argparse.ArgumentParser:
    """All flags, with Megatron-LM's names and defaults (differences in docs/flags.md). Other entry points
    (text generation) take the same model and checkpoint flags and add their own group."""
    p = CommandLineParser(prog=prog, description=description, allow_abbrev=False)
    for add in (add_model_flags, add_mla_flags, add_parallel_flags, add_moe_flags, add_batch_flags,
                add_optimizer_flags, add_precision_flags, add_checkpoint_flags, add_data_flags, add_logging_flags,
                add_compat_flags):
        add(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); unknown flags exit 2 with one line."""
    return build_parser().parse_args(argv)
