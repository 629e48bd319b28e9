"""The error family for problems with what a user gave: flags, data files, tokenizer files, a checkpoint.

Entry points catch :class:`UserError` (``megatronish.arguments.exit_on_config_error``) and print one
``error: <line>`` per problem, without a traceback, and exit 2. Everything else is a bug and keeps its traceback.
"""
from __future__ import annotations

__all__ = ["UserError", "ConfigError"]


class UserError(Exception):
    """A problem with the user's input; the message names the flag, file or setting and the fix, one line each."""


class ConfigError(ValueError, UserError):
    """A user configuration error; the message names the flag and the fix."""
