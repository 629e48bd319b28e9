"""Fused Triton kernels for the memory-bound pieces of a layer: RMSNorm/LayerNorm, RoPE, SwiGLU and the
vocab-parallel cross entropy (docs/kernels.md).

Where they run:

- on CUDA with ``triton`` importable: compiled;
- on CPU with ``TRITON_INTERPRET=1`` set (before the kernels are first used): the same kernels through
  Triton's interpreter, slowly; this is how they are tested without a GPU;
- anywhere else they are unavailable, and asking for them (``--use-triton-kernels``,
  ``--cross-entropy-loss-fusion``) is one configuration error, raised before any process group starts.

This module imports without ``triton``; the kernel modules (``fused_norms``, ``fused_rope``, ``fused_swiglu``,
``fused_cross_entropy``) import it and are loaded only when a fused op is first called.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import ConfigError

__all__ = ["triton_importable", "interpreter_enabled", "kernels_backend", "check_kernels_available",
           "rms_norm", "layer_norm", "apply_rotary_", "swiglu", "vocab_parallel_cross_entropy"]

_TRUE = ("1", "true", "on", "yes")


def triton_importable() -> bool:
    """Whether the ``kernels`` extra (``triton``) is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET`` is set: Triton runs kernels in its interpreter, on the host."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def kernels_backend(device_type: str | None = None) -> str | None:
    """``"compiled"`` (CUDA + triton), ``"interpreter"`` (``TRITON_INTERPRET=1`` + triton) or None (not usable
    on ``device_type``, default: this process's device)."""
    if not triton_importable():
        return None
    if interpreter_enabled():
        return "interpreter"
    if device_type is None:
        from .. import device  # the one place that asks torch.cuda

        device_type = device.device_type()
    return "compiled" if device_type == "cuda" else None


def check_kernels_available(flags: list[str] | tuple[str, ...], device_type: str | None = None) -> str:
    """Return the backend the fused kernels will use, or raise one :class:`ConfigError` naming ``flags``
    and the fix."""
    backend = kernels_backend(device_type)
    if backend is not None:
        return backend
    shown = " and ".join(flags)
    if not triton_importable():
        why = "triton is not installed (install the kernels extra: pip install -e '.[kernels]')"
    else:
        why = ("there is no CUDA device; set TRITON_INTERPRET=1 to run the same kernels on CPU through "
               "Triton's interpreter (slow: for testing)")
    raise ConfigError(f"{shown}: the fused Triton kernels need triton and a CUDA device, or TRITON_INTERPRET=1; "
                      f"{why}, or drop the flag")


def _require(x: torch.Tensor) -> None:
    """A clear error instead of a Triton crash when a kernel is called where it cannot run."""
    from ._triton import INTERPRETED

    if x.device.type == "cuda" or INTERPRETED:
        return
    if interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET=1 was set after megatronish.kernels loaded its kernels; set it "
                           "before the first fused op runs (e.g. in the environment of the process)")
    raise RuntimeError(f"the fused Triton kernels need CUDA tensors (got {x.device.type}) or TRITON_INTERPRET=1")


# ---- the fused ops (lazy: the kernel modules import triton) ------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (as ``F.rms_norm``)."""
    _require(x)
    from .fused_norms import rms_norm as fn

    return fn(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (as ``F.layer_norm``)."""
    _require(x)
    from .fused_norms import layer_norm as fn

    return fn(x, weight, bias, eps)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE applied in place to ``x`` ``[s, b, heads, d]`` (first ``cos.size(-1)`` channels);
    returns ``x``."""
    _require(x)
    from .fused_rope import apply_rotary_ as fn

    return fn(x, cos, sin)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate, up]`` along the last dimension (``[..., 2f] -> [..., f]``)."""
    _require(h)
    from .fused_swiglu import swiglu as fn

    return fn(h)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 group=None) -> torch.Tensor:
    """Fused :func:`megatronish.parallel.cross_entropy.vocab_parallel_cross_entropy` (same loss, same
    all-reduces); the logits' memory receives their gradient in backward."""
    _require(vocab_parallel_logits)
    from .fused_cross_entropy import vocab_parallel_cross_entropy as fn

    return fn(vocab_parallel_logits, target, label_smoothing, vocab_size, group)
