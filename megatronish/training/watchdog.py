"""The rank watchdog: a daemon thread per training process that makes a failure anywhere end the whole job
promptly, with one line naming what failed (docs/reliability.md).

It talks to the job's TCP store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent store, or the store rank 0 hosts
under a per-task launch such as ``srun``) over its own client connection, so a main thread blocked in a
collective or a store call never blocks it. Keys live under ``megatronish/<attempt>/`` (the job's attempt,
``training/attempt.py``: a restarted job never reads an earlier attempt's failure record):

- ``hb/<rank>``: a counter the rank increments every ``interval`` seconds; ``done`` once it finished cleanly.
- ``proc/<rank>``: ``host pid``, so a watcher on the same host sees a dead process at once.
- ``failed`` (a counter), ``failure`` (the first failure's line), ``exit_code``, ``printer``: the first rank to
  report a failure records it; every watchdog polls ``failed`` and ends its process with that exit code.
- ``rings`` (a counter) and ``ring/<rank>``: a rank whose collective failed asks for every rank's ring of
  collectives (:mod:`megatronish.parallel.comm_log`); each watchdog polls ``rings`` and publishes its process's
  ring, so a rank whose main thread is blocked in another collective still answers. A rank that finishes publishes
  its ring too, before ``done``.

Each rank watches one peer, the next rank in a ring (rank ``r`` watches ``r + 1 mod N``), so the store sees O(N)
requests per interval at any scale. A watched peer is lost when its process is gone (same host) or its counter has
not moved for ``timeout`` seconds; the watcher records the failure, prints one line, and every rank exits with
:data:`~megatronish.errors.EXIT_PEER_LOST`. A store that stops answering means its host is gone: the launcher
(agent store) or rank 0 (per-task launch).

The launcher: under torchrun or Slurm each worker asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``) and also checks its parent pid every interval, so workers whose launcher was killed stop
at once, before writing anything further.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import EXIT_PEER_LOST
from ..parallel import comm_log

__all__ = ["RankWatchdog", "Watch", "start", "launched_by_launcher", "set_parent_death_signal", "data_worker_init"]

_PR_SET_PDEATHSIG = 1
DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 45.0  # seconds without a heartbeat from another host before its rank counts as lost

def launched_by_launcher() -> bool:
    """Whether a launcher process (torchrun's agent, Slurm's step daemon) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_STEP_ID" in os.environ


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel (Linux) to send ``sig`` to this process when its parent dies. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def data_worker_init(_worker_id: int) -> None:
    """In a ``--num-workers`` data loader process: the exit signals (SIGTERM, SIGINT, SIGUSR1/2, which a scheduler
    sends to every process of a job step) are the training process's to handle, so the worker ignores them; it
    dies with the training process instead (parent-death signal)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    set_parent_death_signal()


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its launcher) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class RankWatchdog:
    """See the module docstring. ``start()`` once per process after ``init_process_group``."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, *, interval: float = DEFAULT_INTERVAL,
                 timeout: float = DEFAULT_TIMEOUT, watch_launcher: bool = False, attempt: int = 0):
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.interval, self.timeout = interval, timeout
        self.watch_launcher = watch_launcher
        self.parent = os.getppid()
        self.store_host = "the launcher" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
        self.hostname = socket.gethostname()
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(5.0, 4 * interval)),
                               wait_for_workers=False)
        self.store = dist.PrefixStore(f"megatronish/{attempt}/", client)
        self.lock = threading.Lock()  # one request at a time on the client (the thread and the main thread)
        self.reporting = False  # this rank is reporting its own failure: do not end it from the thread
        self.finished = False
        self._stop = threading.Event()
        self._beats = 0
        self._peer = (rank + 1) % world_size if world_size > 1 else None
        self._peer_proc: tuple[str, int] | None = None
        self._peer_seen = (None, time.monotonic())  # (last counter, when it changed)
        self._store_failures = 0
        self._rings_asked = 0  # ring requests answered
        self.ring_state: tuple[str, str | None] = ("running", None)  # (state, the error) published with the ring
        self._ending = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ the store
    def _call(self, fn, *args):
        with self.lock:
            return getattr(self.store, fn)(*args)

    def start(self) -> "RankWatchdog":
        if self.watch_launcher:
            set_parent_death_signal()
            if os.getppid() != self.parent or self.parent == 1:
                self._exit_launcher_gone()
        self._call("set", f"proc/{self.rank}", f"{self.hostname} {os.getpid()}")
        self._call("set", f"hb/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="megatronish-watchdog", daemon=True)
        self._thread.start()
        return self

    def failure(self) -> tuple[int, str] | None:
        """``(exit code, line)`` of the job's first recorded failure, or None."""
        if not self._call("add", "failed", 0):
            return None
        code = int(self._call("get", "exit_code").decode() or EXIT_PEER_LOST)
        return code, self._call("get", "failure").decode()

    def record_failure(self, code: int, line: str, *, grace: float = 0.5) -> bool:
        """Record this rank's failure; True when this rank should print its line (the lowest failing rank
        within ``grace`` seconds, one printer per job)."""
        self.reporting = True
        self._call("set", f"failed/{self.rank}", line)
        if self._call("compare_set", "exit_code", "", str(code)).decode() == str(code):
            self._call("compare_set", "failure", "", line)
        self._call("add", "failed", 1)
        time.sleep(grace)
        for q in range(self.rank):
            if self._call("check", [f"failed/{q}"]):
                return False
        return self._call("compare_set", "printer", "", str(self.rank)).decode() == str(self.rank)

    def publish_ring(self) -> None:
        """Put this process's ring of collectives in the store (``ring/<rank>``), with :attr:`ring_state`."""
        state, error = self.ring_state
        self._call("set", f"ring/{self.rank}", json.dumps(comm_log.snapshot(state, error)))

    def request_rings(self) -> None:
        """Ask every rank's watchdog to publish its ring (at its next tick)."""
        self._call("add", "rings", 1)

    def rings(self) -> dict[int, dict] | None:
        """Every rank's published ring (``{rank: snapshot}``), or None until all are there."""
        keys = [f"ring/{q}" for q in range(self.world_size)]
        if not self._call("check", keys):
            return None
        return {q: json.loads(v) for q, v in enumerate(self._call("multi_get", keys))}

    def mark_printed(self) -> None:
        """The job's failure line is out: the other ranks may exit (a launcher stops the rest of the job as soon
        as one process exits, so they wait for this before exiting)."""
        try:
            self._call("set", "printed", "1")
        except (RuntimeError, dist.DistError):
            pass

    def wait_printed(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not self._call("check", ["printed"]):
                time.sleep(0.05)
        except (RuntimeError, dist.DistError):
            pass

    def leave(self) -> None:
        """This process is about to exit after the job's failure: say so. The process hosting the store (rank 0
        under a per-task launch) then waits, bounded, until every rank has said it, so that no rank's last store
        request meets a closed store."""
        try:
            left = self._call("add", "left", 1)
            if self.rank == 0 and self.store_host == "rank 0":
                deadline = time.monotonic() + max(2.0, 3 * self.interval)
                while left < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = self._call("add", "left", 0)
        except (RuntimeError, dist.DistError):
            pass

    def finish(self) -> None:
        """This rank finished cleanly: peers stop watching it. A process that hosts the store (rank 0 without
        torchrun's agent store) waits, bounded, until every rank has finished, so the store outlives their
        last requests."""
        if self.finished:
            return
        self.finished = True
        self._stop.set()
        # the thread must be out of its store call before the interpreter shuts down (a daemon thread returning
        # from C++ into a finalized interpreter aborts the process)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * max(5.0, 4 * self.interval))
        try:
            self.ring_state = ("finished", None)
            self.publish_ring()
            self._call("set", f"hb/{self.rank}", "done")
            if self.rank == 0 and self.store_host == "rank 0" and self.world_size > 1:
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline:
                    values = self._call("multi_get", [f"hb/{q}" for q in range(self.world_size)])
                    if all(v == b"done" for v in values) or self._call("add", "failed", 0):
                        break
                    time.sleep(0.2)
        except (RuntimeError, dist.DistError):
            pass

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.watch_launcher and os.getppid() != self.parent:
                self._exit_launcher_gone()
            try:
                self._tick()
                self._store_failures = 0
            except (RuntimeError, dist.DistError) as e:  # the store did not answer
                if self._stop.is_set():
                    return
                self._store_failures += 1
                if self._store_failures >= 3:
                    self.store_gone(e)

    def _tick(self) -> None:
        self._beats += 1
        self._call("set", f"hb/{self.rank}", str(self._beats))
        failed = self.failure()
        if failed is not None:
            if not self.reporting:
                self._exit(failed[0])
            return
        asked = self._call("add", "rings", 0)
        if asked > self._rings_asked:
            self._rings_asked = asked
            self.publish_ring()
        if self._peer is None:
            return
        lost = self._check_peer()
        if lost:
            self._report_lost(lost)

    def _check_peer(self) -> str | None:
        q = self._peer
        if self._peer_proc is None and self._call("check", [f"proc/{q}"]):
            host, pid = self._call("get", f"proc/{q}").decode().split()
            self._peer_proc = (host, int(pid))
        now = time.monotonic()
        beat = self._call("get", f"hb/{q}").decode() if self._call("check", [f"hb/{q}"]) else None
        if beat == "done":
            self._peer = None
            return None
        if self._peer_proc is not None and self._peer_proc[0] == self.hostname and not _pid_alive(self._peer_proc[1]):
            if self._call("check", [f"hb/{q}"]) and self._call("get", f"hb/{q}").decode() == "done":
                self._peer = None
                return None
            return f"rank {q} (pid {self._peer_proc[1]} on {self.hostname}) is gone: its process ended"
        last, since = self._peer_seen
        if beat != last:
            self._peer_seen = (beat, now)
        elif now - since > self.timeout:
            where = f" (pid {self._peer_proc[1]} on {self._peer_proc[0]})" if self._peer_proc else ""
            return f"rank {q}{where} is lost: no heartbeat for {now - since:.0f} s"
        return None

    def _report_lost(self, what: str) -> None:
        line = f"{what}; stopping every rank (seen by rank {self.rank})"
        if self.record_failure(EXIT_PEER_LOST, line, grace=0.0):
            sys.stderr.write(f"error: {line}\n")
            sys.stderr.flush()
            self.mark_printed()
        self._exit(EXIT_PEER_LOST)

    def store_gone(self, err) -> None:
        """The store stopped answering: name its host (once per job) and end this process."""
        if not self._ending.acquire(blocking=False):  # the other thread of this process is already ending it
            time.sleep(3600)
        if self.store_host == "the launcher":
            self._exit_launcher_gone()
        # rank 0 hosts the store; its watcher (the last rank) names it
        if self.rank == self.world_size - 1:
            sys.stderr.write(f"error: rank 0 is gone: the job's store on {self.store_host} stopped answering "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); stopping every "
                             f"rank (seen by rank {self.rank})\n")
        self._exit(EXIT_PEER_LOST)

    def _exit_launcher_gone(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # nothing further is written: no flush, no exit handlers

    def _exit(self, code: int) -> None:
        self.wait_printed()
        self.leave()
        _flush()
        os._exit(code)


def start(rank: int, world_size: int, *, interval: float | None = None, timeout: float | None = None,
          attempt: int = 0) -> RankWatchdog | None:
    """Start a watchdog for this process after ``init_process_group`` (``attempt``: the job's, from
    ``init_distributed``). None for a one-process run without a launcher, or without a store address."""
    launcher = launched_by_launcher()
    if world_size == 1 and not launcher:
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        if launcher:
            set_parent_death_signal()
        return None
    return RankWatchdog(rank, world_size, host, int(port),
                        interval=interval or _env_float("MEGATRONISH_WATCHDOG_INTERVAL", DEFAULT_INTERVAL),
                        timeout=timeout or _env_float("MEGATRONISH_HEARTBEAT_TIMEOUT", DEFAULT_TIMEOUT),
                        watch_launcher=launcher, attempt=attempt).start()


class Watch:
    """One process's watchdog, owned by the entry point: it makes a ``Watch`` and hands it to the run, which starts
    the watchdog once ``init_process_group`` is done (``setup``), and to ``failure.run_rank``, which reads it when
    the rank fails or finishes. A run handed none (library callers, test harnesses that exit ranks on their own
    schedule) starts no watchdog."""

    def __init__(self):
        self.watchdog: RankWatchdog | None = None  # None until started (or in a one-process run without a launcher)

    def start(self, rank: int, world_size: int, *, interval: float | None = None, timeout: float | None = None,
              attempt: int = 0) -> RankWatchdog | None:
        """Start the watchdog (once; later calls return the first)."""
        if self.watchdog is None:
            self.watchdog = start(rank, world_size, interval=interval, timeout=timeout, attempt=attempt)
        return self.watchdog
