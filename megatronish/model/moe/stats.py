"""Per-step bookkeeping of the MoE layers: the aux-loss backward scale, expert-bias updates, and metrics.

The training step calls, on every rank: :func:`start_step` before the forward passes, :func:`update_expert_biases`
after the gradients are reduced, and :func:`step_metrics` at the end (its reductions are collective).

Metrics follow Megatron's ``track_moe_metrics``: each loss is logged as ``loss / coeff``, summed over the step's
micro-batches and divided by their number, summed over pipeline stages (each holds its layers) and over the
ranks that split one sequence (TP x CP; the global loss over TP x DP x CP), averaged over data parallelism, and
averaged over the MoE layers. The z-loss, a mean over each rank's tokens, is averaged over all ranks (Megatron
logs one rank's value), so the logged numbers do not depend on the layout. ``--moe-per-layer-logging`` adds
every layer's value. Added here: tokens per expert over the whole step (min, max, and the worst layer's max/mean
imbalance) and the fraction of token-expert assignments dropped by the capacity limit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel import comm_log as comm
from ...parallel.context import group_size
from .router import LOSS_NAMES, updated_expert_bias


def moe_layers(chunks) -> list:
    """The MoE layers of this rank's model chunks (DDP-wrapped or not), in order."""
    from .layer import MoELayer

    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def start_step(chunks, aux_loss_scale: float, per_token: bool = False) -> None:
    """Reset every router's step statistics and set the backward scale of its losses (the main loss's:
    ``loss_scale / num_microbatches``, or ``loss_scale`` under ``--calculate-per-token-loss``, where each loss
    is also weighted by the micro-batch's token count, as Megatron does: the gradients are divided by the global
    batch's token count afterwards). The count is the whole micro-batch's, also when TP x CP split its sequences
    (Megatron takes one rank's share there, so its aux losses shrink by TP x CP in that mode)."""
    for layer in moe_layers(chunks):
        layer.router.reset_stats()
        layer.router.aux_loss_scale = aux_loss_scale
        layer.router.per_token = per_token


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        comm.all_reduce(t, op=op, group=group)
    return t


def update_expert_biases(chunks, parallel) -> None:
    """Aux-loss-free balancing: each router's expert bias moves by ``rate * sign(mean - tokens)`` from the step's
    tokens per expert summed over every rank that sees different tokens (TP x DP x CP; one all-reduce for all
    layers of this rank)."""
    routers = [layer.router for layer in moe_layers(chunks) if layer.router.expert_bias is not None]
    if not routers:
        return
    tokens = torch.stack([r.stats["tokens_per_expert"] for r in routers])  # [layers, E]
    tokens = _all_reduce(tokens, parallel.group("tp_dp_cp"))
    with torch.no_grad():
        for r, t in zip(routers, tokens):
            r.expert_bias.copy_(updated_expert_bias(t, r.expert_bias, r.config.moe.moe_router_bias_update_rate))


def loss_names(config) -> list[str]:
    """The MoE losses a model with ``config`` logs, in a fixed order (every rank builds the same list)."""
    types = config.moe.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else list(types)
    coeffs = config.moe.moe_aux_loss_coeff
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    names = [LOSS_NAMES[t] for t, k in zip(types, coeffs) if t in LOSS_NAMES and k > 0]
    return names + (["z_loss"] if config.moe.moe_z_loss_coeff else [])


def step_metrics(chunks, parallel, config, num_microbatches: int) -> dict:
    """This step's MoE metrics (collective over the whole world; every rank gets the same numbers):
    ``{name: mean over MoE layers}``, ``{name}_layers`` (per global layer, None for dense layers),
    ``tokens_per_expert_min``/``_max``, ``expert_imbalance`` and ``dropped_token_fraction``."""
    from .layer import is_moe_layer

    layers = moe_layers(chunks)
    nl, e = config.num_layers, config.moe.num_experts
    dev = layers[0].router.weight.device if layers else torch.device("cpu")
    names = loss_names(config)
    losses = torch.zeros(len(names), nl, dtype=torch.float32, device=dev)
    tokens = torch.zeros(nl, e, dtype=torch.float32, device=dev)
    counts = torch.zeros(nl, 2, dtype=torch.float32, device=dev)  # routed, kept
    for layer in layers:
        st, i = layer.router.stats, layer.layer_number
        if i >= nl:  # a multi-token-prediction depth's layer: not among the decoder's per-layer metrics
            continue
        for j, name in enumerate(names):
            losses[j, i] = st[name]
        tokens[i] = st["tokens_per_expert"]
        counts[i] = torch.stack([st["routed"], st["kept"]])
    pp = parallel.pp_group
    for t in (losses, tokens, counts):
        _all_reduce(t, pp)  # each stage filled its own layers
    sequence, everything = parallel.group("tp_cp"), parallel.group("tp_dp_cp")
    for j, name in enumerate(names):
        row = losses[j]
        if name == LOSS_NAMES["global_aux_loss"]:
            _all_reduce(row, everything)
            continue
        _all_reduce(row, sequence)
        if name == "z_loss":  # each rank's mean over its tokens: averaged (Megatron logs one rank's value)
            row /= group_size(sequence)
        if group_size(parallel.dp_group) > 1:
            _all_reduce(row, parallel.dp_group)
            row /= group_size(parallel.dp_group)
    _all_reduce(tokens, everything)
    _all_reduce(counts, everything)
    moe = [i for i in range(nl) if is_moe_layer(config, i)]
    out: dict = {}
    losses = (losses / num_microbatches).tolist()
    for j, name in enumerate(names):
        out[name] = sum(losses[j][i] for i in moe) / len(moe)
        out[f"{name}_layers"] = [losses[j][i] if i in moe else None for i in range(nl)]
    t = tokens[moe]
    if t.sum() > 0:
        out["tokens_per_expert_min"] = float(t.min())
        out["tokens_per_expert_max"] = float(t.max())
        out["expert_imbalance"] = float((t.max(dim=1).values / t.mean(dim=1).clamp_min(1e-9)).max())
        routed, kept = counts[moe].sum(dim=0).tolist()
        out["dropped_token_fraction"] = 1.0 - kept / routed if routed else 0.0
    return out
