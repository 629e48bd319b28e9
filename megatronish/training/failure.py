"""How a training process ends when something goes wrong (docs/reliability.md).

:func:`run_rank` wraps the work of one rank. A failure becomes one ``error:`` line printed once for the whole job
and an exit code, and the other ranks stop within seconds (through :mod:`megatronish.training.watchdog`)
instead of waiting in a collective until ``--distributed-timeout-minutes``:

- :class:`~megatronish.errors.UserError` (a flag, data file, tokenizer file, checkpoint, blend): its lines, from
  the lowest rank that saw it (prefixed ``rank N:`` when not rank 0), no traceback, exit 2.
- :class:`~megatronish.errors.TrainingFailure` (a non-finite loss or gradient, a lost peer): its line, exit 3/4.
- a communication error caused by a peer that is gone: no traceback once the watchdog has recorded the cause
  (its line names that peer); a communication error with no recorded cause keeps its traceback.
- anything else is a bug: its traceback, exit 1.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable, TypeVar

import torch.distributed as dist

from ..errors import EXIT_BUG, TrainingFailure, UserError
from . import watchdog

__all__ = ["run_rank", "is_peer_failure"]

T = TypeVar("T")

_PEER_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
               "socket timeout", "timed out", "communicator was aborted", "read error", "failed to recv",
               "failed to send")


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective or store call that failed because another process went away."""
    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None),
                              getattr(dist, "DistStoreError", None)) if k is not None)
    if kinds and isinstance(err, kinds):
        return True
    if isinstance(err, (RuntimeError, ConnectionError)):
        text = str(err).lower()
        return any(mark in text for mark in _PEER_MARKS)
    return False


def _lines(err: BaseException) -> list[str]:
    return str(err).splitlines() or [type(err).__name__]


def _print_error(lines: list[str], rank: int | None) -> None:
    prefix = f"rank {rank}: " if rank else ""
    sys.stderr.write("".join(f"error: {prefix}{line}\n" for line in lines))
    sys.stderr.flush()


def _end(code: int, wd) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if wd is None:
        raise SystemExit(code)
    os._exit(code)  # threads blocked in a collective (a background checkpoint write) must not hold the exit


def _wait_for_recorded(wd, seconds: float):
    deadline = time.monotonic() + seconds
    while True:
        try:
            found = wd.failure()
        except (RuntimeError, dist.DistError) as err:  # the store's host is gone: the watchdog names it, ends us
            wd.store_gone(err)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_rank(fn: Callable[[], T]) -> T:
    """Run one rank's work ``fn()``; on failure report it once for the job and end the process (see the
    module docstring). On success mark the rank finished for the watchdog and return ``fn()``'s result."""
    watchdog.enable()
    try:
        result = fn()
    except (UserError, TrainingFailure) as err:
        _fail(err.exit_code, _lines(err), None)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: B036 - a rank that dies must tell the others
        wd = watchdog.current()
        if wd is not None and is_peer_failure(err):
            wd.reporting = True
            found = _wait_for_recorded(wd, wd.timeout + 5 * wd.interval)
            if found is not None:  # the rank that saw the cause prints it
                wd.wait_printed()
                _end(found[0], wd)
        _fail(EXIT_BUG, None, traceback.format_exc())
    wd = watchdog.current()
    if wd is not None:
        wd.finish()
    return result


def _fail(code: int, lines: list[str] | None, tb: str | None) -> None:
    """Record the failure for the job, print it once (a traceback: on every rank that had one), end."""
    wd = watchdog.current()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    text = (lines or [tb.strip().splitlines()[-1]])[0]
    should_print = True
    if wd is not None:
        try:
            should_print = wd.record_failure(code, f"rank {rank}: {text}")
        except (RuntimeError, dist.DistError):  # the store is gone: say it here
            should_print = True
    elif rank is None and os.environ.get("LOCAL_RANK", "0") != "0":
        should_print = False  # before the process group: every process of a node saw the same; local rank 0 says it
    if tb is not None:
        sys.stderr.write(tb)
        sys.stderr.flush()
    elif should_print:
        _print_error(lines, rank)
    if wd is not None and (should_print or tb is not None):
        wd.mark_printed()
    elif wd is not None:  # wait for the printer: this exit makes a launcher stop the rest of the job
        wd.wait_printed()
    _end(code, wd)
