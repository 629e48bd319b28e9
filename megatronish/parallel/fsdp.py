"""Fully sharded data parallelism through PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

:class:`FullyShardedDataParallel` wraps one model chunk in place of
:class:`~megatronish.parallel.ddp.DistributedDataParallel` (``--use-torch-fsdp2``). Every transformer layer is
one FSDP unit, the embedding and an output layer with its own weight are one each, and the chunk itself is the
root (its remaining parameters: final norm, and the embedding when the output layer reuses its weight on this
stage). The mesh is 1-D over the data-parallel group (times context parallelism: ``ParallelContext.dp_cp_group``),
so FSDP shards *this rank's tensor-parallel slice* of every parameter further, along dim 0, into ``DP`` pieces
(``torch.chunk`` rows: the last ones may be shorter or empty).

Between iterations a parameter is a ``DTensor`` (``Shard(0)`` over the mesh) whose local tensor is this rank's
rows; the custom attributes the rest of the package reads (``desc``, ``tensor_model_parallel``,
``sequence_parallel``, ``shared_embedding``, ...) are copied onto the sharded parameters. A unit's forward
all-gathers its parameters (cast to ``param_dtype``), backward all-gathers again when they were resharded after
forward, and reduce-scatters the gradients (in ``reduce_dtype``, averaged over the mesh) into the sharded
parameter's ``.grad``, which accumulates over microbatches (one reduce-scatter per microbatch: no unsharded
gradient is kept between microbatches; under the zero-bubble schedules' split backward the gradients stay unsharded
until the last ``W`` and are reduce-scattered once, :meth:`FullyShardedDataParallel.reduce_after_split_backward`).
:meth:`FullyShardedDataParallel.finish_grad_sync` exposes each local
gradient shard as ``param.main_grad``, the interface the optimizer and ``finalize_model_grads`` share with DDP.

Mixed precision is FSDP2's ``MixedPrecisionPolicy``: the sharded parameters stay fp32 (they are the master
weights the optimizer updates in place), compute runs in ``param_dtype`` (bf16/fp16), gradients are reduced in
``reduce_dtype`` (fp32 unless ``--grad-reduce-in-bf16``).

``reshard_after_forward``: True frees each layer's gathered parameters after its forward (all-gather again in
backward: least memory), False keeps them until backward (one all-gather per unit and microbatch). ``"default"``
is torchtitan's rule: False under pipeline parallelism (many forwards before their backwards), else True.
``prefetch_layers`` (>= 0): each layer's forward starts the all-gather of the next ``n`` layers and its backward
that of the previous ``n`` (explicit prefetch; 0 leaves FSDP2's implicit prefetching).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .context import group_size


def _fsdp_api():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return DeviceMesh, MixedPrecisionPolicy, fully_shard


def is_sharded(p) -> bool:
    """True for an FSDP2-sharded parameter (a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local_shard(p) -> torch.Tensor:
    """The local tensor of a sharded parameter (shares its storage: in-place writes update the parameter); the
    parameter itself otherwise."""
    if not is_sharded(p):
        return p.detach()
    with torch.no_grad():
        return p.detach().to_local()


def shard_rows(p) -> tuple[int, tuple[int, ...]] | None:
    """``(first row, unsharded shape)`` of this rank's dim-0 shard of an FSDP2 parameter (the unsharded shape is
    this rank's tensor-parallel slice), or None for a plain parameter."""
    if not is_sharded(p):
        return None
    from torch.distributed.tensor import Shard

    (placement,) = p.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"unexpected FSDP2 placement {placement} (expected Shard(0))")
    rows, world, rank = p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()
    per = -(-rows // world)  # torch.chunk
    first = min(rank * per, rows)
    local = p.to_local().shape[0]
    if local != max(0, min(per, rows - first)):
        raise ValueError(f"FSDP2 shard of {rows} rows on mesh rank {rank}/{world} has {local} rows, not torch.chunk's")
    return first, tuple(p.shape)


def resolve_reshard_after_forward(policy: str, pipeline_parallel: bool) -> bool:
    """``--fsdp-reshard-after-forward`` ``default`` / ``always`` / ``never`` -> bool (see the module docstring)."""
    if policy == "default":
        return not pipeline_parallel
    if policy in ("always", "never"):
        return policy == "always"
    raise ValueError(f"--fsdp-reshard-after-forward {policy!r}: choose default, always or never")


class FullyShardedDataParallel(nn.Module):
    """Wraps one model chunk (a ``GPTModel``) with FSDP2; see the module docstring. ``forward`` is the module's."""

    fsdp = True
    use_distributed_optimizer = False

    def __init__(self, module: nn.Module, *, dp_group, param_dtype=torch.float32, reduce_dtype=torch.float32,
                 reshard_after_forward: bool = True, prefetch_layers: int = 1):
        super().__init__()
        DeviceMesh, MixedPrecisionPolicy, fully_shard = _fsdp_api()
        self.module = module
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        if self.dp_size < 2:
            raise ValueError("FullyShardedDataParallel needs a data-parallel group of at least 2 ranks")
        dtypes = {p.dtype for p in module.parameters()}
        if dtypes != {torch.float32}:
            raise ValueError(f"FSDP2 shards fp32 master weights; the model's parameters are {sorted(map(str, dtypes))}")
        first = next(module.parameters())
        self.mesh = DeviceMesh.from_group(dp_group, first.device.type)
        mp = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                  reduce_dtype=reduce_dtype)
        kw = {"mesh": self.mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
        attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}

        layers = list(getattr(getattr(module, "decoder", None), "layers", []))
        units = []
        embedding, output = getattr(module, "embedding", None), getattr(module, "output_layer", None)
        # the embedding is a unit of its own unless the output layer reads its weight later in this forward
        if embedding is not None and not (output is not None and output.weight is None):
            units.append(embedding)
        units += layers
        if output is not None and output.weight is not None:
            units.append(output)
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(module, **kw)
        for name, p in module.named_parameters():
            for k, v in attrs.get(name, {}).items():
                setattr(p, k, v)
        if prefetch_layers > 0 and len(layers) > 1:
            for i, layer in enumerate(layers):
                layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + prefetch_layers])
                layer.set_modules_to_backward_prefetch(layers[max(0, i - prefetch_layers):i][::-1])
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        """Pipeline stages after the first take their input from the previous stage."""
        self.module.set_input_tensor(tensor)

    # ---- the gradient interface shared with DistributedDataParallel ------------------------------------------
    def finish_grad_sync(self) -> None:
        """FSDP2 has reduce-scattered every microbatch's gradients (its root waits for them at the end of each
        backward); point ``main_grad`` at each parameter's local gradient shard (zeros when it got none)."""
        for p in self.params:
            g = p.grad
            p.main_grad = g.to_local() if g is not None else torch.zeros_like(local_shard(p))

    def zero_grad_buffer(self) -> None:
        for p in self.params:
            p.grad = None
            p.main_grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients are reduce-scattered after every microbatch (nothing unsharded is kept between them)."""
        yield

    @contextlib.contextmanager
    def reduce_after_split_backward(self):
        """The split backward (zero-bubble schedules, :mod:`~megatronish.parallel.weight_grad`): while open, no
        unit reduce-scatters or reshards after a microbatch's ``B`` (its gradients accumulate unsharded, ``W``
        adds the deferred weight gradients to them); on a normal exit every unit runs FSDP2's post-backward once,
        one reduce-scatter of the iteration's gradients, then the root's end of backward (as torch's pipelining
        does after its last ``W``)."""
        from torch.distributed.fsdp import fully_shard

        def switch(on: bool) -> None:
            self.module.set_requires_gradient_sync(on)
            self.module.set_reshard_after_backward(on)
            self.module.set_is_last_backward(on)

        switch(False)
        try:
            yield
        except BaseException:
            switch(True)
            raise
        switch(True)
        state = fully_shard.state(self.module)
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def start_param_sync(self) -> None:
        """Nothing to gather after the step: the next forward all-gathers the updated shards."""

    def finish_param_sync(self) -> None:
        pass


__all__ = ["FullyShardedDataParallel", "is_sharded", "local_shard", "shard_rows", "resolve_reshard_after_forward"]
