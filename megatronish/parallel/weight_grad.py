"""Split backward: ``B`` (gradients of a stage's input) now, ``W`` (gradients of its weights) later.

The zero-bubble pipeline schedules run each microbatch's backward in two parts. ``B`` produces the gradient
that the previous stage waits for; ``W`` produces the weight gradients, which nobody downstream waits for, so
the schedule places it where a rank would otherwise idle.

What is deferred, and how:

- The weight GEMMs of :class:`~megatronish.parallel.layers.ColumnParallelLinear` and
  :class:`~megatronish.parallel.layers.RowParallelLinear` (every attention and MLP projection of the dense
  layers, the shared experts, and the output layer). A layer with a :class:`WeightGradStore` attached
  (:func:`attached`) runs its matmul through :class:`_DeferrableLinear`; inside :meth:`WeightGradStore.defer`
  its backward computes only ``dX = dY W`` and queues ``(X, dY)``; ``W`` computes ``dW = dY^T X`` and
  ``db = sum dY`` from them, the same operations the undeferred backward runs, so the result is bitwise equal.
  Under FP8 (``--fp8-format``, the emulated path) the layer's FP8 linear defers the same way: ``B`` quantizes
  ``dY`` and computes dgrad, ``W`` the wgrad from the saved fp8 ``X`` and the fp8 ``dY``
  (``precision/fp8.py``).
- Every other parameter (norms, embeddings, the router, the MoE experts' grouped weights, a Transformer Engine
  linear): its gradient is computed in ``B`` (the autograd engine is asked for it instead of accumulating it,
  :func:`backward_input`) and held until ``W``.

``W`` (:func:`backward_weight`) accumulates all of a microbatch's weight gradients through the autograd
engine (one call, the parameters as roots), so ``.grad`` accumulation and the post-accumulate hooks of DDP and
the distributed optimizer run exactly as in an unsplit backward, only later. Under full recompute the
recomputed layer's backward is an inner autograd call: its linears still defer their GEMMs, but its other
parameters (norms, biases of non-TP ops) accumulate (and fire their hooks) during ``B``. Under FSDP2 every
gradient but the deferred GEMMs' accumulates during ``B`` into the unsharded parameters, and FSDP2's
reduce-scatter runs once after the last ``W`` (:meth:`~megatronish.parallel.fsdp.FullyShardedDataParallel.
reduce_after_split_backward`).

The switch is owned by the store object: nothing here is a module global.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["WeightGradStore", "attached", "linear", "backward_input", "backward_weight", "PendingWeightGrads"]


class WeightGradStore:
    """The queue of weight-gradient work recorded while :meth:`defer` is active (one ``B`` at a time)."""

    def __init__(self):
        self._deferring = False
        self._queue: list = []

    @property
    def deferring(self) -> bool:
        return self._deferring

    @contextlib.contextmanager
    def defer(self):
        if self._deferring:
            raise RuntimeError("WeightGradStore.defer() is not reentrant")
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def put(self, params: tuple, compute) -> None:
        """Queue ``compute() -> gradients`` of ``params`` (one tensor per parameter, in order)."""
        self._queue.append((params, compute))

    def take(self) -> list:
        queue, self._queue = self._queue, []
        return queue


def attached(modules, store: WeightGradStore | None) -> contextlib.AbstractContextManager:
    """Attach ``store`` to every layer of ``modules`` that can defer its weight GEMM (a class attribute
    ``weight_grad_store``), for the duration of the ``with`` block."""
    layers = [m for module in modules for m in module.modules() if hasattr(type(m), "weight_grad_store")]
    stack = contextlib.ExitStack()
    if store is None:
        return stack
    for m in layers:
        m.weight_grad_store = store
    stack.callback(lambda: [setattr(m, "weight_grad_store", None) for m in layers])
    return stack


def _weight_grads(x: torch.Tensor, dy: torch.Tensor, has_bias: bool):
    dy2d = dy.reshape(-1, dy.shape[-1])
    gw = dy2d.t().mm(x.reshape(-1, x.shape[-1]))
    return (gw, dy2d.sum(0)) if has_bias else (gw,)


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward queues the weight (and bias) gradient on the store while it
    is deferring, else computes it at once with the same operations."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        ctx.params = (weight, bias) if bias is not None else (weight,)  # the parameters themselves, for W
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None
        if ctx.store.deferring:
            # W accumulates into the parameters (not the unpacked saved weight, which a saved-tensor hook may
            # have replaced by another tensor of the same values)
            ctx.store.put(ctx.params, lambda: _weight_grads(x, dy, ctx.has_bias))
            return dx, None, None, None
        grads = _weight_grads(x, dy, ctx.has_bias)
        return dx, grads[0], (grads[1] if ctx.has_bias else None), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None):
    """``F.linear``; with a store attached, the deferrable form (same forward)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)


class PendingWeightGrads:
    """One microbatch's ``W``: queued GEMMs and gradients computed during ``B``."""

    def __init__(self, queued: list, computed: list):
        self.queued, self.computed = queued, computed

    def __len__(self) -> int:
        return len(self.queued) + len(self.computed)


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, input_: torch.Tensor | None, params,
                   store: WeightGradStore, accumulate: bool = False):
    """``B``: backpropagate ``grad_output`` (None: ``output`` is the scalar loss) and return ``(input's gradient
    or None, PendingWeightGrads)``; no parameter's ``.grad`` changes (but see the module note on recompute).
    ``accumulate``: the gradients of the parameters that are not deferred accumulate now (``params`` unused), for
    a wrapper whose parameters in the graph are not the module's (FSDP2's unsharded ones) and whose gradient
    reduction waits for the last ``W`` without hooks."""
    if output.grad_fn is None:
        raise RuntimeError("pipeline stage output has no autograd graph (was the forward run under no_grad?)")
    if grad_output is None:
        grad_output = torch.ones_like(output)
    if accumulate:
        with store.defer():  # the engine itself: a sent output's storage is freed (one element)
            torch.autograd.Variable._execution_engine.run_backward(
                tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
                allow_unreachable=True, accumulate_grad=True)
            queued = store.take()
        dx = input_.grad if input_ is not None else None
        return dx, PendingWeightGrads(queued, [])
    params = [p for p in params if p.requires_grad]
    inputs = ([input_] if input_ is not None else []) + params
    with store.defer():
        grads = torch.autograd.Variable._execution_engine.run_backward(
            tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
            inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=False)
        queued = store.take()
    dx = grads[0] if input_ is not None else None
    computed = [(p, g) for p, g in zip(params, grads[len(inputs) - len(params):]) if g is not None]
    return dx, PendingWeightGrads(queued, computed)


def backward_weight(pending: PendingWeightGrads) -> None:
    """``W``: run the queued GEMMs and accumulate every weight gradient of the microbatch (hooks included)."""
    total: dict[int, list] = {}
    for params, compute in pending.queued:
        for p, g in zip(params, compute()):
            _add(total, p, g)
    for p, g in pending.computed:
        _add(total, p, g)
    pending.queued, pending.computed = [], []
    if total:
        torch.autograd.backward([p for p, _ in total.values()], [g for _, g in total.values()])


def _add(total: dict, p: torch.Tensor, g: torch.Tensor) -> None:
    if id(p) in total:
        total[id(p)][1] = total[id(p)][1] + g
    else:
        total[id(p)] = [p, g]
