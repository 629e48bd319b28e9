"""FP8 training: the delayed-scaling (and current-scaling) recipe emulated with PyTorch's float8 dtypes.

Recipe (Transformer Engine's ``DelayedScaling``, as Megatron-LM drives it through ``--fp8-*`` flags):

- every FP8 tensor of a linear layer -- its *input*, its *weight* and the *grad_output* of its backward --
  has a per-tensor scale ``s``; values are stored as ``clamp(x * s, -fp8_max, fp8_max).to(fp8)`` and read
  back as ``x_fp8 / s``;
- ``delayed``: each tensor keeps an amax history of length ``L`` (``history[0]`` is the most recent step).
  The scale used during step ``t`` comes from the history *before* step ``t``'s amax is recorded:
  ``amax = max(history)`` (``max``) or ``history[0]`` (``most_recent``),
  ``scale = fp8_max / amax / 2**margin``, and the previous scale is kept when that amax is 0 or not finite.
  At the end of the step (:meth:`Fp8Manager.update`) the step's amaxes (max over its microbatches) are
  max-reduced over the amax-reduction group (tensor + data parallel), the history is shifted by one and the
  new amax enters at ``history[0]``; the next step's scale is then computed from it;
- ``tensorwise``: current scaling -- the scale comes from the amax of the tensor being cast (max-reduced over
  the same group at once), no history;
- formats: ``e4m3`` everywhere, or ``hybrid`` = e4m3 (max 448) for inputs and weights, e5m2 (max 57344) for
  gradients.

The matmuls use the fp8 payloads: ``torch._scaled_mm`` where this build runs it (CPU does here), otherwise
``fp8 -> fp32`` dequantize and an fp32 matmul (products of two fp8 numbers are exact in fp32, so both paths
round only in the fp32 accumulation). The forward saves the fp8 input and weight for the backward; dgrad
``= g_fp8 @ w_fp8`` and wgrad ``= g_fp8^T @ x_fp8``; the bias gradient is taken from the unquantized fp32
``grad_output`` (as Transformer Engine does). Under a zero-bubble schedule's split backward the wgrad GEMM and the
bias gradient wait for ``W`` (``parallel/weight_grad.py``), computed then from the same fp8 tensors.

Usage::

    fp8 = enable_fp8(model, Fp8Recipe(fp8_format="hybrid"))   # linears inside transformer layers only
    loss = model(ids, labels=labels).mean(); loss.backward()
    fp8.update()                                              # once per optimizer step, on every rank
    state = fp8.state_dict()                                  # save beside the model; load_state_dict back

Transformer Engine (``--transformer-impl transformer_engine``) is imported lazily by
:func:`import_transformer_engine`; :func:`check_transformer_impl` turns a missing TE/CUDA into one error.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..parallel import comm_log as comm
from ..parallel.weight_grad import linear

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
ROLES = ("input", "weight", "grad_output")


# ---- recipe ---------------------------------------------------------------------------------------
@dataclass
class Fp8Recipe:
    """Megatron's flags: ``--fp8-format``, ``--fp8-recipe``, ``--fp8-margin``, ``--fp8-amax-history-len``,
    ``--fp8-amax-compute-algo``. ``reduce_amax``: max-reduce amaxes over the amax-reduction group."""

    fp8_format: str = "hybrid"  # "e4m3" | "hybrid"
    fp8_recipe: str = "delayed"  # "delayed" | "tensorwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # "most_recent" | "max"
    reduce_amax: bool = True

    def __post_init__(self):
        if self.fp8_format not in ("e4m3", "hybrid"):
            raise ConfigError(f"--fp8-format {self.fp8_format!r}: choose e4m3 or hybrid")
        if self.fp8_recipe not in ("delayed", "tensorwise"):
            raise ConfigError(f"--fp8-recipe {self.fp8_recipe!r}: choose delayed or tensorwise")
        if self.fp8_amax_compute_algo not in ("most_recent", "max"):
            raise ConfigError(f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo!r}: choose most_recent or max")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-history-len {self.fp8_amax_history_len} must be >= 1")
        if self.fp8_margin < 0:
            raise ConfigError(f"--fp8-margin {self.fp8_margin} must be >= 0")

    def dtype(self, role: str) -> torch.dtype:
        return E5M2 if (self.fp8_format == "hybrid" and role == "grad_output") else E4M3

    @classmethod
    def from_config(cls, config) -> "Fp8Recipe | None":
        """From the model's :class:`~megatronish.config.PrecisionConfig` (``fp8`` = the ``--fp8-format`` value, or
        None: no recipe)."""
        if not config.fp8:
            return None
        return cls(fp8_format=config.fp8, fp8_recipe=config.fp8_recipe, fp8_margin=config.fp8_margin,
                   fp8_amax_history_len=config.fp8_amax_history_len,
                   fp8_amax_compute_algo=config.fp8_amax_compute_algo)


# ---- quantization ---------------------------------------------------------------------------------
def compute_scale(amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """``fp8_max / amax / 2**margin``; the previous scale where ``amax`` is 0 or not finite."""
    amax = amax.float()
    new = fp8_max / amax / (2.0 ** margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(new)
    return torch.where(ok, new, prev_scale.float())


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: ``clamp(x * scale, -max, max).to(dtype)`` (round to nearest even)."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-m, m).to(dtype)


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() / scale


def relative_precision(dtype: torch.dtype) -> float:
    """Worst-case relative rounding error of a normal fp8 value: half its relative spacing ``2**-m / 2``."""
    return 2.0 ** -MANTISSA_BITS[dtype] / 2


_SCALED_MM_OK: dict[str, bool] = {}


def _scaled_mm_works(device: torch.device) -> bool:
    key = device.type
    if key not in _SCALED_MM_OK:
        try:
            a = torch.ones(16, 16, device=device).to(E4M3)
            one = torch.ones((), device=device)
            out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _SCALED_MM_OK[key] = bool(torch.all(out == 16))
        except Exception:  # any failure: use the dequantize path
            _SCALED_MM_OK[key] = False
    return _SCALED_MM_OK[key]


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``dequant(a) @ dequant(b_t)^T`` in fp32 for fp8 ``a [m, k]`` and ``b_t [n, k]`` (both row-major)."""
    inv_a, inv_b = (1.0 / a_scale).float(), (1.0 / b_scale).float()
    # cuBLAS's fp8 GEMM takes k and n in multiples of 16 (torch._scaled_mm checks it); others dequantize
    aligned = a.device.type == "cpu" or (a.shape[1] % 16 == 0 and b_t.shape[0] % 16 == 0)
    if aligned and _scaled_mm_works(a.device) and not (a.dtype == E5M2 and b_t.dtype == E5M2):
        # _scaled_mm wants a row-major and b column-major: b_t row-major -> b_t.t() is column-major.
        return torch._scaled_mm(a.contiguous(), b_t.contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                                out_dtype=torch.float32)
    return (a.float() @ b_t.float().t()) * (inv_a * inv_b)


# ---- per-tensor scaling state ---------------------------------------------------------------------

def _all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        comm.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class ScalingState:
    """One FP8 tensor's amax history (``[L]``, ``[0]`` newest), scale, and this step's pending amax."""

    def __init__(self, recipe: Fp8Recipe, dtype: torch.dtype):
        self.recipe, self.dtype, self.fp8_max = recipe, dtype, FP8_MAX[dtype]
        self.amax_history = torch.zeros(recipe.fp8_amax_history_len)
        self.scale = torch.ones(())
        self.pending = torch.zeros(())  # max |x| seen since the last update (over microbatches)

    def observe(self, amax: torch.Tensor) -> None:
        a = amax.detach().float().cpu()
        # a non-finite amax must reach the history (it keeps the scale there, as the recipe says)
        self.pending = torch.where(torch.isfinite(a) & torch.isfinite(self.pending),
                                   torch.maximum(self.pending, a), torch.full((), float("inf")))

    def amax_for_scale(self) -> torch.Tensor:
        if self.recipe.fp8_amax_compute_algo == "max":
            return self.amax_history.max()
        return self.amax_history[0]

    def record(self, amax: torch.Tensor) -> None:
        """End of step: shift the history, insert ``amax`` at ``[0]``, recompute the next step's scale."""
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = amax
        self.scale = compute_scale(self.amax_for_scale(), self.scale, self.fp8_max, self.recipe.fp8_margin)
        self.pending = torch.zeros(())

    def scale_for(self, x: torch.Tensor, group) -> torch.Tensor:
        """The scale to cast ``x`` with now (and its amax observed for the delayed update)."""
        amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        if self.recipe.fp8_recipe == "tensorwise":
            if self.recipe.reduce_amax:
                amax = _all_reduce_max(amax.clone(), group)
            self.scale = compute_scale(amax.cpu(), self.scale, self.fp8_max, self.recipe.fp8_margin)
            return self.scale.to(x.device)
        self.observe(amax)
        return self.scale.to(x.device)


class Fp8LinearState:
    """The three scaling states of one linear layer; calling it runs the FP8 linear (the layer's hook)."""

    def __init__(self, recipe: Fp8Recipe, name: str = "", group=None):
        self.name, self.recipe = name, recipe
        self.states = {r: ScalingState(recipe, recipe.dtype(r)) for r in ROLES}
        self.group = group if recipe.reduce_amax else None  # the amax-reduction group (tensor x data parallel)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store=None) -> torch.Tensor:
        """``store``: the layer's :class:`~megatronish.parallel.weight_grad.WeightGradStore` while a zero-bubble
        schedule runs (the weight and bias gradients then wait for ``W``), else None."""
        if not _FP8_ENABLED[0]:
            return linear(x, weight, bias, store)
        return _Fp8Linear.apply(x, weight, bias, self, store)


def _fp8_weight_grads(gq, sg, xq, sx, g2, dtype, has_bias: bool) -> tuple:
    """The weight gradient from the fp8 ``grad_output`` and input (and the bias's from the unquantized one)."""
    dw = fp8_matmul(gq.t().contiguous(), sg, xq.t().contiguous(), sx).to(dtype)  # [out, in]
    return (dw, g2.sum(0)) if has_bias else (dw,)


class _Fp8Linear(torch.autograd.Function):
    """forward: ``q(x) @ q(w)^T + b`` with fp8 casts; backward: dgrad/wgrad from ``q(grad_output)`` and the
    saved fp8 input and weight; bias grad from the fp32 ``grad_output``. Under a deferring ``store`` (the split
    backward's ``B``) the backward computes dgrad only and queues the wgrad and bias grad for ``W``, from the same
    quantized tensors (``grad_output``'s scale is taken, and its amax observed, in ``B``): bitwise the same."""

    @staticmethod
    def forward(ctx, x, weight, bias, st: Fp8LinearState, store=None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [s*b, in]
        sx = st.states["input"].scale_for(x2, st.group)
        sw = st.states["weight"].scale_for(weight, st.group)
        xq, wq = quantize(x2, sx, st.recipe.dtype("input")), quantize(weight, sw, st.recipe.dtype("weight"))
        out = fp8_matmul(xq, sx, wq, sw).to(x.dtype)  # [s*b, out]
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.st, ctx.shape, ctx.has_bias, ctx.store = st, shape, bias is not None, store
        ctx.params = (weight, bias) if bias is not None else (weight,)  # the parameters themselves, for W
        ctx.dtypes = (x.dtype, weight.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq, sx, sw = ctx.saved_tensors
        st = ctx.st
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [s*b, out]
        sg = st.states["grad_output"].scale_for(g2, st.group)
        gq = quantize(g2, sg, st.recipe.dtype("grad_output"))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_matmul(gq, sg, wq.t().contiguous(), sw).to(ctx.dtypes[0]).view(ctx.shape)  # [s*b, in]
        if ctx.needs_input_grad[1] and ctx.store is not None and ctx.store.deferring:
            g_bias, dtype, has_bias = (g2 if ctx.has_bias else None), ctx.dtypes[1], ctx.has_bias  # not ctx itself
            ctx.store.put(ctx.params, lambda: _fp8_weight_grads(gq, sg, xq, sx, g_bias, dtype, has_bias))
            return dx, None, None, None, None
        if ctx.needs_input_grad[1]:
            dw = _fp8_weight_grads(gq, sg, xq, sx, g2, ctx.dtypes[1], False)[0]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db, None, None


# ---- model-level switch ---------------------------------------------------------------------------
_FP8_ENABLED = [True]


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True):
    """Turn the FP8 linears of every :func:`enable_fp8` model on or off inside the block (e.g. an fp32
    evaluation); amaxes are only observed while on."""
    prev = _FP8_ENABLED[0]
    _FP8_ENABLED[0] = enabled
    try:
        yield
    finally:
        _FP8_ENABLED[0] = prev


def _is_parallel_linear(m) -> bool:
    from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
    return isinstance(m, (ColumnParallelLinear, RowParallelLinear))


class Fp8Manager:
    """Owns the FP8 states of a model's linears (keyed by global layer name); Stateful."""

    def __init__(self, recipe: Fp8Recipe, linears: dict[str, object], group=None):
        self.recipe = recipe
        self.linears = linears  # global name -> layer (its ``fp8`` hook is an Fp8LinearState)
        self.group = group if recipe.reduce_amax else None  # the amax-reduction group

    def states(self):
        for name, layer in self.linears.items():
            for role, s in layer.fp8.states.items():
                yield f"{name}.{role}", s

    def update(self) -> None:
        """End of an optimizer step (every rank, same order): max-reduce all pending amaxes in one
        collective over the amax-reduction group, then record them and compute the next scales."""
        if self.recipe.fp8_recipe == "tensorwise":
            return
        states = [s for _, s in self.states()]
        if not states:
            return
        amaxes = torch.stack([s.pending for s in states])
        group = self.group
        if group is not None:
            amaxes = _all_reduce_max(amaxes.to(_collective_device()), group).cpu()
        for s, a in zip(states, amaxes):
            s.record(a)

    def state_dict(self) -> dict:
        out = {"recipe": dict(vars(self.recipe))}
        for key, s in self.states():
            out[f"{key}.amax_history"] = s.amax_history.clone()
            out[f"{key}.scale"] = s.scale.clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        for key, s in self.states():
            hist = state[f"{key}.amax_history"]
            if hist.shape != s.amax_history.shape:
                raise ValueError(f"{key}: saved amax history length {hist.numel()} != "
                                 f"--fp8-amax-history-len {s.amax_history.numel()}")
            s.amax_history = hist.clone().float().cpu()
            s.scale = state[f"{key}.scale"].clone().float().cpu()
            s.pending = torch.zeros(())


def _collective_device() -> torch.device:
    from .. import device
    return device.current_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def enable_fp8(model: torch.nn.Module, recipe: Fp8Recipe) -> Fp8Manager:
    """Run the column/row-parallel linears inside the model's transformer layers in FP8 (the embedding and
    output layer stay in high precision, as in Megatron). Returns the manager to ``update()`` every step.
    Amaxes are reduced over the amax-reduction group of the model's parallel context (``model.parallel``)."""
    from ..model.transformer import TransformerLayer
    global_name = getattr(model, "global_name", lambda n: n)
    parallel = getattr(model, "parallel", None)
    group = parallel.amax_reduction_group() if parallel is not None else None
    linears = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, TransformerLayer):
            continue
        for sub, lin in module.named_modules():
            if _is_parallel_linear(lin):
                name = global_name(f"{prefix}.{sub}.weight")[: -len(".weight")]
                lin.fp8 = Fp8LinearState(recipe, name, group)
                linears[name] = lin
    if not linears:
        raise ValueError("enable_fp8: the model has no parallel linear layers inside transformer layers")
    return Fp8Manager(recipe, linears, group)


def disable_fp8(model: torch.nn.Module) -> None:
    for m in model.modules():
        if _is_parallel_linear(m):
            m.fp8 = None


# ---- Transformer Engine selection -----------------------------------------------------------------
_TE_ERROR = ("--transformer-impl transformer_engine needs Transformer Engine with CUDA; {why}. "
             "Install it on a CUDA machine (pip install megatronish[te]) or use --transformer-impl local")


def import_transformer_engine():
    """``transformer_engine.pytorch``, imported only when asked for; a ConfigError naming the flag when
    Transformer Engine or CUDA is missing."""
    from .. import device
    if not device.cuda_available() or device.device_type() != "cuda":
        raise ConfigError(_TE_ERROR.format(why="no CUDA device is available"))
    try:
        import transformer_engine.pytorch as te  # GPU-only, lazy by design
    except Exception as e:  # ImportError or a broken CUDA build
        raise ConfigError(
            _TE_ERROR.format(why=f"importing transformer_engine failed ({type(e).__name__}: {e})")) from None
    return te


def check_transformer_impl(transformer_impl: str) -> str:
    """Validate ``--transformer-impl``. ``local`` is this package's layers (FP8 emulated when asked for);
    ``transformer_engine`` runs the transformer layers' linears through TE (``precision/te_layers.py``) and
    needs TE with CUDA: without them one ConfigError naming the flag (never a silent fallback to local)."""
    if transformer_impl == "local":
        return "local"
    if transformer_impl != "transformer_engine":
        raise ConfigError(f"--transformer-impl {transformer_impl!r}: choose local or transformer_engine")
    import_transformer_engine()
    return "transformer_engine"


__all__ = ["Fp8Recipe", "Fp8Manager", "Fp8LinearState", "ScalingState", "enable_fp8", "disable_fp8",
           "fp8_autocast", "quantize", "dequantize", "compute_scale", "fp8_matmul", "relative_precision",
           "import_transformer_engine", "check_transformer_impl", "E4M3", "E5M2", "FP8_MAX"]

