"""Data parallelism: contiguous gradient buffers cut into buckets, each reduced over the DP group.

Layout follows Megatron's DDP: parameters are laid out in reverse order (roughly the order backward produces
their gradients) in one gradient buffer; ``param.main_grad`` is that parameter's view. A hook after gradient
accumulation adds ``param.grad`` into ``main_grad`` (and frees ``param.grad``). With ``overlap_grad_reduce``
a bucket's reduction starts as soon as all of its parameters have their gradient for the last microbatch;
otherwise everything is reduced in :meth:`finish_grad_sync`. During accumulation microbatches (inside
:meth:`no_sync`) nothing is reduced. Gradients are pre-divided by the DP size and summed (an average), or only
summed with ``average=False`` (``--calculate-per-token-loss``: :func:`finalize_model_grads` then divides by the
global batch's token count).

The buffer's dtype is the gradient dtype: fp32 for fp32 models, and for 16-bit models with
``--accumulate-allreduce-grads-in-fp32`` (the default under ``--bf16``), else the parameters' dtype
(``--fp16`` without that flag, ``--bf16 --grad-reduce-in-bf16``).

With the distributed optimizer (``use_distributed_optimizer``, ZeRO-1) every bucket is padded to a multiple of
the DP size and split into DP equal, contiguous shards; the bucket is *reduce-scattered* (DP rank ``r`` then
holds the averaged gradient of shard ``r`` only; the rest of the bucket keeps local values). The parameters
also live in one contiguous buffer with the same layout (``param.data`` is a view of it), so that after the
optimizer has updated its shard every bucket is rebuilt with one all-gather (:meth:`start_param_sync`). The
shared (tied) word embedding gets a bucket of its own, so its shards coincide on the first and last pipeline
stage and the embedding-group all-reduce of :func:`finalize_model_grads` sums matching pieces (Megatron does
the same). ``overlap_param_gather``: the all-gathers are launched asynchronously after the step and each
one is waited for by a forward pre-hook of the first module that uses a parameter of its bucket.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from . import comm_log as comm
from .context import ParallelContext, group_rank, group_size


@dataclass
class _Bucket:
    params: list
    buffer: torch.Tensor  # view of the contiguous grad buffer (padded length under the distributed optimizer)
    start: int = 0  # offset of the bucket in the buffers
    param_buffer: torch.Tensor | None = None  # view of the param buffer (distributed optimizer)
    ready: set = field(default_factory=set)
    work: object = None
    launched: bool = False  # divided (and its reduction started) this iteration; a one-rank group has no work
    gather_work: object = None
    group: object = None  # the group this bucket is reduced over (DP x CP, or expert-DP for expert weights)

    @property
    def world(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def shard(self, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
        """``[lo, hi)`` of DP rank ``rank``'s shard (default: this rank in the bucket's group), relative to the
        bucket start."""
        rank = self.rank if rank is None else rank
        world = self.world if world is None else world
        n = self.buffer.numel() // world
        return rank * n, (rank + 1) * n


def default_bucket_size(dp_size: int, overlap: bool) -> int | None:
    """Megatron's default: ``max(40M, 1M * dp)`` elements with overlap, else one bucket (None)."""
    return max(40_000_000, 1_000_000 * dp_size) if overlap else None


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; ``forward`` is the module's. See the module docstring for the protocol."""

    def __init__(self, module: nn.Module, *, dp_group=None, overlap_grad_reduce: bool = False,
                 bucket_size: int | None = None, grad_dtype=torch.float32, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False, expert_dp_group=None, average: bool = True):
        super().__init__()
        self.module = module
        self.average = average  # False: sum over DP (per-token loss normalization)
        self.dp_group = dp_group  # the data x context parallel group (ParallelContext.dp_cp_group); None: no DP
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        # Expert weights (desc.expert) are replicated over the expert-DP group only: their own buckets reduce over
        # it, with the same 1/(DP x CP) pre-division (each expert's gradient already sums the tokens of EP ranks).
        self.expert_dp_group = expert_dp_group
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather and use_distributed_optimizer
        if bucket_size is None:
            bucket_size = default_bucket_size(self.dp_size, overlap_grad_reduce)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # backprop order
        self.params = params
        device = params[0].device if params else torch.device("cpu")

        # ---- bucket boundaries: (start, end (padded), params, group); dense buckets first, then expert ones
        layout, offset, start, current = [], 0, 0, []
        self.param_range: dict[int, tuple[int, int]] = {}

        def close(group):
            nonlocal offset, start, current
            if current:
                pad = group_size(group) if use_distributed_optimizer else 1
                end = -(-offset // pad) * pad
                layout.append((start, end, current, group))
                offset = start = end
                current = []

        for group, members in ((dp_group, [p for p in params if not _is_expert(p)]),
                               (expert_dp_group, [p for p in params if _is_expert(p)])):
            for p in members:
                alone = use_distributed_optimizer and getattr(p, "shared_embedding", False)
                if alone:
                    close(group)
                self.param_range[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
                current.append(p)
                if alone or (bucket_size is not None and offset - start >= bucket_size):
                    close(group)
            close(group)

        self.grad_buffer = torch.zeros(offset, dtype=grad_dtype, device=device)
        self.param_buffer = None
        if use_distributed_optimizer and params:
            self.param_buffer = torch.zeros(offset, dtype=params[0].dtype, device=device)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for start, end, bparams, group in layout:
            bucket = _Bucket(bparams, self.grad_buffer[start:end], start, group=group)
            if self.param_buffer is not None:
                bucket.param_buffer = self.param_buffer[start:end]
            self.buckets.append(bucket)
            for q in bparams:
                self._bucket_of[id(q)] = bucket
        for p in params:
            lo, hi = self.param_range[id(p)]
            p.main_grad = self.grad_buffer[lo:hi].view_as(p)
            if self.param_buffer is not None:
                view = self.param_buffer[lo:hi].view_as(p)
                view.copy_(p.data)
                p.data = view
        self._sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        if self.overlap_param_gather:
            self._register_param_gather_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        """Pipeline stages after the first take their input from the previous stage."""
        self.module.set_input_tensor(tensor)

    def bucket_of(self, p) -> _Bucket:
        return self._bucket_of[id(p)]

    # ---- gradient reduction ------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None:  # a weight gradient deferred to the split backward's W (parallel/weight_grad.py)
            return
        p.main_grad.add_(p.grad)
        p.grad = None
        if not (self.overlap_grad_reduce and self._sync_enabled):
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched or self.dp_size == 1 and bucket.world == 1:
            return
        bucket.launched = True
        if self.average:
            bucket.buffer.div_(self.dp_size)
        if bucket.world == 1:
            return
        if self.use_distributed_optimizer:
            lo, hi = bucket.shard()
            bucket.work = comm.reduce_scatter_single(bucket.buffer[lo:hi], bucket.buffer, group=bucket.group,
                                                     async_op=True)
        else:
            bucket.work = comm.all_reduce(bucket.buffer, group=bucket.group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no DP reduction), e.g. for all but the last microbatch."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all; ``main_grad`` then holds the DP average (under
        the distributed optimizer: in this rank's shard of every bucket)."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
            bucket.launched = False
            bucket.ready.clear()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient (the whole buffer) by ``factor``."""
        self.grad_buffer.mul_(factor)

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
            bucket.launched = False
        for p in self.module.parameters():
            p.grad = None

    # ---- parameter all-gather (distributed optimizer) -------------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shards into the param buffer (asynchronously with
        ``overlap_param_gather``: then the forward pre-hooks, or :meth:`finish_param_sync`, wait)."""
        if self.param_buffer is None:
            return
        for bucket in self.buckets:
            if bucket.world == 1:
                continue
            lo, hi = bucket.shard()
            bucket.gather_work = comm.all_gather_single(bucket.param_buffer, bucket.param_buffer[lo:hi],
                                                        group=bucket.group, async_op=self.overlap_param_gather)
            if not self.overlap_param_gather:
                bucket.gather_work = None

    def finish_param_sync(self) -> None:
        for bucket in self.buckets:
            self._wait_gather(bucket)

    @staticmethod
    def _wait_gather(bucket: _Bucket) -> None:
        if bucket.gather_work is not None:
            bucket.gather_work.wait()
            bucket.gather_work = None

    def _register_param_gather_hooks(self) -> None:
        for module in self.module.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self._bucket_of]
            if not own:
                continue
            buckets = list({id(self._bucket_of[id(p)]): self._bucket_of[id(p)] for p in own}.values())

            def hook(_module, _args, buckets=buckets):
                for b in buckets:
                    self._wait_gather(b)

            module.register_forward_pre_hook(hook)


def _is_expert(p) -> bool:
    desc = getattr(p, "desc", None)
    return bool(desc is not None and desc.expert)


def finalize_model_grads(chunks: list[DistributedDataParallel], parallel: ParallelContext,
                         num_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
    """After the last backward of an iteration: (1) DP reduction of every chunk; (2) TP all-reduce of the
    gradients of TP-replicated parameters that saw sequence-sharded activations; (3) all-reduce of the tied
    word-embedding gradient over the embedding group (the ranks holding a copy: the first and last pipeline stage,
    a standalone MTP stage; ``ParallelDims.embedding_pp_ranks``), a rank's own copies summed first; (4) with
    ``num_tokens`` (``--calculate-per-token-loss``: this rank's loss tokens of the iteration, known on the last
    pipeline stage): the count is sent to the whole pipeline group, summed over DP x CP, and every gradient divided
    by it (Megatron's order). Returns the global token count (or None)."""
    from .layers import allreduce_sequence_parallel_grads

    for chunk in chunks:
        chunk.finish_grad_sync()
    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk.module, parallel.tp_group, grad_attr="main_grad")
    emb_group = parallel.embedding_group
    shared = [p for c in chunks for p in c.module.parameters() if getattr(p, "shared_embedding", False)]
    if shared:  # copies on this rank (the ends of a V, a standalone MTP stage's) are summed here first
        total = shared[0].main_grad if len(shared) == 1 else sum(p.main_grad for p in shared)
        if emb_group is not None and len(parallel.embedding_ranks) > 1:
            comm.all_reduce(total, group=emb_group)
        for p in shared[len(shared) == 1:]:
            p.main_grad.copy_(total)
    if num_tokens is None:
        return None
    if parallel.pp_size > 1:
        comm.broadcast(num_tokens, src=parallel.loss_rank, group=parallel.pp_group)
    if parallel.dp_cp_size > 1:
        comm.all_reduce(num_tokens, group=parallel.dp_cp_group)
    if num_tokens.item() > 0:
        for chunk in chunks:
            chunk.scale_gradients(1.0 / num_tokens.item())
    return num_tokens
