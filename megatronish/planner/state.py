"""Parameter, gradient and optimizer bytes of one rank, counted on the rank's model built on the meta device.

Nothing is estimated: the rank's model chunks are built as ``setup`` builds them (``build_model_chunks`` over
``ParallelContext.fake(dims, rank)``, the parameters in the run's dtype), wrapped by the run's own
``wrap_model_chunks`` (our DDP: its contiguous gradient buffer, and under ``--use-distributed-optimizer`` its
parameter buffer, buckets padded to a multiple of the data-parallel size) and handed to the run's own
``get_megatron_optimizer`` (its main parameters and Adam/SGD states, allocated at construction; under the
distributed optimizer only the pieces inside this rank's shard of every bucket). The bytes are those objects'
``numel x element size``:

- parameters: the DDP parameter buffer (distributed optimizer) or every parameter;
- gradients: the DDP gradient buffer (fp32 under ``--accumulate-allreduce-grads-in-fp32``, else the params dtype);
- optimizer: fp32 main copies of a 16-bit model, the states (``exp_avg``, ``exp_avg_sq``; SGD's momentum) and
  Adam's 4-byte ``step`` per main parameter.

FSDP2 (``--use-torch-fsdp2``) needs a device mesh, which a fake group cannot give; its layout is FSDP2's own rule
applied to the built meta parameters: each fp32 parameter (this rank's TP slice) is cut into ``DP x CP`` pieces
along dim 0 by ``torch.chunk`` and stored padded to the first piece's rows; the gradients of one FSDP unit (a
transformer layer, the embedding, an untied output layer, the rest of the chunk) are one flat fp32 buffer of those
padded pieces (the reduce-scatter's output); the optimizer's states are shaped like the unpadded local piece.

Those are the bytes that live through the step. At the step's peak FSDP2 holds more, a separate term of the peak
(:func:`fsdp_in_flight_bytes`): the gathered 16-bit copies of the units in flight, their 8-bit casts under FP8,
and one unit's unsharded gradient with its reduce-dtype copy for the reduce-scatter.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..model.build import build_model_chunks
from ..optim.optimizer import get_megatron_optimizer
from ..parallel.context import ParallelContext
from ..parallel.dims import ParallelDims
from ..training.wrap import model_params_dtype, wrap_model_chunks


@dataclass(frozen=True)
class StateBytes:
    """One rank's bytes: ``params``, ``grads``, ``optimizer``; ``num_params`` its parameters' elements."""

    params: int
    grads: int
    optimizer: int
    num_params: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class _ListedDims(ParallelDims):
    """``ParallelDims`` whose rank lists of each group kind are listed once: a fake context of one rank asks for
    every kind's lists, which for 100,000 ranks take seconds each time."""

    def groups(self, kind: str) -> list[list[int]]:
        cache = self.__dict__.setdefault("_listed", {})
        if kind not in cache:
            cache[kind] = super().groups(kind)
        return cache[kind]


@functools.lru_cache(maxsize=4)
def _listed(dims: ParallelDims) -> ParallelDims:
    return _ListedDims(**{f.name: getattr(dims, f.name) for f in dataclasses.fields(dims)})


def build_meta_chunks(cfg, rank: int):
    """``rank``'s model chunks under ``cfg``'s layout, on the meta device, in the run's parameter dtype."""
    ctx = ParallelContext.fake(_listed(cfg.parallel), rank)
    return ctx, build_model_chunks(cfg.model, ctx, sequence_parallel=cfg.sequence_parallel, device="meta",
                                   params_dtype=model_params_dtype(cfg))


def _fsdp_units(model) -> list[list]:
    """The parameters of each FSDP unit of one chunk, as ``FullyShardedDataParallel`` makes the units."""
    layers = list(getattr(getattr(model, "decoder", None), "layers", []))
    embedding, output = getattr(model, "embedding", None), getattr(model, "output_layer", None)
    units = []
    if embedding is not None and not (output is not None and output.weight is None):
        units.append(embedding)
    units += layers
    if output is not None and output.weight is not None:
        units.append(output)
    seen, out = set(), []
    for unit in units:
        ps = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in ps)
        out.append(ps)
    out.append([p for p in model.parameters() if id(p) not in seen])  # the root: what no unit took
    return [u for u in out if u]


def _fsdp_state(cfg, models, world: int, index: int) -> StateBytes:
    """FSDP2's layout (module docstring) for the rank at ``index`` of a data-parallel (x CP) group of ``world``."""
    o = cfg.optim
    states = 8 if o.optimizer == "adam" else (4 if o.sgd_momentum else 0)
    params = grads = opt = n = 0
    for model in models:
        for unit in _fsdp_units(model):
            for p in unit:
                rows = p.shape[0]
                per = -(-rows // world)
                rest = math.prod(p.shape[1:])
                local = max(0, min(per, rows - min(index * per, rows))) * rest
                params += per * rest * 4
                grads += per * rest * 4
                n += local
                if local:
                    opt += local * states + (4 if o.optimizer == "adam" else 0)
    return StateBytes(params, grads, opt, n)


@dataclass(frozen=True)
class BuiltRank:
    """One rank's meta-device objects: its fake context, model chunks, DDP-wrapped chunks and optimizer (both
    None under FSDP2)."""

    ctx: object
    models: list
    chunks: list | None
    optimizer: object | None


def build_rank(cfg, rank: int) -> BuiltRank:
    """``rank``'s model chunks on the meta device, wrapped and given an optimizer as ``setup`` does."""
    ctx, models = build_meta_chunks(cfg, rank)
    if cfg.fsdp_active:
        return BuiltRank(ctx, models, None, None)
    chunks = wrap_model_chunks(models, cfg, ctx, print_fn=lambda *_: None)
    o = cfg.optim
    optimizer = get_megatron_optimizer(chunks, o, use_distributed_optimizer=o.use_distributed_optimizer,
                                       parallel=ctx)
    return BuiltRank(ctx, models, chunks, optimizer)


def rank_state_bytes(cfg, rank: int, built: BuiltRank | None = None) -> StateBytes:
    """Exact parameter, gradient and optimizer bytes of ``rank`` (see the module docstring)."""
    built = built or build_rank(cfg, rank)
    ctx, models, chunks, optimizer = built.ctx, built.models, built.chunks, built.optimizer
    if cfg.fsdp_active:
        return _fsdp_state(cfg, models, ctx.dp_cp_size, ctx.rank_in("dp_cp"))
    params = grads = 0
    for chunk in chunks:
        grads += _nbytes(chunk.grad_buffer)
        if chunk.param_buffer is not None:
            params += _nbytes(chunk.param_buffer)
        else:
            params += sum(_nbytes(p) for p in chunk.module.parameters())
    opt = 0
    for s in optimizer.slots:
        if optimizer.float16:  # a 16-bit model's fp32 master copy (fp32 models: a view of the parameter)
            opt += _nbytes(s.main)
        opt += sum(_nbytes(t) for t in optimizer.optimizer.state[s.main].values())
    n = sum(p.numel() for m in models for p in m.parameters())
    return StateBytes(params, grads, opt, n)


def fsdp_unit_numels(models) -> list[int]:
    """The elements of each FSDP unit of ``models`` (this rank's TP slice, unsharded), as FSDP2 gathers them."""
    return [sum(p.numel() for p in unit) for model in models for unit in _fsdp_units(model)]


def fsdp_in_flight_bytes(cfg, units: list[int], *, unsharded_grads: bool = False) -> int:
    """Bytes FSDP2 holds at the step's peak beyond the sharded state, for the FSDP units of ``units`` elements
    (:func:`fsdp_unit_numels`); 0 without FSDP2.

    - Gathered parameters, in the compute dtype (``params_dtype``): resharding after forward (the default without
      PP), the unit being computed and the ``--fsdp-prefetch-layers`` units prefetched after it, the largest such
      run of consecutive units (``units`` in execution order: at the backward's start the output layer and the
      last layer); without resharding (the default under PP) every unit of the stage stays gathered from its
      first forward to its backward while microbatches are in flight.
    - Under FP8 GEMMs the 8-bit casts (1 byte an element) of the units being computed: the largest run of
      ``1 + --fsdp-prefetch-layers`` consecutive units (a cast lives from its layer's forward or recompute to
      its backward, one layer at a time under recompute).
    - The largest unit's unsharded gradient in the compute dtype, plus its copy in the reduce dtype that the
      reduce-scatter reads (none when the two dtypes are equal). ``unsharded_grads``: every unit's unsharded
      gradient is kept in the reduce dtype until the last microbatch (torch.distributed.pipelining's stages turn
      FSDP2's gradient reduce-scatter off for all but the last microbatch's backward) instead.
    """
    if not cfg.fsdp_active or not units:
        return 0
    from ..parallel.fsdp import resolve_reshard_after_forward

    o = cfg.optim
    e, red = o.params_dtype.itemsize, o.grad_dtype.itemsize
    big = sorted(units, reverse=True)
    w = min(len(units), 1 + max(0, o.fsdp_prefetch_layers))
    window = max(sum(units[i:i + w]) for i in range(len(units) - w + 1))
    reshard = resolve_reshard_after_forward(o.fsdp_reshard_after_forward, cfg.parallel.pp > 1)
    gathered = window if reshard else sum(units)
    fp8 = window if cfg.model.precision.fp8 else 0
    if unsharded_grads:
        grads = sum(units) * red + big[0] * (e if e != red else 0)
    else:
        grads = big[0] * (e + (red if red != e else 0))
    return gathered * e + fp8 + grads


def stage_ranks(dims) -> list[list[int]]:
    """For each pipeline stage, the ranks whose bytes differ at most: the stage's first and last rank (the last
    holds the padding of the sharded buckets and the shortest FSDP pieces)."""
    per = dims.world_size // dims.pp  # pipeline parallelism is the slowest axis: a stage's ranks are contiguous
    return [sorted({stage * per, stage * per + per - 1}) for stage in range(dims.pp)]


__all__ = ["StateBytes", "BuiltRank", "build_rank", "rank_state_bytes", "build_meta_chunks", "stage_ranks",
           "fsdp_unit_numels", "fsdp_in_flight_bytes"]
