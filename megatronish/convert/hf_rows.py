"""Where the rows of our global tensors live in the Hugging Face tensors, so that a block of one of our tensors
is read from (or written to) a Hugging Face directory without the rest of it.

The name map's ``to_ours`` only moves rows (cut, concatenate, stack, transpose, pad): run on tensors of row
*codes* instead of weights it says, for every row of our tensor, which HF tensor and which row of it the data
comes from (:func:`row_map`). A block of ours, ``offsets`` + ``shape``, is then a few runs of consecutive rows of
the sources (:func:`runs`): a tensor-parallel rank of a fused QKV weight needs, per query group, one run of
``q_proj`` rows, one of ``k_proj`` and one of ``v_proj``; of a ``[gate; up]`` weight, one run of each; of the
word embedding, its vocabulary rows (padding rows are zeros, in no file). The dimensions after the mapped ones
pass through unchanged (sliced alike on both sides), except for GPT-2's ``Conv1D`` weights, stored transposed:
there the rows of ours are columns of the source and our columns its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .name_map import Entry

# GPT-2 Conv1D weights: stored [in, out], ours [out, in] (name_map's ``_transposed`` and ``_gpt2_qkv``)
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_SHIFT = 40  # a row code: source index << _SHIFT | (row + 1); 0 is a padding row (in no source)


@dataclass(frozen=True)
class RowMap:
    """``src``/``row``: for each index of our leading ``lead`` dimensions, the source tensor (position in
    ``entry.hf``; -1 for a padding row) and its row there. ``transposed``: a GPT-2 Conv1D source."""

    entry: Entry
    src: torch.Tensor  # int64, our leading-dims shape
    row: torch.Tensor
    lead: int
    transposed: bool


@dataclass(frozen=True)
class Run:
    """``n`` consecutive rows of source ``src`` from ``row``, landing at flat position ``at`` of the block's
    leading dimensions (``src`` -1: padding, zeros)."""

    at: int
    n: int
    src: int
    row: int


def row_map(entry: Entry, src_shapes: list[tuple[int, ...]], gpt2: bool = False) -> RowMap:
    """Trace ``entry.to_ours`` on row codes (one int64 per source row: a few bytes per row, never the data)."""
    transposed = gpt2 and entry.hf[0].endswith(_CONV1D)
    codes = []
    for i, shape in enumerate(src_shapes):
        n = shape[1] if transposed else shape[0]
        code = torch.arange(1, n + 1, dtype=torch.int64) + (i << _SHIFT)
        codes.append(code.reshape(1, n) if transposed else code.reshape(n, *([1] * (len(shape) - 1))))
    out = entry.to_ours(*codes)
    lead = out.dim() - (len(src_shapes[0]) - 1)
    out = out.reshape(out.shape[:lead])
    src = torch.where(out > 0, out >> _SHIFT, -1)
    row = torch.where(out > 0, (out & ((1 << _SHIFT) - 1)) - 1, 0)
    return RowMap(entry, src, row, lead, transposed)


def runs(rm: RowMap, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[Run]:
    """The runs of source rows that make the leading dimensions of the block ``offsets`` + ``shape`` of ours
    (in the block's row-major order; a run never crosses the last leading dimension's end)."""
    box = tuple(slice(o, o + n) for o, n in zip(offsets[:rm.lead], shape[:rm.lead]))
    src, row = rm.src[box].reshape(-1).tolist(), rm.row[box].reshape(-1).tolist()
    width = shape[rm.lead - 1]
    out: list[Run] = []
    for k, (s, r) in enumerate(zip(src, row)):
        last = out[-1] if out else None
        if last is not None and k % width and s == last.src and (s < 0 or r == last.row + last.n):
            out[-1] = Run(last.at, last.n + 1, s, last.row)
        else:
            out.append(Run(k, 1, s, r))
    return out


def source_index(rm: RowMap, run: Run, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of source ``run.src`` holding ``run`` (with the block's trailing dimensions)."""
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[rm.lead:], shape[rm.lead:]))
    rows = slice(run.row, run.row + run.n)
    return (*rest, rows) if rm.transposed else (rows, *rest)


def read_block(rm: RowMap, offsets: tuple[int, ...], shape: tuple[int, ...], read, dtype: torch.dtype,
               ) -> torch.Tensor:
    """Our block ``offsets`` + ``shape`` built from ``read(hf name, index) -> tensor`` (only the runs' rows)."""
    out = torch.zeros(shape, dtype=dtype)
    flat = out.view(-1, *shape[rm.lead:])
    for run in runs(rm, offsets, shape):
        if run.src < 0:
            continue  # a padding row of the vocabulary
        part = read(rm.entry.hf[run.src], source_index(rm, run, offsets, shape))
        flat[run.at:run.at + run.n] = part.t() if rm.transposed else part
    return out


def write_block(rm: RowMap, offsets: tuple[int, ...], block: torch.Tensor, write) -> None:
    """Hand our block (at ``offsets``) to ``write(hf name, index, tensor)``, run by run (padding rows dropped)."""
    shape = tuple(block.shape)
    flat = block.reshape(-1, *shape[rm.lead:])
    for run in runs(rm, offsets, shape):
        if run.src >= 0:
            part = flat[run.at:run.at + run.n]
            write(rm.entry.hf[run.src], source_index(rm, run, offsets, shape), part.t() if rm.transposed else part)
