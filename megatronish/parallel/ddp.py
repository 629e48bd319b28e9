"""Data parallelism: contiguous gradient buffers cut into buckets, each reduced over the DP group.

Layout follows Megatron's DDP: parameters are laid out in reverse order (roughly the order backward produces
their gradients) in one fp32 buffer; ``param.main_grad`` is that parameter's view. A hook after gradient
accumulation adds ``param.grad`` into ``main_grad`` (and frees ``param.grad``). With ``overlap_grad_reduce``
a bucket's all-reduce starts as soon as all of its parameters have their gradient for the last microbatch;
otherwise everything is reduced in :meth:`finish_grad_sync`. During accumulation microbatches (inside
:meth:`no_sync`) nothing is reduced. Gradients are pre-divided by the DP size and summed (an average).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import groups


@dataclass
class _Bucket:
    params: list
    buffer: torch.Tensor  # view of the contiguous grad buffer
    ready: set = field(default_factory=set)
    work: object = None


def default_bucket_size(dp_size: int, overlap: bool) -> int | None:
    """Megatron's default: ``max(40M, 1M * dp)`` elements with overlap, else one bucket (None)."""
    return max(40_000_000, 1_000_000 * dp_size) if overlap else None


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; ``forward`` is the module's. See the module docstring for the protocol."""

    def __init__(self, module: nn.Module, *, dp_group=None, overlap_grad_reduce: bool = False,
                 bucket_size: int | None = None, grad_dtype=torch.float32):
        super().__init__()
        self.module = module
        self.dp_group = dp_group if dp_group is not None else (
            groups.get_data_parallel_group(with_context_parallel=True) if groups.is_initialized() else None)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        if bucket_size is None:
            bucket_size = default_bucket_size(self.dp_size, overlap_grad_reduce)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # backprop order
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        offset, start, current = 0, 0, []
        for i, p in enumerate(params):
            p.main_grad = self.grad_buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            current.append(p)
            if (bucket_size is not None and offset - start >= bucket_size) or i == len(params) - 1:
                bucket = _Bucket(current, self.grad_buffer[start:offset])
                self.buckets.append(bucket)
                for q in current:
                    self._bucket_of[id(q)] = bucket
                start, current = offset, []
        self._sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        """Pipeline stages after the first take their input from the previous stage."""
        self.module.set_input_tensor(tensor)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if not (self.overlap_grad_reduce and self._sync_enabled):
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.work is not None or self.dp_size == 1:
            return
        bucket.buffer.div_(self.dp_size)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.dp_group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no DP reduction), e.g. for all but the last microbatch."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all; ``main_grad`` then holds the DP average."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        for p in self.module.parameters():
            p.grad = None


def finalize_model_grads(chunks: list[DistributedDataParallel]) -> None:
    """After the last backward of an iteration: (1) DP reduction of every chunk; (2) TP all-reduce of the
    gradients of TP-replicated parameters that saw sequence-sharded activations; (3) all-reduce of the tied
    word-embedding gradient over the embedding group (first and last pipeline stage)."""
    for chunk in chunks:
        chunk.finish_grad_sync()
    if not groups.is_initialized():
        return
    from .layers import allreduce_sequence_parallel_grads

    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk.module, grad_attr="main_grad")
    emb_group = groups.get_group("embedding")
    if emb_group is not None and len(groups.get_group_ranks("embedding")) > 1:
        shared = [p for c in chunks for p in c.module.parameters() if getattr(p, "shared_embedding", False)]
        for p in shared:
            dist.all_reduce(p.main_grad, group=emb_group)
