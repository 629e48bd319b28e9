"""``megatronish-env`` (also ``python -m megatronish.env``): what this machine offers the package.

Three parts: the versions of Python, torch and the libraries the optional paths use (read from the installed
packages' metadata, so nothing GPU-only is imported to list them); the GPUs (memory, compute capability); and one
line per optional path of this package saying whether it runs here and, if not, why. A path is judged by a probe
where one is cheap (a tiny ``torch._grouped_mm``, a page-locked allocation, an FP8 ``_scaled_mm``) and by the
same check the package makes before using it otherwise. Transformer Engine is imported only on a CUDA machine
where it is installed, inside :func:`collect`.

    megatronish-env            # readable report
    megatronish-env --json     # the same as one JSON object
"""
from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import platform
import sys

import torch

from .. import device
from ..errors import CommandLineParser

# (label, distribution names to try): the versions the report lists.
PACKAGES = [
    ("triton", ("triton", "pytorch-triton", "pytorch-triton-rocm")),
    ("transformer_engine", ("transformer_engine", "transformer-engine", "transformer_engine_torch")),
    ("apex", ("apex",)),
    ("flash_attn", ("flash_attn", "flash-attn")),
    ("transformers", ("transformers",)),
    ("megatron_core", ("megatron-core", "megatron_core")),
]


def package_version(names) -> str | None:
    """The installed version of the first distribution of ``names`` found, None if none is installed."""
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out.update(device.accelerator_versions())
    for label, names in PACKAGES:
        out[label] = package_version(names)
    return out


def gpus() -> list[dict]:
    return [device.gpu_properties(i) for i in range(device.device_count())]


# ---- the optional paths ---------------------------------------------------------------------------------------
def _path(name: str, available: bool, detail: str) -> dict:
    return {"name": name, "available": bool(available), "detail": detail}


def _triton_path(dev: str) -> dict:
    from .. import kernels

    backend = kernels.kernels_backend(dev)
    if backend == "compiled":
        return _path("triton kernels", True, "compiled for CUDA (--use-triton-kernels, --cross-entropy-loss-fusion)")
    if backend == "interpreter":
        return _path("triton kernels", True, "interpreted (TRITON_INTERPRET=1): correct but slow; for tests")
    if not kernels.triton_importable():
        return _path("triton kernels", False, "triton is not installed (pip install -e '.[kernels]')")
    return _path("triton kernels", False, "no CUDA device (TRITON_INTERPRET=1 runs them interpreted on CPU)")


def _attention_paths(dev: str) -> list[dict]:
    from ..model.attention import resolve_attention_backend

    out = []
    flags = device.sdpa_flags()
    cap = device.capability()
    for backend, kernel in (("flash", "flash"), ("fused", "cudnn")):
        used, why = resolve_attention_backend(backend, dev)
        name = f"--attention-backend {backend}"
        if used != backend:
            out.append(_path(name, False, why))
        elif not flags[kernel]:
            out.append(_path(name, False, f"SDPA's {kernel} kernel is disabled in torch.backends.cuda"))
        elif kernel == "flash" and cap is not None and cap < (8, 0):
            out.append(_path(name, False, f"SDPA's flash kernel needs compute capability >= 8.0 (this GPU: "
                                          f"{cap[0]}.{cap[1]}); PyTorch falls back to its next kernel"))
        elif kernel == "cudnn" and not device.accelerator_versions()["cudnn"]:
            out.append(_path(name, False, "torch was built without cuDNN"))
        else:
            out.append(_path(name, True, f"SDPA's {kernel} kernel first"))
    out.append(_path("--attention-backend unfused/local", True, "SDPA's math path / explicit softmax (any device)"))
    return out


def _grouped_mm_path(dev: str) -> dict:
    name = "torch._grouped_mm (--moe-grouped-gemm)"
    if not hasattr(torch, "_grouped_mm"):
        return _path(name, False, f"torch {torch.__version__} has no torch._grouped_mm (the batched bmm runs)")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    try:
        x = torch.ones(32, 16, dtype=dtype, device=dev)
        w = torch.ones(2, 16, 16, dtype=dtype, device=dev)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=dev)
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        ok = bool(torch.all(out.float() == 16))
        return _path(name, ok, f"{dtype} probe on {dev} " + ("ran" if ok else "gave a wrong product"))
    except Exception as e:  # older GPUs, builds without the kernel
        return _path(name, False, f"{dtype} probe on {dev} failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                  "the batched bmm runs instead")


def _emulated_fp8_path(dev: str) -> dict:
    from ..precision import fp8

    mm = fp8._scaled_mm_works(torch.device(dev))
    return _path("emulated FP8 (--fp8-format, --transformer-impl local)", True,
                 "torch._scaled_mm on fp8 payloads" if mm else
                 "fp8 payloads dequantized to fp32 for the matmul (torch._scaled_mm does not run here)")


def transformer_engine_paths(dev: str) -> list[dict]:
    """Transformer Engine's layers, FP8 (delayed / current scaling) and MXFP8: installed, CUDA, and what TE itself
    says of this GPU."""
    names = ("Transformer Engine (--transformer-impl transformer_engine)", "TE FP8 (delayed, current scaling)",
             "TE MXFP8 (--fp8-recipe mxfp8)")
    version = package_version(PACKAGES[1][1])
    if version is None and importlib.util.find_spec("transformer_engine") is None:
        why = "transformer_engine is not installed (pip install megatronish[te], on a CUDA machine)"
        return [_path(n, False, why) for n in names]
    if dev != "cuda":
        why = "Transformer Engine needs CUDA (it cannot import without it)"
        return [_path(n, False, why) for n in names]
    from ..precision import te_layers

    try:
        te_layers.import_te()
    except Exception as e:
        return [_path(n, False, str(e)) for n in names]
    fp8_ok, fp8_why = te_layers.fp8_support()
    mx_ok, mx_why = te_layers.mxfp8_support()
    return [_path(names[0], True, f"transformer_engine {version or '?'} imports"),
            _path(names[1], fp8_ok, fp8_why or "supported on this GPU"),
            _path(names[2], mx_ok, mx_why or "supported on this GPU")]


def _distributed_paths(dev: str) -> list[dict]:
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_nccl_available()
    out = [_path("NCCL backend", nccl and dev == "cuda",
                 "torch.distributed has NCCL and a CUDA device" if nccl and dev == "cuda" else
                 ("no CUDA device (gloo is used)" if nccl else "torch was built without NCCL"))]
    out.append(_path("gloo backend", dist.is_available() and dist.is_gloo_available(), "CPU collectives, tests"))
    return out


def _staging_path() -> dict:
    ok, why = device.pinned_memory_works()
    return _path("pinned async-save staging (--async-save)", ok, why)


def _extension_path() -> dict:
    try:
        from .. import _C  # noqa: F401  (the compiled dataset helpers)
        return _path("C++ dataset helpers (megatronish._C)", True, "built")
    except ImportError as e:
        return _path("C++ dataset helpers (megatronish._C)", False,
                     f"not built ({e}); pip install -e . builds them (the Python fallback runs)")


def optional_paths(dev: str | None = None) -> list[dict]:
    dev = dev or device.device_type()
    out = [_triton_path(dev), *_attention_paths(dev), _grouped_mm_path(dev), _emulated_fp8_path(dev),
           *transformer_engine_paths(dev), *_distributed_paths(dev), _staging_path(), _extension_path()]
    out.append(_path("bf16", device.bf16_supported(),
                     "bf16 tensor cores" if dev == "cuda" else "runs on CPU, about 300x slower than fp32 here"))
    return out


def collect() -> dict:
    """The whole report as one JSON-able dict."""
    dev = device.device_type()
    return {"device": dev, "versions": versions(), "gpus": gpus(), "paths": optional_paths(dev)}


def format_report(report: dict) -> str:
    v = report["versions"]
    lines = ["versions:"]
    lines += [f"  {k:20s} {v[k] if v[k] is not None else '-'}" for k in v]
    lines.append(f"device: {report['device']}")
    if report["gpus"]:
        for g in report["gpus"]:
            lines.append(f"  GPU {g['index']}: {g['name']}, {g['total_memory'] / 2**30:.1f} GiB, "
                         f"compute capability {g['capability']}, {g['multiprocessors']} SMs")
    else:
        lines.append("  no GPU visible")
    lines.append("optional paths:")
    for p in report["paths"]:
        lines.append(f"  [{'yes' if p['available'] else 'no ':3s}] {p['name']}: {p['detail']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = CommandLineParser(prog="megatronish-env", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
