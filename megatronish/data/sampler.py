"""Batch samplers driven by the number of samples consumed so far, so a resumed run continues
exactly where it stopped (``--dataloader-type single|cyclic``)."""
from __future__ import annotations

from typing import Iterator, List

import numpy
import torch

__all__ = ["MegatronPretrainingSampler", "MegatronPretrainingRandomSampler", "build_pretraining_data_loader"]


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
           allow_consumed_past_end: bool) -> None:
    if total_samples <= 0:
        raise ValueError(f"no samples to iterate (total_samples={total_samples})")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is outside data-parallel size {dp_size}")
    if not allow_consumed_past_end and consumed_samples >= total_samples:
        raise ValueError(f"consumed_samples {consumed_samples} is not below total_samples {total_samples}")


class MegatronPretrainingSampler:
    """Sequential: each global chunk of ``micro_batch_size * dp_size`` samples starting at
    ``consumed_samples`` gives rank ``r`` the slice ``[r * mbs, (r + 1) * mbs)``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, False)
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


class MegatronPretrainingRandomSampler:
    """Cyclic: epoch ``e = consumed // active_total`` is a permutation seeded by ``seed + e`` of
    each rank's bucket; the consumed part of the current epoch is skipped."""

    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True,
                 seed: int = 0) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, True)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total
        current = self.consumed_samples % active_total
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            perm = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start + x for x in perm[bucket_offset:]]
        else:
            full = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            full = full // self.data_parallel_size * self.data_parallel_size
            perm = torch.randperm(full, generator=g).tolist()
            idx_range = perm[self.data_parallel_rank::self.data_parallel_size][current // self.data_parallel_size:]
        batch: List[int] = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 2, seed: int = 0,
                                  drop_last: bool = True):
    """A DataLoader over ``dataset`` resuming at ``consumed_samples`` (None if dataset is None)."""
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size, drop_last)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples, micro_batch_size,
                                                   data_parallel_rank, data_parallel_size, seed=seed)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use single or cyclic")
    kwargs = {}
    if num_workers > 0:
        kwargs = {"multiprocessing_context": "fork", "persistent_workers": True}
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=False, **kwargs)
