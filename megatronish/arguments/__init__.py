"""Command line with Megatron-LM's flag names, meanings and defaults, mapped to the dataclass configs.

``parse_args`` -> ``configs_from_args``: each config field takes the flag of its own name (``mapping._rules``
lists the few that do not), then :func:`validate` checks the configs and raises every problem at once, one line
each, before any process group starts (``validate_args`` runs the same checks without returning the configs).
Megatron flags whose feature is not available yet are parsed with Megatron's names and defaults, and a non-default
value is rejected by ``validate_args`` through the single table :data:`NOT_YET_SUPPORTED`; enabling a feature later
means deleting its entry.

The modules: ``parser`` (``build_parser``, the groups in ``--help`` order) over the flag groups ``flags_model``
(model, mixture of experts), ``flags_parallel``, ``flags_training`` (batch, optimizer, mixed precision),
``flags_run`` (checkpointing, data and tokenizer, logging), ``flags_compat`` (Megatron-LM's run-time options);
``not_yet`` (the table above, the tokenizer types); ``mapping`` (namespace -> configs); ``flag_checks`` (rules on
which flags were given), ``checks`` (rules on the configs), ``validation`` (``validate``, ``configs_from_args``,
``exit_on_config_error``).

Differences from Megatron-LM are listed in ``docs/flags.md``.
"""
from ..config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    TrainingConfig,
)
from .flags_model import moe_layer_freq
from .mapping import _rules
from .not_yet import NOT_YET_SUPPORTED, SUPPORTED_TOKENIZER_TYPES, TOKENIZER_TYPES, NotYet
from .parser import build_parser, parse_args
from .validation import configs_from_args, exit_on_config_error, validate, validate_args

__all__ = ["build_parser", "parse_args", "validate", "validate_args", "configs_from_args", "exit_on_config_error",
           "NOT_YET_SUPPORTED", "NotYet", "TOKENIZER_TYPES", "SUPPORTED_TOKENIZER_TYPES", "moe_layer_freq",
           "CheckpointConfig", "DataConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig", "RunConfig",
           "TrainingConfig", "_rules"]
