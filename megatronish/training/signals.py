"""``--exit-signal-handler``: a signal (``--exit-signal``, default SIGTERM) asks every rank to finish the current
iteration, save a checkpoint and exit 0. The handler only records the signal; once per iteration all ranks
agree (MAX all-reduce), so a signal delivered to one rank stops all of them at the same iteration."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from .. import device
from ..parallel import comm_log as comm

SIGNAL_MAP = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGUSR1": signal.SIGUSR1,
              "SIGUSR2": signal.SIGUSR2}


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (a MAX all-reduce; local without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device.current_device())
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class DistributedSignalHandler:
    """Records ``sig`` while installed (a context manager, or :meth:`install` / :meth:`release`)."""

    def __init__(self, sig: str | int = "SIGTERM"):
        self.sig = SIGNAL_MAP[sig] if isinstance(sig, str) else signal.Signals(sig)
        self.received = False
        self._previous = None
        self._installed = False

    def _handler(self, signum, frame) -> None:  # signal API
        self.received = True

    def install(self) -> "DistributedSignalHandler":
        if not self._installed:
            self._previous = signal.getsignal(self.sig)
            signal.signal(self.sig, self._handler)
            self._installed = True
        return self

    def release(self) -> None:
        if self._installed:
            signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def signals_received(self) -> bool:
        """Collective: whether any rank has received the signal."""
        return any_rank(self.received)

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc) -> None:
        self.release()
