"""The forked worker processes of ``megatronish-preprocess-data`` and the pipes that feed them tasks and bring
their results back in order."""
from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import queue
import threading
from typing import Dict, List, Optional

from .encoder import Encoder
from .inputs import PreprocessError, Task


def worker_main(encoder: Encoder, tasks_in, results_out) -> None:
    """A forked worker: tokenizes each task it receives — a :class:`Task` it reads and parses itself, or one the
    main process parsed, ``(out, columns)`` — and sends the result back in the order the tasks came; an exception
    goes back in place of its task's result. A second thread only receives (so the main process can always hand
    over the next task, even while this one waits to send a result); parsing stays on this thread: tiktoken
    releases the GIL for each text it encodes, and a parsing thread would make every encode wait to get it back."""
    received: queue.Queue = queue.Queue()

    def receive() -> None:
        while True:
            try:
                item = tasks_in.recv()
            except (EOFError, OSError):  # the main process is gone
                item = None
            received.put(item)
            if item is None:
                return

    threading.Thread(target=receive, name="preprocess-receive", daemon=True).start()
    while True:
        item = received.get()
        if item is None:
            return
        try:
            result = encoder.tokenize_task(*(encoder.parse_columns(item) if isinstance(item, Task) else item))
        except BaseException as err:  # handed to the main process in place of the task's result
            result = err
        results_out.send(result)


PIPE_BYTES = 1 << 20  # the pipes' kernel buffer where Linux allows it (its default, 64 KiB, is a quarter of a task)


def _pipe_bytes() -> Optional[int]:
    """:data:`PIPE_BYTES`, or the system's maximum if that is less; None where pipes cannot be resized (not Linux)."""
    try:
        import fcntl
    except ImportError:
        return None
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return None
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            return min(PIPE_BYTES, int(f.read()))
    except (OSError, ValueError):
        return None


def _widen(conn, size: Optional[int]) -> None:
    """Give the pipe under ``conn`` a kernel buffer of ``size`` bytes (:func:`_pipe_bytes`; None, or a refusal,
    leaves it as it is). A worker's result (a chunk's token array) then fits in the pipe whole: the worker sends it
    and goes on encoding while the main process is still parsing the next chunk, instead of waiting in its send
    until the main process reads."""
    if size is not None:
        import fcntl

        try:
            fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
        except OSError:
            pass


class Workers:
    """``n`` forked worker processes, each with a task pipe and a result pipe; task ``i`` goes to the worker with
    the fewest tasks whose results are still unread (ties: in turn, from worker ``i % n``), and its result is read
    back from that worker in task order (no pool threads in this process). A worker on a slower core (another
    process on it, a busy host) is then handed fewer tasks instead of holding the others up by a fixed share."""

    def __init__(self, encoder: Encoder, n: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.procs, self.tasks, self.results = [], [], []
        pipe_bytes = _pipe_bytes()
        for _ in range(n):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            _widen(task_w, pipe_bytes)
            _widen(res_w, pipe_bytes)
            proc = ctx.Process(target=worker_main, args=(encoder, task_r, res_w), daemon=True)
            proc.start()
            task_r.close()
            res_w.close()
            self.procs.append(proc)
            self.tasks.append(task_w)
            self.results.append(res_r)
        self.ready: List[collections.deque] = [collections.deque() for _ in range(n)]  # results read, in order
        self.dead: set = set()
        self.unread = [0] * n  # per worker: tasks sent whose results have not been read yet
        self.worker_of: Dict[int, int] = {}  # task -> the worker it went to, until its result is taken

    def send(self, i: int, item) -> None:
        """Task ``i``: a :class:`Task`, or what :meth:`Encoder.parse_columns` made of it. The results that have
        arrived are read first, so the counts are those of now."""
        n = len(self.procs)
        if n > 1:
            self._read_arrived(timeout=0)
        live = [k for k in range(n) if k not in self.dead] or [0]  # none left: the send below reports it
        w = min(live, key=lambda k: (self.unread[k], (k - i) % n))
        self.worker_of[i] = w
        self.unread[w] += 1
        try:
            self.tasks[w].send(item)
        except OSError:  # the worker is gone (its end of the pipe is closed)
            self.procs[w].join(1)
            raise self._died(w) from None

    def receive(self, i: int) -> dict:
        """Task ``i``'s result. While it waits, every other worker's finished results are read too (and kept for
        their turn): a worker that is ahead never stops in its send for want of a reader."""
        w = self.worker_of.pop(i)
        while not self.ready[w]:
            self._read_arrived(timeout=None)
        res = self.ready[w].popleft()
        if isinstance(res, BaseException):
            raise res
        return res

    def _read_arrived(self, timeout: Optional[float]) -> None:
        """Read every result that has arrived, kept for its turn, waiting up to ``timeout`` seconds for one (None:
        until one arrives). A worker that died leaves its error in its place."""
        waiting = [conn for k, conn in enumerate(self.results) if k not in self.dead]
        for conn in multiprocessing.connection.wait(waiting, timeout):
            k = self.results.index(conn)
            try:
                self.ready[k].append(conn.recv())
                self.unread[k] -= 1
            except EOFError:
                self.dead.add(k)
                self.procs[k].join(1)
                self.ready[k].append(self._died(k))

    def _died(self, k: int) -> PreprocessError:
        return PreprocessError(f"a tokenizer worker process died (exit code {self.procs[k].exitcode}); nothing was "
                               "written")

    def close(self, finished: bool) -> None:
        """``finished``: every result was read, the workers wait for their next task and exit on None; else
        they are stopped (they may be blocked sending results nobody reads)."""
        for conn in self.tasks:
            if finished:
                conn.send(None)
            conn.close()
        for proc in self.procs:
            if not finished:
                proc.terminate()
            proc.join()
        for conn in self.results:
            conn.close()
