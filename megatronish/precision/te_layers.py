"""``--transformer-impl transformer_engine``: the linears of the transformer layers run through Transformer Engine.

The model keeps its own parameters, names and :class:`~megatronish.parallel.init.TensorDesc` (so checkpoints stay
layout- and implementation-independent): every column/row-parallel linear inside a transformer layer gets a hook
(the same ``fp8`` hook the emulated FP8 uses: ``(x, weight, bias) -> x W^T + b``) that owns a
``transformer_engine.pytorch.Linear`` of the layer's *local* shape whose ``weight`` is the layer's own parameter
object. The TE module is kept out of the model's module tree, so ``model.parameters()`` and ``state_dict()`` are
unchanged; tensor and sequence parallelism stay in our layers (the hook sees the gathered input and the local
weight slice, as ``F.linear`` would). The bias is added outside TE.

FP8 recipes (Megatron's ``--fp8-recipe`` names) map onto TE's ``transformer_engine.common.recipe``:

- ``delayed``: ``DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo)``;
- ``tensorwise``: ``Float8CurrentScaling(fp8_format)`` (current scaling);
- ``mxfp8``: ``MXFP8BlockScaling(E4M3)`` (where TE reports the GPU supports it);
- no recipe: TE's GEMMs in the parameters' precision (bf16), no FP8.

The training forward runs inside one TE autocast (:meth:`TeManager.autocast`, entered by the forward step around
the model's forward, as Megatron-LM's ``get_fp8_context`` does): the hooked calls then run in that region, so TE
takes the first of them for the region's first FP8 module, reduces the forward amaxes once at the region's end and
the backward ones once, in the first module's backward. A call outside any region (generation) enters its own
autocast; TE then takes each such linear for a first module (an autocast's exit restores that flag), so with
``delayed`` its backward reduces and updates the backward amaxes: right for Megatron's default history (length 1,
``most_recent``), while a longer history advances once per such linear. Recompute (``--recompute-granularity``,
``--recompute-modules`` ``mlp``, ``moe``, ``shared_experts``, ``mla_up_proj``) enters TE's activation-recompute
phases around both forwards (:meth:`TeManager.recompute_contexts`), as TE's own ``checkpoint`` and Megatron-LM with
TE do: the recomputed forward reads back the scales the first one used and runs in one autocast of the run's
recipe.
TE updates its scales itself, so :meth:`TeManager.update` does nothing; the delayed-scaling amax histories live in
TE's modules and are not checkpointed (a resumed run starts them afresh).

Nothing here imports Transformer Engine at module import: :func:`import_te` does, on demand, and turns a missing
TE or CUDA into one :class:`~megatronish.errors.ConfigError` naming the flag.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError
from .fp8 import import_transformer_engine

__all__ = ["import_te", "te_recipe", "fp8_support", "mxfp8_support", "TeLinearHook", "TeManager", "enable_te"]

RECIPES = ("delayed", "tensorwise", "mxfp8")


def import_te():
    """``transformer_engine.pytorch`` (a ConfigError naming ``--transformer-impl`` when TE or CUDA is missing)."""
    return import_transformer_engine()


def _recipe_module():
    import transformer_engine.common.recipe as recipe  # GPU-only, lazy by design

    return recipe


def _state_manager():
    """TE's ``FP8GlobalStateManager`` (``pytorch.quantization`` in newer TE, ``pytorch.fp8`` before)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def fp8_support() -> tuple[bool, str]:
    """TE's own answer: does this GPU run FP8 (delayed / current scaling), and if not why."""
    import_te()
    ok, why = _state_manager().is_fp8_available()
    return bool(ok), "" if ok else str(why)


def mxfp8_support() -> tuple[bool, str]:
    """TE's own answer for MXFP8 block scaling (compute capability 10.0 and later)."""
    import_te()
    mgr = _state_manager()
    if not hasattr(mgr, "is_mxfp8_available"):
        return False, "this Transformer Engine has no MXFP8 recipe"
    ok, why = mgr.is_mxfp8_available()
    return bool(ok), "" if ok else str(why)


def te_recipe(fp8_format: str | None, fp8_recipe: str = "delayed", *, margin: int = 0, amax_history_len: int = 1,
              amax_compute_algo: str = "most_recent"):
    """TE's recipe object for Megatron's flags (``--fp8-format``, ``--fp8-recipe``, ``--fp8-margin``,
    ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``); None without ``--fp8-format`` (no FP8)."""
    if fp8_format is None:
        return None
    if fp8_recipe not in RECIPES:
        raise ConfigError(f"--fp8-recipe {fp8_recipe!r} with --transformer-impl transformer_engine: choose one of "
                          f"{', '.join(RECIPES)}")
    r = _recipe_module()
    fmt = {"e4m3": r.Format.E4M3, "hybrid": r.Format.HYBRID}[fp8_format]
    if fp8_recipe == "delayed":
        return r.DelayedScaling(margin=margin, fp8_format=fmt, amax_history_len=amax_history_len,
                                amax_compute_algo=amax_compute_algo)
    # Float8CurrentScaling came with TE 2.2 and MXFP8BlockScaling with TE 2.0; TE 1.x has DelayedScaling only
    cls_name = "Float8CurrentScaling" if fp8_recipe == "tensorwise" else "MXFP8BlockScaling"
    cls = getattr(r, cls_name, None)
    if cls is None:
        raise ConfigError(f"--fp8-recipe {fp8_recipe}: this Transformer Engine has no recipe.{cls_name} "
                          f"(it needs TE {'2.2' if fp8_recipe == 'tensorwise' else '2.0'} or later); "
                          f"use --fp8-recipe delayed or a newer Transformer Engine")
    if fp8_recipe == "tensorwise":
        return cls(fp8_format=fmt)
    return cls(fp8_format=r.Format.E4M3)  # MXFP8: E4M3 throughout (TE's default for this recipe)


def te_autocast(recipe, group=None):
    """TE's autocast for ``recipe`` (None: FP8 off) and the amax-reduction ``group``: ``te.autocast`` where this TE
    has it, else ``te.fp8_autocast``. Runs per linear call, after :func:`enable_te` checked the import."""
    import transformer_engine.pytorch as te  # GPU-only, lazy by design
    if hasattr(te, "autocast"):
        return te.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, fp8_group=group)


class TeLinearHook:
    """The hook of one of our linears: a TE ``Linear`` of the local shape ``[out, in]`` sharing ``weight``."""

    def __init__(self, weight: torch.nn.Parameter, recipe=None, group=None, name: str = ""):
        te = import_te()
        out_features, in_features = weight.shape
        # On the meta device TE allocates nothing; the layer's own parameter replaces the placeholder weight.
        self.module = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device="meta")
        self._set_weight(weight)
        self.recipe, self.group, self.name = recipe, group, name
        self.in_region = False  # inside TeManager.autocast: the region's autocast is in force

    def _set_weight(self, weight: torch.Tensor) -> None:
        # TE reads ``getattr(module, "weight")``; writing the parameter table directly also takes a tensor that is
        # not an ``nn.Parameter`` (where ``Module.__setattr__`` would raise a TypeError).
        self.module._parameters["weight"] = weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store=None) -> torch.Tensor:
        """``store`` (a zero-bubble schedule's weight-gradient store) is not used: TE's backward computes the
        weight gradient at once, and the split backward holds it until ``W`` (``parallel/weight_grad.py``)."""
        if weight is not self.module.weight:  # a tied or re-created parameter: follow the layer
            self._set_weight(weight)
        if self.in_region:
            out = self.module(x)
        else:
            with te_autocast(self.recipe, self.group):
                out = self.module(x)
        return out if bias is None else out + bias


class TeManager:
    """The TE hooks of a model's linears (global name -> layer); duck-types the emulated FP8 manager."""

    def __init__(self, recipe, linears: dict, group=None, recipe_name: str | None = None):
        self.recipe, self.linears, self.group = recipe, linears, group
        self.recipe_name = recipe_name

    @contextlib.contextmanager
    def autocast(self):
        """One TE autocast around a whole forward: the hooked linears run in it without their own (the forward
        amaxes are reduced once, at its end, and the backward ones once per microbatch)."""
        hooks = [lin.fp8 for lin in self.linears.values()]
        before = [h.in_region for h in hooks]
        with te_autocast(self.recipe, self.group):
            for h in hooks:
                h.in_region = True
            try:
                yield
            finally:
                for h, was in zip(hooks, before):
                    h.in_region = was

    def recompute_contexts(self):
        """The ``(forward, recompute)`` contexts of one checkpointed call (``parallel/random.py``'s
        ``checkpoint(..., contexts=)``), entered as TE's own ``checkpoint`` enters them: the first forward in TE's
        ``activation_recompute_forward`` (its FP8 modules keep a copy of their scales and amax histories, and TE
        notes the region's first-module flag), the recompute in its recompute phase (those copies are read back,
        so both forwards quantize alike) and, where the first forward ran in the region, in an autocast of the
        same recipe with the hooked linears inside it."""
        from transformer_engine.pytorch.distributed import activation_recompute_forward  # GPU-only, lazy

        in_region = any(lin.fp8.in_region for lin in self.linears.values())
        forward = activation_recompute_forward(activation_recompute=True, recompute_phase=False)
        recompute = activation_recompute_forward(activation_recompute=True, recompute_phase=True)
        return forward, self._recompute(recompute, in_region)

    @contextlib.contextmanager
    def _recompute(self, phase, in_region: bool):
        with phase, (self.autocast() if in_region else contextlib.nullcontext()):
            yield

    def update(self) -> None:
        """TE updates its scales in its autocast; nothing to do at the end of a step."""

    def state_dict(self) -> dict:
        return {"recipe": {"transformer_impl": "transformer_engine", "fp8_recipe": self.recipe_name}}

    def load_state_dict(self, state: dict) -> None:
        """The amax histories are TE's and start afresh on resume (see the module docstring)."""


def _transformer_linears(model):
    """``(global name, layer)`` of the column/row-parallel linears inside the model's transformer layers."""
    from ..model.transformer import TransformerLayer
    from ..parallel.layers import ColumnParallelLinear, RowParallelLinear

    global_name = getattr(model, "global_name", lambda n: n)
    for prefix, module in model.named_modules():
        if not isinstance(module, TransformerLayer):
            continue
        for sub, lin in module.named_modules():
            if isinstance(lin, (ColumnParallelLinear, RowParallelLinear)):
                yield global_name(f"{prefix}.{sub}.weight")[: -len(".weight")], lin


def _check_fp8_shapes(linears, multiple: int, fp8_recipe: str) -> None:
    """TE's FP8 GEMMs take local weights whose both dimensions are multiples of 16 (32 for MXFP8's blocks); TE
    itself only finds out inside the first forward, so say which layer here."""
    bad = [f"{name} {list(lin.weight.shape)}" for name, lin in linears
           if lin.weight is not None and any(d % multiple for d in lin.weight.shape)]
    if bad:
        raise ConfigError(f"--fp8-recipe {fp8_recipe} with --transformer-impl transformer_engine: TE's FP8 GEMMs "
                          f"need local weight dimensions divisible by {multiple}; not so for "
                          f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")


def enable_te(model: torch.nn.Module, fp8_format: str | None = None, fp8_recipe: str = "delayed",
              **recipe_kw) -> TeManager:
    """Run the linears inside ``model``'s transformer layers through TE (FP8 with ``fp8_format``, else the
    parameters' precision). The embedding and output layer stay ours, as in Megatron."""
    recipe = te_recipe(fp8_format, fp8_recipe, **recipe_kw)
    parallel = getattr(model, "parallel", None)
    group = parallel.amax_reduction_group() if parallel is not None and recipe is not None else None
    found = list(_transformer_linears(model))
    if recipe is not None:
        _check_fp8_shapes(found, 32 if fp8_recipe == "mxfp8" else 16, fp8_recipe)
    linears = {}
    for name, lin in found:
        lin.fp8 = TeLinearHook(lin.weight, recipe, group, name)
        linears[name] = lin
    if not linears:
        raise ValueError("enable_te: the model has no parallel linear layers inside transformer layers")
    manager = TeManager(recipe, linears, group, fp8_recipe if fp8_format else None)
    for module in model.modules():  # the recomputing modules' checkpoints enter TE's recompute phases
        if hasattr(type(module), "recompute_contexts"):
            module.recompute_contexts = manager.recompute_contexts
    return manager
