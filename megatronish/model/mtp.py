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
from ..parallel.context import ParallelContext
from ..parallel.layers import ColumnParallelLinear
from ..parallel.mappings import gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region
from ..parallel.random import RNGStatesTracker
from .moe.layer import is_moe_layer
from .norms import build_norm
from .transformer import TransformerLayer


def shift_left(t: torch.Tensor, k: int = 1) -> torch.Tensor:
    """``t`` ``[b, s]`` shifted ``k`` positions to the left along the sequence, zeros at the end."""
    return torch.cat((t[:, k:], torch.zeros_like(t[:, :k])), dim=1)


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
        self.mtp_model_layer = TransformerLayer(mtp_layer_config(c), c.num_layers + depth, sequence_parallel,
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
        self.layers = nn.ModuleList(MTPLayer(config, k, sequence_parallel, params_dtype, device, parallel, rng_tracker)
                                    for k in range(config.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids, embedding, rotary,
                document_ids=None) -> list[torch.Tensor]:
        """Every depth's output ``[s(/t), b, h]``; ``embedding(ids, positions)`` is the model's."""
        out = []
        for layer in self.layers:
            input_ids = shift_left(input_ids)
            if position_ids is not None:
                position_ids = shift_left(position_ids)
            hidden = layer(hidden, embedding(input_ids, position_ids), rotary, document_ids)
            out.append(hidden)
        return out


def mtp_loss(losses: torch.Tensor, mask: torch.Tensor, scaling_factor: float, per_token: bool = False):
    """The multi-token-prediction term of a microbatch's loss and each depth's ``[loss sum, tokens]``.

    ``losses``: ``[1 + D, b, s]``, the decoder's per-token losses then each depth's (depth ``k``'s at position
    ``i`` predicts token ``i + k + 1``); ``mask``: the loss mask ``[b, s]``. Depth ``k`` counts the tokens of
    ``mask`` shifted ``k`` to the left; the term is ``scaling_factor / D`` times the sum of the depths' token means
    (``per_token``: their token sums, each rescaled to the decoder's token count, as Megatron does)."""
    depths = losses.size(0) - 1
    term = losses.new_zeros(())
    reports = {}
    tokens = mask.sum()
    for k in range(1, depths + 1):
        m = shift_left(mask, k)
        total, count = (losses[k].float() * m).sum(), m.sum()
        reports[f"mtp_{k} loss"] = torch.stack([total.detach(), count])
        term = term + (total * tokens / count.clamp(min=1) if per_token else total / count.clamp(min=1))
    return term * (scaling_factor / depths), reports
