"""Output-discarding recompute (Megatron-LM's ``CheckpointWithoutOutput``), for the selective recompute modules
that drop a function's *output* and keep its inputs: ``layernorm``, ``mla_up_proj`` and ``moe_act``.

``OutputRecompute.run(fn, *args)`` computes ``fn(*args)`` without a graph and keeps only ``args`` for backward.
Its outputs are used as usual, inside ``with rec.discarding():``. Wherever an operation in that block saves one of
the outputs (or a view of one) for its backward, a recipe is kept instead of the tensor; when backward first needs
the tensor (the consumer's backward or this function's own), ``fn`` runs again on the kept inputs, with grad, and
the recipe becomes the same view of the recomputed output. ``fn`` must be deterministic (no dropout): the
recomputed outputs are then bitwise those of the forward, and so is every gradient.

The saved-tensor hooks of the block hand every other tensor to the hooks that were active outside it (the
saved-activation counter of ``training/memory.py``, an enclosing block), so nesting and measuring still work.
"""
from __future__ import annotations

import contextlib
import weakref

import torch


class _Recipe:
    __slots__ = ("owner", "index", "size", "stride", "offset")

    def __init__(self, owner, index, t):
        self.owner, self.index = owner, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _Outer:
    __slots__ = ("payload", "unpack")

    def __init__(self, payload, unpack):
        self.payload, self.unpack = payload, unpack


class _RunDiscarded(torch.autograd.Function):
    """forward: ``fn(*args)`` without a graph, saving ``args``; backward: ``fn`` again with grad (unless a
    recipe already did it), then backward through it."""

    @staticmethod
    def forward(ctx, rec, *args):
        ctx.rec = rec
        rec._ctx = weakref.ref(ctx)  # (the graph owns ctx; ctx owns rec)
        with torch.no_grad(), rec._forward_ctx:
            outs = rec.fn(*args)
        ctx.save_for_backward(*args)
        single = torch.is_tensor(outs)
        rec._single = single
        outs = (outs,) if single else tuple(outs)
        rec._storages = {o.untyped_storage().data_ptr(): i for i, o in enumerate(outs)}
        return outs[0] if single else outs

    @staticmethod
    def backward(ctx, *grads):
        rec = ctx.rec
        inputs, outs = rec._recompute()
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        rec._inputs = rec._outs = None  # done: drop the recomputed tensors (a retained graph recomputes again)
        return (None, *[x.grad if x.requires_grad else None for x in inputs])


class OutputRecompute:
    """One use of an output-discarding recompute (see the module docstring)."""

    def __init__(self):
        self.fn = None
        self._ctx = self._inputs = self._outs = None
        self._storages: dict[int, int] = {}
        self._single = True
        self._forward_ctx = self._recompute_ctx = contextlib.nullcontext()

    def run(self, fn, *args, contexts=None):
        """``fn(*args)`` (tensors only), its outputs to be used inside :meth:`discarding`. ``contexts``: as
        ``parallel/random.py``'s ``checkpoint``, the ``(forward, recompute)`` context managers around the two runs
        of ``fn`` (Transformer Engine's FP8 state)."""
        self.fn = fn
        if contexts is not None:
            self._forward_ctx, self._recompute_ctx = contexts()
        return _RunDiscarded.apply(self, *args)

    def _recompute(self):
        if self._outs is None:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in self._ctx().saved_tensors]
            with torch.enable_grad(), self._recompute_ctx:
                outs = self.fn(*inputs)
            self._inputs, self._outs = inputs, ((outs,) if self._single else tuple(outs))
        return self._inputs, self._outs

    def _pack(self, outer):
        def pack(t: torch.Tensor):
            index = self._storages.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            if index is not None:
                return _Recipe(self, index, t)
            return t if outer is None else _Outer(outer[0](t), outer[1])
        return pack

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _Recipe):
            out = packed.owner._recompute()[1][packed.index].detach()
            return torch.as_strided(out, packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Outer):
            return packed.unpack(packed.payload)
        return packed

    def discarding(self):
        """The block whose saved copies of the outputs are recipes (the hooks outside it see everything else)."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # the enclosing hooks, or None
        return torch.autograd.graph.saved_tensors_hooks(self._pack(outer), self._unpack)


def discard_output(enabled: bool, fn, *args, contexts=None):
    """``(outputs, block)``: with ``enabled``, :class:`OutputRecompute`'s outputs and its discarding block; else
    ``fn(*args)`` and a block that does nothing. ``contexts``: see :meth:`OutputRecompute.run`."""
    if not enabled:
        return fn(*args), contextlib.nullcontext()
    rec = OutputRecompute()
    return rec.run(fn, *args, contexts=contexts), rec.discarding()
