"""Megatron's pretraining sample order, driven by the number of samples consumed so far, so a resumed run
continues exactly where it stopped; and ``collate`` for the samples' dicts."""
from __future__ import annotations

from typing import Iterator, List

import torch

__all__ = ["MegatronPretrainingSampler", "collate", "global_batch_indices"]


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no samples to iterate (total_samples={total_samples})")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is outside data-parallel size {dp_size}")
    if consumed_samples >= total_samples:
        raise ValueError(f"consumed_samples {consumed_samples} is not below total_samples {total_samples}")


class MegatronPretrainingSampler:
    """Sequential: each global chunk of ``micro_batch_size * dp_size`` samples starting at
    ``consumed_samples`` gives rank ``r`` the slice ``[r * mbs, (r + 1) * mbs)``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                s, e = self._slice()
                yield batch[s:e]
                batch = []
        if batch and not self.drop_last:
            s, e = self._slice()
            yield batch[s:e]


def global_batch_indices(consumed_samples: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                         num_microbatches: int) -> list[list[int]]:
    """One iteration of :class:`MegatronPretrainingSampler`'s order, with no dataset length: each step of
    ``micro_batch_size * dp`` consecutive samples is split into DP slices; returns this rank's sample indices for
    each microbatch of the iteration (what the training loop reads)."""
    out = []
    for m in range(num_microbatches):
        base = consumed_samples + m * micro_batch_size * dp_size + dp_rank * micro_batch_size
        out.append(list(range(base, base + micro_batch_size)))
    return out


def collate(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
