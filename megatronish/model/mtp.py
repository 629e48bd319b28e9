"""Multi-token prediction (DeepSeek-V3; ``--mtp-num-layers``), Megatron's ``MultiTokenPredictionBlock``.

Depth ``k = 1 .. D`` predicts the token ``k + 1`` positions ahead. With ``h^0`` the decoder's output (after its
final norm) and ``t`` the input tokens, at position ``i``::

    h'^k_i = W_eh [enorm(emb(t_{i+k})) ; hnorm(h^{k-1}_i)]          (eh_proj: [h, 2h], embedding half first)
    h^k    = final_layernorm_k(TransformerLayer_k(h'^k))               (the same RoPE positions as the decoder)
    loss_k = CE(output_layer(h^k)_i, t_{i+k+1})                        over the positions whose target exists

The embedding and the output layer are the model's own (shared); the total loss is the decoder's plus
``--mtp-loss-scaling-factor`` times the mean of the depths' losses, each a masked token mean over the loss mask
shifted ``k`` to the left (Megatron's ``process_mtp_loss``). The depths live on the last pipeline stage, which then
holds a copy of the word embedding kept equal by the embedding group (as a tied output layer is).

Tensor parallelism as Megatron's: ``eh_proj`` is column-parallel, its output gathered over TP (and scattered
back to sequence chunks under sequence parallelism) before the transformer layer. Parameters (global names):
``mtp.layers.<k-1>.{enorm,hnorm,final_layernorm}.weight``, ``mtp.layers.<k-1>.eh_proj.weight`` and
``mtp.layers.<k-1>.mtp_model_layer.*`` (a decoder layer: dense, or an MoE layer when the decoder's last layer is
one).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel import comm_log as comm
from ..parallel.context import ParallelContext, group_rank, group_size
from ..parallel.layers import ColumnParallelLinear
from ..parallel.mappings import gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region
from ..parallel.random import RNGStatesTracker
from .moe.layer import is_moe_layer
from .norms import build_norm
from .transformer import TransformerLayer


def shift_left(t: torch.Tensor, cp_group=None) -> torch.Tensor:
    """``t`` ``[b, s]`` one position to the left along the whole sequence, a zero entering at its end (Megatron's
    ``roll_tensor``). Under context parallelism (``cp_group`` of ``N > 1`` ranks) ``t`` holds this rank's chunks
    ``r`` and ``2N-1-r`` of the load-balanced split: each chunk's new last entry is the first entry of the chunk
    after it in the sequence, chunk ``r + 1`` (rank ``r + 1``'s first chunk, or this rank's second when
    ``r = N - 1``) and chunk ``2N - r`` (rank ``r - 1``'s second; none after the last chunk). One all-gather of
    every rank's two first entries brings them (every rank runs it, whatever the data)."""
    n = group_size(cp_group)
    if n == 1:
        return torch.cat((t[:, 1:], torch.zeros_like(t[:, :1])), dim=1)
    r, c = group_rank(cp_group), t.size(1) // 2
    heads = t[:, ::c].contiguous()  # [b, 2]: the first entry of each local chunk
    parts = [torch.empty_like(heads) for _ in range(n)]
    comm.all_gather(parts, heads, group=cp_group)
    after_first = parts[r + 1][:, :1] if r + 1 < n else heads[:, 1:]  # chunk r + 1's first entry  [b, 1]
    after_second = parts[r - 1][:, 1:] if r > 0 else torch.zeros_like(heads[:, 1:])  # chunk 2N - r's
    return torch.cat((t[:, 1:c], after_first, t[:, c + 1:], after_second), dim=1)


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The config an MTP depth's transformer layer is built from: an MoE layer when the decoder's last layer is
    one, else a dense one."""
    if not config.moe.num_experts:
        return config
    if is_moe_layer(config, config.num_layers - 1):
        return config.replace(moe_layer_freq=1)
    return config.replace(num_experts=None)


class MTPLayer(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj``, a transformer layer, ``final_layernorm``."""

    def __init__(self, config: ModelConfig, depth: int, sequence_parallel: bool, params_dtype=torch.float32,
                 device=None, parallel: ParallelContext | None = None, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        c = config
        parallel = parallel or ParallelContext.single()
        self.sequence_parallel, self.tp_group = sequence_parallel, parallel.tp_group

        def norm():
            return build_norm(c.normalization, c.hidden_size, c.norm_epsilon, sequence_parallel, params_dtype, device,
                              c.apply_layernorm_1p)
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = ColumnParallelLinear(2 * c.hidden_size, c.hidden_size, bias=False, gather_output=False,
                                            sequence_parallel=sequence_parallel, init_std=c.init_method_std,
                                            params_dtype=params_dtype, device=device, tp_group=parallel.tp_group)
        layer_config = mtp_layer_config(c)
        types = c.attention.cp_comm_types
        if len(types) > 1:  # --cp-comm-type per layer: depth k takes layer k's (Megatron numbers them 1 ... D)
            layer_config = layer_config.replace(cp_comm_type=types[min(depth, len(types) - 1)])
        self.mtp_model_layer = TransformerLayer(layer_config, c.num_layers + depth, sequence_parallel,
                                                params_dtype, device, parallel, rng_tracker)
        self.final_layernorm = norm()

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary, document_ids=None) -> torch.Tensor:
        """``hidden``: the previous depth's output, ``embedded``: the tokens ``k`` ahead, both ``[s(/t), b, h]``."""
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h/t]
        x = gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/t, b, h]
        return self.final_layernorm(self.mtp_model_layer(x, rotary, document_ids))


class MultiTokenPrediction(nn.Module):
    """The ``--mtp-num-layers`` depths of the last pipeline stage."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool, params_dtype=torch.float32, device=None,
                 parallel: ParallelContext | None = None, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        self.cp_group = (parallel or ParallelContext.single()).cp_group
        self.layers = nn.ModuleList(MTPLayer(config, k, sequence_parallel, params_dtype, device, parallel, rng_tracker)
                                    for k in range(config.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids, embedding, rotary,
                document_ids=None) -> list[torch.Tensor]:
        """Every depth's output ``[s(/t), b, h]``; ``embedding(ids, positions)`` is the model's. The token ids (and
        positions) move one place left per depth over the whole sequence (across the context-parallel chunks); the
        hidden states stay where they are."""
        out = []
        for layer in self.layers:
            input_ids = shift_left(input_ids, self.cp_group)
            if position_ids is not None:
                position_ids = shift_left(position_ids, self.cp_group)
            hidden = layer(hidden, embedding(input_ids, position_ids), rotary, document_ids)
            out.append(hidden)
        return out


def mtp_loss(losses: torch.Tensor, mask: torch.Tensor, scaling_factor: float, per_token: bool = False,
             cp_group=None):
    """The multi-token-prediction term of a microbatch's loss and each depth's ``[loss sum, tokens]``.

    ``losses``: ``[1 + D, b, s]``, the decoder's per-token losses then each depth's (depth ``k``'s at position
    ``i`` predicts token ``i + k + 1``); ``mask``: the loss mask ``[b, s]``. Depth ``k`` counts the tokens of
    ``mask`` shifted ``k`` to the left; the term is ``scaling_factor / D`` times the sum of the depths' token means
    (``per_token``: their token sums, each rescaled to the decoder's token count, as Megatron does). Under context
    parallelism (``cp_group``) ``losses`` and ``mask`` are this rank's chunks: the mask shifts across them and the
    token counts are the whole sequence's (summed over CP); the mean term is multiplied by CP as the decoder's is
    (the gradients are averaged over DP x CP). The reports stay this rank's."""
    depths = losses.size(0) - 1
    masks, m = [], mask
    for _ in range(depths):
        m = shift_left(m, cp_group)
        masks.append(m)
    counts = torch.stack([mask.sum()] + [m.sum() for m in masks])  # [1 + D]: the decoder's, each depth's
    totals = [(losses[k].float() * m).sum() for k, m in enumerate(masks, start=1)]
    reports = {f"mtp_{k} loss": torch.stack([t.detach(), counts[k]]) for k, t in enumerate(totals, start=1)}
    cp = group_size(cp_group)
    if cp > 1:
        counts = counts.clone()
        comm.all_reduce(counts, group=cp_group)
    term = losses.new_zeros(())
    for k, total in enumerate(totals, start=1):
        count = counts[k].clamp(min=1)
        term = term + (total * counts[0] / count if per_token else total * cp / count)
    return term * (scaling_factor / depths), reports
