"""The training and evaluation micro-batches: a dataset's reader, the micro-batches of one global batch, the
``--num-workers`` loader reading ahead, and one iterator per model chunk for the schedule."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..data.loader import MicroBatchLoader
from ..data.mock import MockGPTDataset
from ..data.sampler import collate, global_batch_indices
from . import watchdog

if TYPE_CHECKING:
    from ..parallel.context import ParallelContext
    from .state import TrainContext, TrainState

__all__ = ["batch_reader", "microbatches", "train_loader", "data_iterators", "model_arg"]


def batch_reader(dataset):
    """``read(indices) -> micro-batch`` (a dict of CPU tensors) for ``dataset``."""
    if isinstance(dataset, MockGPTDataset):
        return lambda idx: collate([{k: torch.as_tensor(v) for k, v in dataset[i].items()} for i in idx])
    from ..data.gpt_dataset import get_batch  # file data only: mock runs do not load the compiled helpers

    # file data: the micro-batch read at once (each document span copied once; same samples, same order)
    return functools.partial(get_batch, dataset)


def microbatches(dataset, consumed: int, mbs: int, num_mb: int, dev, parallel: ParallelContext,
                 dp_rank: int | None = None):
    """This data-parallel replica's micro-batches of the global batch at ``consumed`` (``dp_rank``: another
    replica's, as a rerun on other ranks reads them)."""
    read = batch_reader(dataset)
    dp_rank = parallel.dp_rank if dp_rank is None else dp_rank
    # CP ranks of one data-parallel replica read the same samples (each keeps its chunks of the sequence)
    for idx in global_batch_indices(consumed, mbs, parallel.dp_size, dp_rank, num_mb):
        yield {k: v.to(dev) for k, v in read(idx).items()}


def train_loader(run: TrainContext, state: TrainState, train_iters: int) -> MicroBatchLoader:
    """``--num-workers`` worker processes reading the training micro-batches ahead, from the consumed samples on
    (the same batches for every worker count; under ``--rampup-batch-size`` each iteration's ramped batch)."""
    cfg = run.cfg
    return MicroBatchLoader(batch_reader(run.train_ds), consumed=state.consumed_samples,
                            micro_batch_size=cfg.train.micro_batch_size, dp_size=run.parallel.dp_size,
                            dp_rank=run.parallel.dp_rank, global_batch_size=cfg.global_batch_size_at,
                            iterations=max(0, train_iters - state.iteration), num_workers=cfg.data.num_workers,
                            pin_memory=run.device.type == "cuda", timer=run.timers("batch-generator"),
                            worker_init=watchdog.data_worker_init)


def data_iterators(run: TrainContext, dataset, consumed: int, num_microbatches: int | None = None,
                   batches: list[dict] | None = None):
    """One iterator over this iteration's microbatches per model chunk (each chunk reads them in order): read
    here, or ``batches`` read ahead by the loader."""
    cfg = run.cfg
    num_mb = cfg.num_microbatches if num_microbatches is None else num_microbatches
    if batches is not None:
        on_device = [{k: v.to(run.device, non_blocking=True) for k, v in b.items()} for b in batches]
        its = [iter(on_device) for _ in run.chunks]
    else:
        its = [microbatches(dataset, consumed, cfg.train.micro_batch_size, num_mb, run.device, run.parallel)
               for _ in run.chunks]
    return its[0] if len(its) == 1 else its


def model_arg(run: TrainContext):
    """The schedule's model argument: the one chunk, or the list of virtual-pipeline chunks."""
    return run.chunks if len(run.chunks) > 1 else run.chunks[0]
