"""``--num-workers``: the training micro-batches read by worker processes with prefetch (a
``torch.utils.data.DataLoader`` over micro-batch index lists), in Megatron's sample order.

The order comes from the indices alone (:func:`~megatronish.data.sampler.global_batch_indices` from the consumed
sample count), and every micro-batch is read from its indices the same way in a worker or in the training process,
so the batches are identical for every worker count, and a resumed run (a new loader at the checkpoint's consumed
samples) continues exactly. ``num_workers=0`` reads in the training process, one micro-batch at a time. Under
``--rampup-batch-size`` the global batch size is a function of the consumed samples: each iteration's micro-batch
count follows it (``global_batch_size`` given as that function).

A user error raised in a worker (a damaged ``.bin``) is raised again in the training process as itself (one
``error:`` line), not as the loader's wrapped traceback.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import UserError
from .sampler import global_batch_indices

__all__ = ["MicroBatchLoader"]


class _Failed:
    """A user error from a worker, carried back as data."""

    def __init__(self, err: UserError):
        self.err = err


class _Reader(Dataset):
    def __init__(self, read: Callable[[list[int]], dict]):
        self.read = read

    def __getitem__(self, idx):
        try:
            return self.read(list(idx))
        except UserError as e:
            return _Failed(e)

    def __len__(self) -> int:  # unused: the sampler drives the loader
        raise TypeError("the micro-batch reader has no length")


class _IndexLists(Sampler):
    def __init__(self, consumed: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                 batch_size_at: Callable[[int], int], iterations: int):
        self.args = (micro_batch_size, dp_size, dp_rank)
        self.consumed, self.batch_size_at, self.iterations = consumed, batch_size_at, iterations

    def steps(self) -> Iterator[tuple[int, int]]:
        """``(consumed samples, micro-batches on this rank)`` of each iteration, in order."""
        consumed, per_step = self.consumed, self.args[0] * self.args[1]
        for _ in range(self.iterations):
            gbs = self.batch_size_at(consumed)
            yield consumed, gbs // per_step
            consumed += gbs

    def __iter__(self) -> Iterator[list[int]]:
        for consumed, num_microbatches in self.steps():
            yield from global_batch_indices(consumed, *self.args, num_microbatches)

    def __len__(self) -> int:
        return sum(n for _, n in self.steps())


class MicroBatchLoader:
    """The micro-batches of ``iterations`` training iterations from ``consumed`` samples on; :meth:`next_iteration`
    returns one iteration's batches (dicts of CPU tensors): the global batch over micro-batch size times DP size of
    them, ``global_batch_size`` being a number or a function of the consumed samples (a ramp).
    ``worker_init(worker_id)`` runs first in each worker process."""

    def __init__(self, read: Callable[[list[int]], dict], *, consumed: int, micro_batch_size: int, dp_size: int,
                 dp_rank: int, global_batch_size: int | Callable[[int], int], iterations: int,
                 num_workers: int, pin_memory: bool = False, timer=None,
                 worker_init: Callable[[int], None] | None = None):
        self.timer = timer
        batch_size_at = global_batch_size if callable(global_batch_size) else (lambda consumed: global_batch_size)
        sampler = _IndexLists(consumed, micro_batch_size, dp_size, dp_rank, batch_size_at, iterations)
        self._steps = sampler.steps()
        # its own generator: the loader's seed draw must not advance the training RNG (dropout after a resume)
        kw = dict(num_workers=num_workers, batch_size=None, sampler=sampler, pin_memory=pin_memory,
                  generator=torch.Generator().manual_seed(0))
        if num_workers > 0:
            kw.update(prefetch_factor=2, persistent_workers=False, worker_init_fn=worker_init)
        self._it = iter(DataLoader(_Reader(read), **kw)) if iterations > 0 else iter(())

    def next_iteration(self) -> list[dict]:
        out = []
        _, num_microbatches = next(self._steps)
        for _ in range(num_microbatches):
            if self.timer is not None:
                self.timer.start()
            batch = next(self._it)
            if self.timer is not None:
                self.timer.stop()
            if isinstance(batch, _Failed):
                raise batch.err
            out.append(batch)
        return out

    def close(self) -> None:
        """Stop the worker processes."""
        self._it = iter(())
