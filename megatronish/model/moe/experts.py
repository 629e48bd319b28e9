"""This rank's experts: all their weights stacked in two tensors, run as one grouped GEMM.

Global description (:class:`~megatronish.parallel.init.TensorDesc` with ``expert=True``):

* ``linear_fc1.weight``: ``[E, 2F, h]`` with SwiGLU (each expert's rows ``[gate; up]``), else ``[E, F, h]``;
* ``linear_fc2.weight``: ``[E, h, F]``.

Expert parallelism holds experts ``ep_rank * E/EP ...`` (global number = ``ep_rank * local + i``); expert tensor
parallelism splits fc1's rows (with stride 2 under SwiGLU, like the dense MLP) and fc2's columns, so fc2's output
is a partial sum over the expert-TP group (the dispatcher reduces it). The router's probability multiplies each
token's activation before fc2 (Megatron's order), so the probs' gradient flows through the experts.

Three ways to run the same weights (identical names and checkpoints):
``torch._grouped_mm`` (one kernel over all experts, where the device and shapes allow), a batched ``bmm`` over
experts padded to the largest token count (no Python loop over experts), and a sequential loop (the reference).
"""
from __future__ import annotations

import torch
from torch import nn

from ...parallel.init import TensorDesc, local_shape, set_desc
from ..mlp import activation
from ..recompute import discard_output


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands here: it needs 16-byte aligned row strides."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    return x.size(-1) % align == 0 and w.size(-1) % align == 0 and w.size(-2) % align == 0


def group_align(x: torch.Tensor) -> int:
    """The multiple each expert's token count is padded to for ``torch._grouped_mm``: on CUDA its weight-gradient
    GEMM slices the tokens as its contraction dimension, and each group's start must be 16-byte aligned (8 bf16
    rows; torch checks only the strides); on the CPU 1."""
    return 16 // x.element_size() if x.device.type == "cuda" else 1


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int], align: int = 1) -> torch.Tensor:
    """``torch._grouped_mm`` of ``x`` ``[N, in]`` (``counts[e]`` rows for expert ``e``) with each ``weight[e]^T``;
    with ``align > 1`` every group is padded with zero rows to a multiple of ``align`` first and the real rows
    taken back (the zero rows add nothing to any gradient)."""
    padded = [-(-c // align) * align for c in counts]
    offs = torch.tensor(padded, device=x.device).cumsum(0).to(torch.int32)
    if padded == counts:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    index = _rows_in_padded(counts, offs.long() - torch.tensor(padded, device=x.device), x.device)
    xp = x.new_zeros((sum(padded), x.size(1))).index_copy(0, index, x)
    return torch._grouped_mm(xp, weight.transpose(1, 2), offs=offs).index_select(0, index)


def _rows_in_padded(counts: list[int], starts: torch.Tensor, device) -> torch.Tensor:
    """The row of each of the ``sum(counts)`` rows (grouped by expert) in a layout where expert ``e``'s rows start
    at ``starts[e]``."""
    n, e = sum(counts), len(counts)
    expert = torch.repeat_interleave(torch.arange(e, device=device), torch.tensor(counts, device=device))
    first = torch.tensor([0] + counts[:-1], device=device).cumsum(0)  # each expert's first row, unpadded
    return starts[expert] + torch.arange(n, device=device) - first[expert]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], how: str = "grouped") -> torch.Tensor:
    """``x`` ``[N, in]`` (rows grouped by expert, ``counts[e]`` rows for local expert ``e``) times each
    expert's ``weight[e]^T`` (``weight``: ``[E_local, out, in]``) -> ``[N, out]``."""
    n, e = x.size(0), weight.size(0)
    # No rows (this rank's experts got no tokens): the per-expert products of empty slices. The result must
    # depend on ``x`` as well as ``weight``: the gradient then reaches the dispatcher, whose backward
    # collectives run on this rank as on every other (an empty ``[0, out]`` product gives zero weight gradients).
    if how == "sequential" or n == 0:
        outs, at = [], 0
        for i, c in enumerate(counts):
            outs.append(x[at:at + c] @ weight[i].t())
            at += c
        return torch.cat(outs)
    if how == "grouped" and _grouped_mm_ok(x, weight):
        return grouped_mm(x, weight, counts, group_align(x))
    # batched: pad every expert's rows to the largest count, one bmm, and take the real rows back
    most = max(counts)
    index = _rows_in_padded(counts, torch.arange(e, device=x.device) * most, x.device)  # in the [E * most] layout
    padded = x.new_zeros((e * most, x.size(1))).index_copy(0, index, x)
    out = torch.bmm(padded.view(e, most, -1), weight.transpose(1, 2))  # [E, most, out]
    return out.reshape(e * most, -1).index_select(0, index)


class GroupedExperts(nn.Module):
    """The local experts of one MoE layer. ``forward(x [N, h], counts, probs [N]) -> [N, h]`` (partial over
    expert-TP)."""

    def __init__(self, config, num_experts: int, ffn_hidden_size: int, output_init_std: float,
                 params_dtype=torch.float32, device=None, parallel=None):
        super().__init__()
        c = config
        self.swiglu, self.openai_gelu = c.swiglu, c.openai_gelu
        self.use_triton_kernels = c.kernels.use_triton_kernels
        self.how = "grouped" if c.moe.moe_grouped_gemm else "sequential"
        self.recompute_act = c.recompute.recomputes("moe_act")  # see forward
        etp, ep = (parallel.etp_size, parallel.ep_size) if parallel is not None else (1, 1)
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts are not divisible by expert-parallel size {ep}")
        self.num_local_experts = num_experts // ep
        fc1_rows = ffn_hidden_size * (2 if c.swiglu else 1)
        d1 = TensorDesc((num_experts, fc1_rows, c.hidden_size), 1, 2 if c.swiglu else 1, "normal",
                        c.init_method_std, expert=True)
        d2 = TensorDesc((num_experts, c.hidden_size, ffn_hidden_size), 2, 1, "normal", output_init_std,
                        expert=True)
        self.linear_fc1 = nn.Module()
        self.linear_fc2 = nn.Module()
        self.linear_fc1.weight = set_desc(nn.Parameter(torch.empty(local_shape(d1, etp, ep), dtype=params_dtype,
                                                                   device=device)), d1)
        self.linear_fc2.weight = set_desc(nn.Parameter(torch.empty(local_shape(d2, etp, ep), dtype=params_dtype,
                                                                   device=device)), d2)

    def forward(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        h = grouped_linear(x, self.linear_fc1.weight, counts, self.how)  # [N, 2F/etp] or [N, F/etp]
        # --recompute-modules moe_act: keep fc1's output and the probs, recompute the activation in backward
        h, block = discard_output(self.recompute_act and self.training,
                                  lambda fc1, p: self._activation(fc1, p, x.dtype), h, probs)
        with block:
            return grouped_linear(h, self.linear_fc2.weight, counts, self.how)  # [N, h]

    def _activation(self, h: torch.Tensor, probs: torch.Tensor, dtype) -> torch.Tensor:
        """The activation times each row's router probability, in ``dtype``: [N, .] -> [N, F/etp]."""
        h = activation(h, self.swiglu, self.openai_gelu, self.use_triton_kernels)
        return (h * probs.unsqueeze(-1)).to(dtype)
