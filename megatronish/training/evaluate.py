"""Evaluation: the validation loss over ``--eval-iters`` global batches, or the test split's at the end."""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from .. import device
from .batches import data_iterators, model_arg
from .step import loss_sums

if TYPE_CHECKING:
    from .state import TrainContext, TrainState

__all__ = ["evaluate"]


def evaluate(run: TrainContext, state: TrainState, dataset=None, details: dict | None = None) -> float:
    """Validation loss over ``--eval-iters`` global batches: token losses summed over all of them divided by
    their loss tokens (Megatron's); evaluations continue through the validation set. Another ``dataset`` (the test
    split) is read from its start. With ``--mtp-num-layers``, ``details["mtp"]`` (when ``details`` is given) gets
    each multi-token-prediction depth's loss, ``{"mtp_<k> loss": value}``, reduced the same way (as training
    reports them)."""
    t = run.cfg.train
    test = dataset is not None
    dataset = run.valid_ds if dataset is None else dataset
    keys = ["lm loss"] + [f"mtp_{k} loss" for k in range(1, (run.cfg.model.mtp_num_layers or 0) + 1)]
    gc_around = t.manual_gc and t.manual_gc_eval
    if gc_around:
        gc.collect()
    for c in run.chunks:
        c.eval()
    sums = None
    with torch.no_grad():
        for i in range(t.eval_iters):
            it = data_iterators(run, dataset, i * t.global_batch_size if test else state.valid_consumed_samples)
            if not test:
                state.valid_consumed_samples += t.global_batch_size
            stats = run.schedule(run.forward_step, it, model_arg(run), run.cfg.num_microbatches,
                                 forward_only=True)
            batch = torch.stack([loss_sums(stats, run.parallel, key) for key in keys])  # [keys, 2]: sum, tokens
            sums = batch if sums is None else sums + batch
            if t.empty_unused_memory_level >= 1:
                device.empty_cache()
    for c in run.chunks:
        c.train()
    if gc_around:
        gc.collect()
    losses = [float("nan")] * len(keys) if sums is None else [total / max(tokens, 1.0) for total, tokens in
                                                              sums.tolist()]
    if details is not None and len(keys) > 1:
        details["mtp"] = dict(zip(keys[1:], losses[1:]))
    return losses[0]
