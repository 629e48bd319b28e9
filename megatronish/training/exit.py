"""When training saves and when it stops: ``--save-interval``, ``--exit-interval``, ``--exit-duration-in-mins`` and
the exit signal (``--exit-signal-handler``, :mod:`megatronish.training.signals`). The checkpointer only saves
and loads; this policy decides, at the end of every iteration, whether to call it and whether to exit."""
from __future__ import annotations

import time

import torch.distributed as dist

from .signals import DistributedSignalHandler, any_rank

__all__ = ["ExitPolicy"]


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class ExitPolicy:
    """Built once per run from the :class:`~megatronish.config.CheckpointConfig`; installs the signal handler
    (released by :meth:`release`)."""

    def __init__(self, ck_cfg):
        self.ck = ck_cfg
        self.start_time = time.time()
        self.signal_handler = DistributedSignalHandler(ck_cfg.exit_signal).install() \
            if ck_cfg.exit_signal_handler else None

    def after_iteration(self, state, checkpointer) -> str | None:
        """Called by every rank after each iteration: surface async-save errors, save at ``--save-interval``,
        and decide (together) whether to exit. Returns the exit reason, or None to continue."""
        ck = self.ck
        checkpointer.poll()
        if self.signal_handler is not None and self.signal_handler.signals_received():
            if ck.save:
                checkpointer.save(state)
            _log(f"exiting program after receiving {ck.exit_signal} at iteration {state.iteration}")
            return "signal"
        saved = False
        if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
            checkpointer.save(state)
            saved = True
        if ck.exit_duration_in_mins:
            minutes = (time.time() - self.start_time) / 60.0
            if any_rank(minutes > ck.exit_duration_in_mins):
                if ck.save and not saved:
                    checkpointer.save(state)
                _log(f"exiting program after {minutes:.2f} minutes at iteration {state.iteration}")
                return "duration"
        if ck.exit_interval and state.iteration % ck.exit_interval == 0:
            if ck.save and not saved:
                checkpointer.save(state)
            _log(f"exiting program at iteration {state.iteration}")
            return "interval"
        return None

    def release(self) -> None:
        if self.signal_handler is not None:
            self.signal_handler.release()
