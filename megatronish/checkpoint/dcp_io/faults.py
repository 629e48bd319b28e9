"""Test hook: a rank's write of one checkpoint directory stopped half-way."""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

SAVE_FAULT_ENV = "MEGATRONISH_TEST_SAVE_FAULT"


@dataclass(frozen=True)
class WriteFault:
    """Stop a rank's write of the checkpoint directory named ``iter_dir`` half-way (after half of its items, with
    that half synced to disk): ``kind`` ``"kill"`` sends SIGKILL to the process, ``"enospc"`` raises an ENOSPC
    write error. ``rank``: only that rank's write (every rank's when None).

    Passed to :func:`~.api.save` (``fault=``); a test that starts training processes asks for one through the
    environment, ``MEGATRONISH_TEST_SAVE_FAULT=<kill|enospc>:<iteration directory name>[:<rank>]``
    (:meth:`from_environment`)."""

    kind: str
    iter_dir: str
    rank: int | None = None

    @classmethod
    def from_environment(cls) -> WriteFault | None:
        """The fault :data:`SAVE_FAULT_ENV` asks for, or None."""
        spec = os.environ.get(SAVE_FAULT_ENV)
        if not spec:
            return None
        parts = spec.split(":")
        return cls(parts[0], parts[1], int(parts[2]) if len(parts) > 2 else None)

    def applies(self, iter_dir: str, rank: int) -> bool:
        """Whether this fault stops rank ``rank``'s write of ``iter_dir``."""
        return os.path.basename(os.path.normpath(iter_dir)) == self.iter_dir and self.rank in (None, rank)

    def inject(self) -> None:
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
