"""Megatron's top-k router: scores, top-k, capacity dropping, load-balancing losses, expert bias.

The math follows megatron-core (``transformer/moe/router.py``, ``moe_utils.py``); docs/moe.md writes it out.
Pure functions first (testable with numbers worked out by hand), then :class:`TopKRouter`, the module.

Shapes: ``logits``/``probs``/``routing_map`` are ``[T, E]`` (tokens of this rank's micro-batch, experts);
``routing_map`` is boolean, ``probs`` is zero outside it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.context import group_size
from ...parallel.init import TensorDesc, set_desc
from ...parallel.mappings import reduce_from_tensor_model_parallel_region

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
# The names the losses are logged under (Megatron's).
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss"}


# ============================================================================================ pure functions
def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k inside the ``group_topk`` best of ``num_groups`` equal expert groups; a group's score is the sum of
    its ``topk // group_topk`` best experts' scores (DeepSeek's device/node-limited routing)."""
    t, e = scores.shape
    group_scores = scores.view(t, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    score_mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
                 choose=None):
    """``(probs [T, E], routing_map [T, E])``.

    softmax: top-k of the logits, then a softmax over the k chosen (``pre_softmax``: softmax over all experts,
    then top-k, no renormalisation). sigmoid: top-k of ``sigmoid(logits)`` (+ ``expert_bias`` for the choice
    only), the chosen scores renormalised to sum 1 when k > 1. Then times ``scaling_factor``.

    ``choose``: a fixed routing (:attr:`TopKRouter.choose`): ``choose(scores) -> [T, k]`` expert indices replace
    the top-k choice; the probabilities are computed from the scores of the chosen experts as usual."""
    def pick(scores):
        if choose is not None:
            idx = choose(scores)
            return scores.gather(1, idx), idx
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, idx = pick(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            top, idx = pick(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = pick(scores + expert_bias)
            probs = torch.gather(scores, 1, idx)
        else:
            probs, idx = pick(scores)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return routing_probs, routing_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str):
    """``(routing_map, scores)`` the load-balancing losses use: every expert's score (softmax, or sigmoid
    normalised over experts) and the plain top-k of them (no bias, groups or dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    idx = torch.topk(scores, k=topk, dim=1)[1]
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True), scores


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: float,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """``coeff * E / (k T^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e]`` — the Switch loss
    ``E * sum_e f_e P_e`` with ``f_e = tokens_e / (k T)``, ``P_e = sum_t scores / T``, where ``scores`` are this
    rank's tokens and ``tokens_per_expert``/``T`` count the whole sequence (summed over TP x CP)."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(num_tokens / num_experts * capacity_factor)``; ``num_tokens`` counts token-expert pairs (T*k)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most ``capacity`` tokens per expert: those with the highest probs (``probs``) or the earliest
    positions (``position``). With ``pad_to_capacity`` every expert takes exactly ``capacity`` tokens (the
    padding ones with probability 0)."""
    t, e = probs.shape
    capacity = expert_capacity(t * topk, e, capacity_factor)
    if capacity > t:
        keep = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        idx = torch.topk(probs, k=capacity, dim=0, sorted=False)[1]
        keep = torch.zeros_like(routing_map).scatter(0, idx, True)
    elif drop_policy == "position":
        # the first `capacity` routed tokens of each expert (then, for padding, the first unrouted ones)
        routed_rank = torch.cumsum(routing_map.int(), dim=0)
        keep = routing_map & (routed_rank <= capacity)
        if pad_to_capacity:
            free = capacity - keep.sum(dim=0, keepdim=True)
            keep = keep | (~routing_map & (torch.cumsum((~routing_map).int(), dim=0) <= free))
    else:
        raise ValueError(f"unknown token drop policy {drop_policy!r}")
    final = keep if pad_to_capacity else routing_map & keep
    return probs * final, final


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing: ``bias + rate * sign(mean - tokens)`` per expert (``tokens_per_expert``: the
    step's counts over every rank that sees different tokens)."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(mean - tokens_per_expert) * rate


class AuxLossScaler(torch.autograd.Function):
    """Forward: identity on ``x``, keeping ``aux_loss``. Backward: ``x``'s gradient unchanged, and gradient
    ``scale`` into ``aux_loss`` — so the loss takes part in the backward pass as if added to the main loss, whose
    own backward scale (``loss_scale / num_microbatches``) the training step sets on the router."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


# ============================================================================================ the module
class TopKRouter(nn.Module):
    """Gating ``[E, h]`` weight (replicated over TP; its gradient is summed over TP under sequence parallelism),
    routing, and the statistics of the current step.

    ``aux_loss_scale``: the backward scale of the load-balancing and z losses (set by the training step).
    ``stats``: the step's sums (detached, reset by :meth:`reset_stats`): each loss (``value / coeff``) summed
    over micro-batches, tokens per expert, and routed / kept token-expert pairs.
    ``choose``: None (top-k routing), or a fixed routing ``choose(scores [T, E]) -> expert indices [T, k]`` that
    replaces the top-k choice (capacity dropping and the losses still apply); tests set it to force the routing
    maps real data produces (a rank or an expert with no tokens, every token to one expert).
    """

    def __init__(self, config, sequence_parallel: bool, params_dtype=torch.float32, device=None, parallel=None):
        super().__init__()
        c = config
        self.num_experts, self.topk = c.moe.num_experts, c.moe.moe_router_topk
        self.config = c
        self.tp_group = parallel.tp_group if parallel is not None else None  # tokens of one sequence: TP x CP
        self.tp_cp_group = parallel.group("tp_cp") if parallel is not None else None
        self.tp_dp_cp_group = parallel.group("tp_dp_cp") if parallel is not None else None
        self.weight = nn.Parameter(torch.empty(c.moe.num_experts, c.hidden_size, dtype=params_dtype, device=device))
        set_desc(self.weight, TensorDesc((c.moe.num_experts, c.hidden_size), None, 1, "normal", c.init_method_std,
                                         sequence_parallel=sequence_parallel))
        self.expert_bias = None
        if c.moe.moe_router_enable_expert_bias:
            # not trained by the optimizer: updated from the step's token counts (finalize_model_grads)
            self.expert_bias = nn.Parameter(torch.zeros(c.moe.num_experts, dtype=torch.float32, device=device),
                                            requires_grad=False)
            set_desc(self.expert_bias, TensorDesc((c.moe.num_experts,), None, 1, "zeros"))
        self.aux_loss_scale = 1.0
        self.choose = None
        self.per_token = False  # --calculate-per-token-loss: each loss's gradient weighted by the token count
        self.loss_types = self._loss_types()
        self._global_tokens = None  # global_aux_loss: running sum over the step's micro-batches
        self._global_steps = 0
        self.stats: dict[str, torch.Tensor] = {}
        self.reset_stats()

    def _loss_types(self) -> dict[str, float]:
        """``{aux loss type: coeff}`` of the enabled load-balancing losses."""
        c = self.config
        types = c.moe.moe_router_load_balancing_type
        coeffs = c.moe.moe_aux_loss_coeff
        types = [types] if isinstance(types, str) else list(types)
        coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
        return {t: float(k) for t, k in zip(types, coeffs) if t in AUX_LOSS_TYPES and k > 0}

    def reset_stats(self) -> None:
        dev = self.weight.device
        self.stats = {"tokens_per_expert": torch.zeros(self.num_experts, dtype=torch.float32, device=dev),
                      "routed": torch.zeros((), dtype=torch.float32, device=dev),
                      "kept": torch.zeros((), dtype=torch.float32, device=dev)}
        for t in self.loss_types:
            self.stats[LOSS_NAMES[t]] = torch.zeros((), dtype=torch.float32, device=dev)
        if self.config.moe.moe_z_loss_coeff:
            self.stats["z_loss"] = torch.zeros((), dtype=torch.float32, device=dev)
        self._global_tokens, self._global_steps = None, 0

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe.moe_router_dtype, x.dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def _attach(self, x: torch.Tensor, loss: torch.Tensor, name: str, coeff: float) -> torch.Tensor:
        self.stats[name] += (loss / coeff).detach().float()
        if self.per_token:  # the loss times the micro-batch's tokens: x's rows on every rank of the sequence
            # (Megatron multiplies by this rank's rows only, which under TP/CP shrinks the loss by TP x CP)
            loss = loss * (x.shape[0] * group_size(self.tp_cp_group))
        return AuxLossScaler.apply(x, loss, self.aux_loss_scale)

    def forward(self, x: torch.Tensor):
        """``x``: ``[s, b, h]`` (this rank's tokens). Returns ``(probs, routing_map)``, ``[s*b, E]`` each."""
        c = self.config
        s, b = x.shape[:2]
        logits = self.gating(x).view(-1, self.num_experts)  # [T, E]
        training = self.training and torch.is_grad_enabled()  # recompute's first (no-grad) pass counts nothing
        if training and c.moe.moe_z_loss_coeff:
            coeff = c.moe.moe_z_loss_coeff / group_size(self.tp_cp_group)  # summed over TP x CP by the gradients
            logits = self._attach(logits, z_loss(logits, coeff), "z_loss", coeff)
        probs, routing_map = topk_routing(
            logits, self.topk, score_function=c.moe.moe_router_score_function, pre_softmax=c.moe.moe_router_pre_softmax,
            num_groups=c.moe.moe_router_num_groups, group_topk=c.moe.moe_router_group_topk,
            scaling_factor=c.moe.moe_router_topk_scaling_factor, expert_bias=self.expert_bias, choose=self.choose)
        routed = routing_map
        if c.moe.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, self.topk, c.moe.moe_expert_capacity_factor,
                                             c.moe.moe_token_drop_policy, c.moe.moe_pad_expert_input_to_capacity)
        if training and self.loss_types:
            probs = self._load_balancing(probs, logits, s, b)
        if training:
            with torch.no_grad():
                self.stats["tokens_per_expert"] += routing_map.sum(dim=0).float()
                self.stats["routed"] += routed.sum().float()
                self.stats["kept"] += (routed & routing_map).sum().float()
        return probs, routing_map

    def _load_balancing(self, probs, logits, s: int, b: int):
        c, k, e = self.config, self.topk, self.num_experts
        aux_map, scores = aux_loss_scores(logits, k, c.moe.moe_router_score_function)
        if "aux_loss" in self.loss_types:
            coeff = self.loss_types["aux_loss"]
            tokens = reduce_from_tensor_model_parallel_region(aux_map.sum(dim=0).float(), self.tp_cp_group)
            total = aux_map.shape[0] * group_size(self.tp_cp_group)
            loss = switch_load_balancing_loss(scores, tokens, total, k, e, coeff)
            probs = self._attach(probs, loss, LOSS_NAMES["aux_loss"], coeff)
        if "seq_aux_loss" in self.loss_types:
            # one loss per sequence: the batch dim becomes part of the expert dim, then the sum is / b
            coeff = self.loss_types["seq_aux_loss"]
            seq_scores, seq_map = scores.reshape(s, -1), aux_map.reshape(s, -1)
            tokens = reduce_from_tensor_model_parallel_region(seq_map.sum(dim=0).float(), self.tp_cp_group)
            total = s * group_size(self.tp_cp_group)
            loss = switch_load_balancing_loss(seq_scores, tokens, total, k, e, coeff) / b
            probs = self._attach(probs, loss, LOSS_NAMES["seq_aux_loss"], coeff)
        if "global_aux_loss" in self.loss_types:
            # tokens per expert over the data-parallel batch, averaged over the step's micro-batches so far
            coeff = self.loss_types["global_aux_loss"]
            tokens = reduce_from_tensor_model_parallel_region(aux_map.sum(dim=0).float(), self.tp_dp_cp_group)
            self._global_tokens = tokens if self._global_tokens is None else self._global_tokens + tokens
            self._global_steps += 1
            total = aux_map.shape[0] * group_size(self.tp_dp_cp_group)
            loss = switch_load_balancing_loss(scores, self._global_tokens / self._global_steps, total, k, e,
                                              coeff)
            probs = self._attach(probs, loss, LOSS_NAMES["global_aux_loss"], coeff)
        return probs
