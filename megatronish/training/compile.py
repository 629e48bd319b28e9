"""``--torch-compile`` (torchtitan's ``compile``): ``torch.compile`` each transformer layer's forward and the loss.

Each layer's ``forward`` is replaced by its compiled form (the module, its parameters' names and any FSDP2 or
recompute wrapping stay as they are: FSDP2's hooks run around the compiled forward, the recompute replays it).
The loss (:func:`~megatronish.parallel.cross_entropy.vocab_parallel_cross_entropy`) is compiled on the last
stage. Collectives inside a layer (tensor/sequence parallelism, context parallelism) are graph breaks: the
compiled regions are the computations between them. Inductor generates C++ (CPU) or Triton (CUDA) code; our own
Triton kernels (``--use-triton-kernels``, ``--cross-entropy-loss-fusion``) step aside inside compiled code, with
one warning. Without a working compiler (no C++ compiler on CPU, no Triton on CUDA, or a Python torch.compile
does not support) the run stays eager with one warning. Compilation happens during the first iteration; its time
is reported once after it.
"""
from __future__ import annotations

import importlib.util
import shutil

import torch

from ..parallel.cross_entropy import vocab_parallel_cross_entropy


def compiler_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot produce code for ``device_type`` here, or None."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python/torch build"
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "inductor needs triton on CUDA and it is not installed"
        return None
    from torch._inductor import config

    cxx = config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
    if not any(shutil.which(c) for c in names):
        return f"inductor's CPU backend needs a C++ compiler ({' or '.join(names)}) and none is on PATH"
    return None


class Compiler:
    """Compiles the model chunks' layers and loss (:meth:`apply`) and reports the compile time once."""

    def __init__(self, device_type: str, print_fn=print):
        self.print_fn = print_fn
        self.problem = compiler_problem(device_type)
        self.compiled = 0
        self.loss = False  # the loss compiled on this rank (the last pipeline stage)
        self._start = None
        self._reported = False
        if self.problem:
            print_fn(f"WARNING: --torch-compile: {self.problem}; running eager")

    def apply(self, models) -> None:
        if self.problem:
            return
        stepped_aside = False
        for m in models:
            for layer in getattr(getattr(m, "decoder", None), "layers", []):
                for sub in layer.modules():
                    if getattr(sub, "use_triton_kernels", False):
                        sub.use_triton_kernels, stepped_aside = False, True
                layer.forward = torch.compile(layer.forward)
                self.compiled += 1
            if getattr(m, "post_process", False):
                stepped_aside |= bool(m.config.kernels.cross_entropy_loss_fusion)  # the model's ModelConfig
                m.loss_function = torch.compile(vocab_parallel_cross_entropy)
                self.loss = True
        if stepped_aside:
            self.print_fn("WARNING: --torch-compile: the Triton kernels (--use-triton-kernels, "
                          "--cross-entropy-loss-fusion) step aside; inductor generates the fused code")
        self._start = _compile_seconds()

    def report(self) -> None:
        """After the first iteration: the time spent compiling (once)."""
        if self.problem or self._reported or self._start is None:
            return
        self._reported = True
        what = f"{self.compiled} transformer layers" + (" and the loss" if self.loss else "")
        self.print_fn(f"torch.compile: {what} compiled in {_compile_seconds() - self._start:.1f} s (first iteration)")


def _compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo with the forward graphs' code generation, plus the
    backward graphs' (compiled at their first backward)."""
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", {}) or {}
    return float(sum(sum(metrics.get(k, ())) for k in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")))


__all__ = ["Compiler", "compiler_problem"]
