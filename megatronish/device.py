"""The one place that touches ``torch.cuda``: device choice, backend choice and RNG state by device.

Everything else asks this module, so one code path runs on CPU (gloo) and CUDA (NCCL).
"""
from __future__ import annotations

import os

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def device_type() -> str:
    """``"cuda"`` when a GPU is usable (and not disabled by ``MEGATRONISH_DEVICE=cpu``), else ``"cpu"``."""
    forced = os.environ.get("MEGATRONISH_DEVICE")
    if forced:
        return forced
    return "cuda" if cuda_available() else "cpu"


def current_device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_device_for_local_rank(local_rank: int) -> None:
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def default_backend() -> str:
    """NCCL on CUDA, gloo on CPU (``--distributed-backend`` may override)."""
    return "nccl" if device_type() == "cuda" else "gloo"


def get_rng_state() -> torch.Tensor:
    """RNG state of the generator that dropout on the current device draws from."""
    if device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (the CPU one is seeded by the caller)."""
    if device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def device_name() -> str | None:
    """The accelerator's name (for MFU), None on CPU."""
    if device_type() == "cuda":
        return torch.cuda.get_device_name()
    return None


def empty_cache() -> None:
    """Return the allocator's cached, unused blocks to the device (``--empty-unused-memory-level``); CPU: none."""
    if device_type() == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory() -> None:
    """Restart the CUDA allocator's peak count (a CUDA run's activation measurement)."""
    torch.cuda.reset_peak_memory_stats()


def max_memory_allocated() -> int:
    """The CUDA allocator's peak bytes since :func:`reset_peak_memory`."""
    return torch.cuda.max_memory_allocated()


def multiprocessor_count(dev: torch.device) -> int:
    """Streaming multiprocessors of the CUDA device ``dev`` (how many programs a kernel launches)."""
    return torch.cuda.get_device_properties(dev).multi_processor_count


def record_event():
    """A CUDA event recorded on the current stream: the point that the work queued so far reaches."""
    event = torch.cuda.Event()
    event.record()
    return event


def copy_on_side_stream(pairs, after, dev: torch.device) -> None:
    """``dst.copy_(src)`` for each ``(src, dst)`` of ``pairs`` on a new stream of the CUDA device ``dev`` that first
    waits for the event ``after`` (:func:`record_event`); returns once the copies are done."""
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        stream.wait_event(after)
        for src, dst in pairs:
            dst.copy_(src, non_blocking=src.device.type == "cuda")
    stream.synchronize()


def cuda_profiler(start: bool) -> None:
    """Start or stop the CUDA profiler's capture range (``--profile`` under nsys), with NVTX ranges."""
    global _nvtx
    if start:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        _nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        _nvtx.__enter__()
    else:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        if _nvtx is not None:
            _nvtx.__exit__(None, None, None)
            _nvtx = None


_nvtx = None


# ---- facts for the environment report (megatronish.tools.env) and the device check ----------------------------
def device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_properties(index: int) -> dict:
    """Name, total memory (bytes), compute capability and SM count of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    return {"index": index, "name": p.name, "total_memory": int(p.total_memory),
            "capability": f"{p.major}.{p.minor}", "multiprocessors": int(p.multi_processor_count)}


def capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, None on CPU."""
    return torch.cuda.get_device_capability() if device_type() == "cuda" else None


def accelerator_versions() -> dict:
    """CUDA / ROCm runtime the torch build targets, NCCL and cuDNN versions (None where absent)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # a build without NCCL
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None), "nccl": nccl,
            "cudnn": cudnn}


def sdpa_flags() -> dict:
    """Which of SDPA's CUDA kernels PyTorch has enabled (flash, memory-efficient, cuDNN, math)."""
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": getattr(b, "cudnn_sdp_enabled", lambda: False)(), "math": b.math_sdp_enabled()}


def bf16_supported() -> bool:
    """bf16 tensor cores on the current CUDA device (True on CPU: the dtype runs there, slowly)."""
    return torch.cuda.is_bf16_supported() if device_type() == "cuda" else True


def pinned_memory_works() -> tuple[bool, str]:
    """Whether page-locked host memory can be allocated here (the async-save staging buffers of CUDA tensors)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device: staging buffers are plain host memory (MADV_DONTFORK mappings)"
    try:
        t = torch.empty(1024, pin_memory=True)
        return bool(t.is_pinned()), "page-locked host buffers allocate"
    except Exception as e:  # driver or container limits on locked memory
        return False, f"pin_memory failed: {type(e).__name__}: {e}"


def memory_info() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the current CUDA device, None on CPU."""
    return torch.cuda.mem_get_info() if device_type() == "cuda" else None


def max_memory_reserved() -> int:
    """The CUDA caching allocator's peak reserved bytes since :func:`reset_peak_memory`."""
    return torch.cuda.max_memory_reserved()

