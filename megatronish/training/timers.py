"""``--timing-log-level 0|1|2`` with Megatron's timer names, and ``--log-straggler``.

Timers (as Megatron's ``Timers`` with ``--timing-log-option minmax``): a timer whose level is above
``--timing-log-level`` is a no-op. Every log interval the elapsed times of the interval are gathered over all ranks
(one all-gather) and the last rank prints ``(min, max) time across ranks (ms):`` with one line per timer.

=====  =====================================================================================================
level  timers
=====  =====================================================================================================
0      none printed (the log line has the iteration time), as Megatron
1      ``forward-backward``, ``grads-all-reduce`` (``grads-reduce-scatter`` with the distributed optimizer),
       ``params-all-gather`` (distributed optimizer), ``optimizer``
2      ``batch-generator`` (reading the micro-batches)
=====  =====================================================================================================

``--log-straggler``: each rank's forward-backward (compute) time of the interval is gathered too; the log line
names the fastest and slowest ``--straggler-minmax-count`` ranks, and the slowest rank with its ratio to the median
when that ratio is above :data:`STRAGGLER_RATIO`.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import device
from ..parallel import comm_log as comm

__all__ = ["Timers", "STRAGGLER_RATIO", "straggler_lines", "TIMER_LEVELS"]

STRAGGLER_RATIO = 1.2
TIMER_LEVELS = {"forward-backward": 1, "grads-all-reduce": 1, "grads-reduce-scatter": 1,
                "params-all-gather": 1, "optimizer": 1, "batch-generator": 2}


class _Timer:
    def __init__(self):
        self.elapsed = 0.0
        self._start = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self.elapsed += time.perf_counter() - self._start
            self._start = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Off:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


_OFF = _Off()


class Timers:
    """``timers(name)`` is that timer (a context manager with ``start``/``stop``), or a no-op above the level.
    ``always`` names timers kept whatever the level (``forward-backward`` under ``--log-straggler``)."""

    def __init__(self, log_level: int, always: tuple[str, ...] = ()):
        self.log_level = log_level
        self.always = set(always)
        self._timers: dict[str, _Timer] = {}

    def active(self, name: str) -> bool:
        return TIMER_LEVELS[name] <= self.log_level or name in self.always

    def __call__(self, name: str):
        if not self.active(name):
            return _OFF
        return self._timers.setdefault(name, _Timer())

    def gather(self, names: list[str]) -> torch.Tensor:
        """``[world, len(names)]`` seconds of each rank's timers over the interval (collective); resets them."""
        mine = torch.tensor([self._timers[n].elapsed if n in self._timers else 0.0 for n in names],
                            dtype=torch.float64)
        for n in names:
            if n in self._timers:
                self._timers[n].elapsed = 0.0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return mine.view(1, -1)
        on = device.current_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        out = [torch.zeros_like(mine, device=on) for _ in range(world)]
        comm.all_gather(out, mine.to(on))
        return torch.stack(out).cpu()

    def min_max_string(self, times: torch.Tensor, names: list[str], normalizer: float = 1.0) -> str | None:
        """Megatron's ``(min, max) time across ranks (ms):`` block for the timers at or below the level that any
        rank ran."""
        lines = []
        for i, name in enumerate(names):
            if TIMER_LEVELS[name] > self.log_level:
                continue
            ran = [t for t in times[:, i].tolist() if t > 0.0]
            if ran:
                lo, hi = min(ran) * 1000.0 / normalizer, max(ran) * 1000.0 / normalizer
                lines.append(f"    {(name + ' ').ljust(48, '.')}: ({lo:.2f}, {hi:.2f})")
        return "(min, max) time across ranks (ms):\n" + "\n".join(lines) if lines else None

    def names(self) -> list[str]:
        """The timers every rank gathers (the same list on every rank)."""
        return [n for n in TIMER_LEVELS if self.active(n)]


def straggler_lines(per_rank: list[float], count: int = 1, threshold: float = STRAGGLER_RATIO,
                    normalizer: float = 1.0) -> tuple[str, dict]:
    """The ``--log-straggler`` line and record from each rank's compute seconds of the interval."""
    ms = [t * 1000.0 / normalizer for t in per_rank]
    order = sorted(range(len(ms)), key=lambda r: ms[r])
    median = statistics.median(ms)
    slowest = order[-1]
    ratio = ms[slowest] / median if median > 0 else float("inf")
    fast = ", ".join(f"{ms[r]:.2f}ms/{r}" for r in order[:count])
    slow = ", ".join(f"{ms[r]:.2f}ms/{r}" for r in reversed(order[-count:]))
    line = f"straggler: compute time per iteration (ms/rank) min {fast} | max {slow} | median {median:.2f}ms"
    record = {"min_rank": order[0], "max_rank": slowest, "max_over_median": ratio}
    if ratio > threshold:
        line += f" | rank {slowest} is a straggler: {ratio:.2f}x the median"
        record["straggler_rank"] = slowest
    return line, record
