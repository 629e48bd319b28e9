"""Which attempt of a restarted job this process belongs to, agreed by every rank through the job's store
(docs/reliability.md, "Restart instead of a lost job").

Under ``torchrun --max-restarts N`` a failed worker makes the agents stop every worker and start them all again.
The agents keep one TCP store for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``), so what the failed
attempt's processes wrote is still there when the new ones start: torch's process-group set-up would read the
addresses of the previous attempt's (dead) processes (gloo: "connection refused", or a wait until the timeout),
and the rank watchdog would read the old attempt's failure record and stop the new attempt at once.
``TORCHELASTIC_RESTART_COUNT`` does not name the attempt either: each node's agent counts its own restarts (an
agent that stops its workers because another node's failed does not count one).

So the ranks agree on an attempt number before ``init_process_group``. Rank 0 (one process per attempt: a new
attempt starts only after every process of the last one was stopped) takes the next number from a counter in the
store and hands it to every rank under that rank's token, a random key only the new process knows, so nothing
left by an earlier attempt can answer it. A rank's greeting that rank 0 reads may still be the previous process's
(one that died before greeting): rank 0 reads the greetings again until every rank has taken the number. The
process group's keys then live under ``megatronish/attempt_<n>/`` and the watchdog's under ``megatronish/<n>/``.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["uses_agent_store", "join_attempt", "attempt_store"]

_KEYS = "megatronish/join/"
_POLL_S = 0.01
_REREAD_S = 0.5  # rank 0 reads the greetings again after this long without every rank joined


def uses_agent_store() -> bool:
    """Whether the job's store outlives the workers (torchrun's agent hosts it), so restarts share it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def join_attempt(store, rank: int, world_size: int, timeout_s: float) -> int:
    """This job attempt's number (0 for the first), the same on every rank; every rank calls it once, before the
    process group exists. Raises ``RuntimeError`` when not every rank arrives within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
        store.set(f"{_KEYS}hello/{rank}", token)
        store.wait([f"{_KEYS}of/{token}"], timedelta(seconds=timeout_s))
        n = int(store.get(f"{_KEYS}of/{token}").decode())
        store.add(f"{_KEYS}{n}/joined", 1)
        return n - 1
    n = store.add(f"{_KEYS}attempts", 1)
    greetings = [f"{_KEYS}hello/{q}" for q in range(1, world_size)]
    handed: set[str] = set()
    while greetings:
        store.wait(greetings, timedelta(seconds=max(1.0, deadline - time.monotonic())))
        new = [t for t in (v.decode() for v in store.multi_get(greetings)) if t not in handed]
        if new:
            store.multi_set([f"{_KEYS}of/{t}" for t in new], [str(n)] * len(new))
            handed.update(new)
        reread = time.monotonic() + _REREAD_S
        while store.add(f"{_KEYS}{n}/joined", 0) < world_size - 1 and time.monotonic() < reread:
            time.sleep(_POLL_S)
        joined = store.add(f"{_KEYS}{n}/joined", 0)
        if joined == world_size - 1:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {joined + 1} of {world_size} ranks joined attempt {n - 1} of the job within "
                               f"{timeout_s:.0f} s")
    return n - 1


def attempt_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta):
    """``(attempt, store)``: a client of the agent's store and the attempt number agreed on it; ``store`` is scoped
    to the attempt, for ``init_process_group(store=...)``."""
    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    attempt = join_attempt(client, rank, world_size, timeout.total_seconds())
    return attempt, dist.PrefixStore(f"megatronish/attempt_{attempt}/", client)
