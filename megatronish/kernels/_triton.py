"""What every kernel module shares: the triton import, whether kernels run interpreted, output allocation,
launch sizes, and the store-side conversion to the output dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import multiprocessor_count

__all__ = ["triton", "tl", "INTERPRETED", "empty", "exact_bf16", "to_out", "num_row_programs", "pow2"]


@triton.jit
def _probe():
    pass


# Triton decides per kernel, when it is defined, whether to compile it or interpret it (TRITON_INTERPRET);
# triton.language's own helpers (tl.sum, ...) were decided when triton was first imported. Both must agree.
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
if INTERPRETED != (type(tl.sum).__name__ == "InterpretedFunction"):
    raise ImportError("TRITON_INTERPRET changed between the first import of triton and the loading of "
                      "megatronish.kernels; set (or unset) it before triton is first imported")

# Tests set this to fill every buffer a kernel allocates with NaN first, so a kernel that leaves any element
# unwritten shows up as NaN.
POISON_OUTPUTS = False


def empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def exact_bf16(dtype: torch.dtype) -> bool:
    """Round fp32 -> bf16 to nearest-even by hand: the interpreter's cast truncates, compiled kernels round
    (to nearest even) in hardware."""
    return INTERPRETED and dtype == torch.bfloat16


def _to_out(x, ptr, EXACT_BF16: tl.constexpr):
    """``x`` (fp32) converted to the element type of ``ptr``, rounded to nearest even."""
    if EXACT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(ptr.dtype.element_ty)
    return y


# A jitted helper called from an interpreted kernel costs milliseconds per call (the interpreter re-patches
# triton.language on every call); there a plain function does the same thing.
to_out = _to_out if INTERPRETED else triton.jit(_to_out)


def num_row_programs(rows: int, device: torch.device) -> int:
    """Programs for a loop over rows that also reduces over them (norm backward): a few per SM on CUDA."""
    if device.type == "cuda":
        sms = multiprocessor_count(device)
        return max(1, min(rows, 4 * sms))
    return max(1, min(rows, 4))


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
