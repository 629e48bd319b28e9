"""How a training process ends when something goes wrong (docs/reliability.md).

:func:`run_rank` wraps the work of one rank. A failure becomes one ``error:`` line printed once for the whole job
and an exit code, and the other ranks stop within seconds (through :mod:`megatronish.training.watchdog`)
instead of waiting in a collective until ``--distributed-timeout-minutes``:

- :class:`~megatronish.errors.UserError` (a flag, data file, tokenizer file, checkpoint, blend): its lines, from
  the lowest rank that saw it (prefixed ``rank N:`` when not rank 0), no traceback, exit 2.
- :class:`~megatronish.errors.TrainingFailure` (a non-finite loss or gradient, a lost peer): its line, exit 3/4.
- a collective that failed (a timeout, a mismatch) while every rank is alive: every rank's ring of collectives
  (:mod:`megatronish.parallel.comm_log`, gathered through the watchdogs) names the collective and the first rank
  that is elsewhere, in one line; every rank exits 4 and the rings go to ``collectives-<attempt>.json`` in
  ``report_dir``.
- a communication error caused by a peer that is gone: no traceback once the watchdog has recorded the cause
  (its line names that peer); a communication error with neither a recorded cause nor a rank elsewhere keeps its
  traceback.
- anything else is a bug: its traceback, exit 1.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable, TypeVar

import torch.distributed as dist

from ..errors import EXIT_BUG, EXIT_PEER_LOST, TrainingFailure, UserError
from ..parallel import comm_log
from .watchdog import RankWatchdog, Watch

__all__ = ["run_rank", "is_peer_failure"]

T = TypeVar("T")

_PEER_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
               "socket timeout", "timed out", "communicator was aborted", "read error", "failed to recv",
               "failed to send", "doesn't match expected size", "mismatch")
# what ended a collective, for its line: (mark in the error text, the words)
_CAUSES = (("timed out", "timed out"), ("doesn't match", "size mismatch"), ("mismatch", "mismatch"),
           ("closed by peer", "connection closed by a peer"), ("reset by peer", "connection reset by a peer"))


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
    wd.leave()
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


def _cause(err: BaseException) -> str:
    text = str(err).lower()
    return next((words for mark, words in _CAUSES if mark in text), _lines(err)[0][:120])


def _write_rings(report_dir: str | None, rings: dict, line: str, attempt: int) -> str:
    """Every rank's ring in one JSON file; its path (or why it could not be written)."""
    path = os.path.join(report_dir or ".", f"collectives-{attempt}.json")
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"error": line, "ranks": {str(q): ring for q, ring in sorted(rings.items())}}, f, indent=1)
    except OSError as e:
        return f"{path} could not be written ({e.strerror or e})"
    return path


def _diagnose_collective(wd, err: BaseException, report_dir: str | None, deadline: float):
    """A collective failed on this rank: gather every rank's ring (the watchdogs publish them), find the
    collective and the first rank that is elsewhere, record that line for the job, print it once and end every
    rank with exit 4. Returns another rank's recorded failure instead if one comes first, or None when a ring
    never arrives (a lost rank) or every rank got to every collective in question."""
    try:
        wd.ring_state = ("failed", _cause(err))
        wd.publish_ring()
        wd.request_rings()
        while True:
            found = wd.failure()
            rings = None if found is not None else wd.rings()
            if found is not None or rings is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except (RuntimeError, dist.DistError) as e:  # the store's host is gone: the watchdog names it, ends us
        wd.store_gone(e)
    if rings is None:
        return found
    diagnosis = comm_log.diagnose(rings)
    if diagnosis is None:
        return None
    line = comm_log.format_diagnosis(diagnosis)
    try:
        should_print = wd.record_failure(EXIT_PEER_LOST, line)
    except (RuntimeError, dist.DistError):
        should_print = True
    if should_print:
        _print_error([f"{line}; every rank's collectives: {_write_rings(report_dir, rings, line, wd.attempt)}"], None)
        wd.mark_printed()
    else:
        wd.wait_printed()
    _end(EXIT_PEER_LOST, wd)


def run_rank(fn: Callable[[], T], *, watch: Watch | None = None, report_dir: str | None = None) -> T:
    """Run one rank's work ``fn()``; on failure report it once for the job and end the process (see the
    module docstring). On success mark the rank finished for the watchdog and return ``fn()``'s result.
    ``watch``: the process's watchdog, which ``fn`` starts (None: no watchdog). ``report_dir``: where a failed
    collective's rings of every rank go (default: the current directory)."""
    watch = watch or Watch()
    try:
        result = fn()
    except (UserError, TrainingFailure) as err:
        _fail(err.exit_code, _lines(err), None, watch.watchdog)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: B036 - a rank that dies must tell the others
        wd = watch.watchdog
        if wd is not None and is_peer_failure(err):
            wd.reporting = True
            deadline = time.monotonic() + wd.timeout + 5 * wd.interval
            found = _diagnose_collective(wd, err, report_dir, deadline)
            if found is None:
                found = _wait_for_recorded(wd, deadline - time.monotonic())
            if found is not None:  # the rank that saw the cause prints it
                wd.wait_printed()
                _end(found[0], wd)
        _fail(EXIT_BUG, None, traceback.format_exc(), wd)
    if watch.watchdog is not None:
        watch.watchdog.finish()
    return result


def _fail(code: int, lines: list[str] | None, tb: str | None, wd: RankWatchdog | None) -> None:
    """Record the failure for the job, print it once (a traceback: on every rank that had one), end."""
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
