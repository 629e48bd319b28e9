"""The error family for problems with what a user gave: flags, data files, tokenizer files, a checkpoint, a blend,
a conversion input; and the failures that end a run without being a bug (a non-finite loss, a lost peer).

Entry points catch :class:`UserError` (``megatronish.arguments.exit_on_config_error``; ranks of a distributed
run: ``megatronish.training.failure.run_rank``) and print one ``error: <line>`` per problem, without a traceback,
and exit 2 (:data:`EXIT_USER_ERROR`). Everything else is a bug and keeps its traceback (exit 1).

Exit codes (docs/reliability.md): 0 done, 1 a bug (traceback), 2 bad user input, 3 a non-finite loss or
gradient (``--check-for-nan-in-loss-and-grad``), 4 a peer rank or the job's store is gone (the rank watchdog,
``megatronish.training.watchdog``), 5 a rank computes wrong results (``--rerun-mode validate_results``,
``megatronish.training.rerun``).

:class:`CommandLineParser` is the ``argparse`` parser of every entry point: a command-line mistake is one
``error:`` line (an unknown flag names the closest known one) and exit 2, like every other user error.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys

__all__ = ["UserError", "ConfigError", "CheckpointError", "TokenizerError", "BlendError", "IndexedDatasetError",
           "ConvertError", "TrainingFailure", "NonFiniteError", "FaultyRankError", "EXIT_BUG", "EXIT_USER_ERROR",
           "EXIT_NON_FINITE", "EXIT_PEER_LOST", "EXIT_FAULTY_RANK", "CommandLineParser"]

EXIT_BUG = 1
EXIT_USER_ERROR = 2
EXIT_NON_FINITE = 3
EXIT_PEER_LOST = 4
EXIT_FAULTY_RANK = 5


class UserError(Exception):
    """A problem with the user's input; the message names the flag, file or setting and the fix, one line each."""

    exit_code = EXIT_USER_ERROR


class ConfigError(ValueError, UserError):
    """A user configuration error; the message names the flag and the fix."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: one line naming the file or field and the fix."""


class ConvertError(ConfigError):
    """A checkpoint that cannot be converted; the message names the file or setting and the fix."""


class TokenizerError(ValueError, UserError):
    """A tokenizer file that is missing or malformed, or a tokenizer flag that is wrong."""


class BlendError(ValueError, UserError):
    """A --data-path / --split value that cannot be used."""


class IndexedDatasetError(ValueError, UserError):
    """A .bin/.idx pair that is missing, truncated, or not in the indexed dataset format."""


class TrainingFailure(Exception):
    """A run that cannot go on though nothing in the program is wrong: reported as one ``error:`` line (no
    traceback) with its own exit code."""

    exit_code = EXIT_BUG


class NonFiniteError(TrainingFailure):
    """``--check-for-nan-in-loss-and-grad``: a NaN/Inf loss or gradient; the message names the iteration, the
    rank(s) and the first parameter with a non-finite gradient."""

    exit_code = EXIT_NON_FINITE


class FaultyRankError(TrainingFailure):
    """``--rerun-mode validate_results``: a wrong result that came back when its iteration was rerun on the same
    ranks but not when other ranks computed the same micro-batches; the message names the rank and its host."""

    exit_code = EXIT_FAULTY_RANK


class CommandLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one ``error:`` line plus a hint, exit status 2; a flag it does not know names the
    closest known one (``did you mean --hidden-size?``), also when the error is about another flag (a misspelt
    required flag is reported as the missing one)."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if os.environ.get("LOCAL_RANK", "0") != "0":  # every process of a node parsed the same line: one says it
            self.exit(EXIT_USER_ERROR)
        self.exit(EXIT_USER_ERROR, f"error: {message}{self.closest_flags()}\n"
                                   "(run with --help for the list of flags)\n")

    def closest_flags(self) -> str:
        """``; did you mean --x?`` for the unknown flags of the last parsed command line that are close to a known
        one ("" if none)."""
        known = [s for s in self._option_string_actions if s.startswith("--")]
        hints = []
        for token in getattr(self, "_argv", []):
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if not flag.startswith("--") or flag in self._option_string_actions \
                    or (self.allow_abbrev and any(k.startswith(flag) for k in known)):
                continue
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                hints.append((flag, close[0]))
        if not hints:
            return ""
        if len(hints) == 1:
            return f"; did you mean {hints[0][1]}?"
        return "; did you mean " + ", ".join(f"{match} (for {flag})" for flag, match in hints) + "?"
