"""The mixture-of-experts MLP: router -> dispatcher -> local experts -> dispatcher, plus shared experts.

``MoELayer`` stands where the dense :class:`~megatronish.model.mlp.MLP` would (``--moe-layer-freq`` says which
layers) and returns ``(output, None)`` like it. Parameter names (global, under ``decoder.layers.<i>.mlp.``):
``router.weight`` ``[E, h]``, ``router.expert_bias`` ``[E]`` (with ``--moe-router-enable-expert-bias``),
``experts.linear_fc1.weight`` ``[E, 2F, h]`` / ``[E, F, h]``, ``experts.linear_fc2.weight`` ``[E, h, F]``, and with
``--moe-shared-expert-intermediate-size`` ``shared_experts.linear_fc1/linear_fc2.weight`` (a dense tensor-parallel
MLP) and ``shared_experts.gate_weight`` ``[1, h]`` (``--moe-shared-expert-gate``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...parallel.context import Shared
from ...parallel.init import TensorDesc, set_desc
from ...parallel.random import checkpoint, tracker_or_current
from ..mlp import MLP
from .dispatcher import DISPATCHERS
from .experts import GroupedExperts
from .router import TopKRouter


def is_moe_layer(config, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (0-based) is an MoE layer under ``--moe-layer-freq``: an int N
    makes every N-th layer (0, N, 2N, ...) one; a list gives 1/0 per layer."""
    if not config.moe.num_experts:
        return False
    freq = config.moe.moe_layer_freq
    if isinstance(freq, int):
        return layer_number % freq == 0
    return bool(freq[layer_number])


class SharedExperts(MLP):
    """A dense tensor-parallel MLP every token goes through; with ``gate`` its output is scaled by
    ``sigmoid(x . gate_weight)`` per token."""

    def __init__(self, config, sequence_parallel: bool, output_init_std: float, params_dtype=torch.float32,
                 device=None, tp_group=None):
        shared = config.replace(ffn_hidden_size=config.moe.moe_shared_expert_intermediate_size, check=False)
        super().__init__(shared, sequence_parallel, output_init_std, params_dtype, device, tp_group)
        self.gate_weight = None
        if config.moe.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=params_dtype, device=device))
            set_desc(self.gate_weight, TensorDesc((1, config.hidden_size), None, 1, "normal",
                                                  config.init_method_std, sequence_parallel=sequence_parallel))

    def forward(self, x):
        out, bias = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return out, bias


class MoELayer(nn.Module):
    recompute_contexts = None  # as TransformerLayer's

    def __init__(self, config, sequence_parallel: bool, output_init_std: float, params_dtype=torch.float32,
                 device=None, parallel=None, layer_number: int = 0, rng_tracker=None):
        super().__init__()
        c = config
        self.layer_number = layer_number  # global, 0-based (metrics are per layer)
        self.router = TopKRouter(c, sequence_parallel, params_dtype, device, parallel)
        self.experts = GroupedExperts(c, c.moe.num_experts, c.moe.moe_ffn_hidden_size, output_init_std, params_dtype,
                                      device, parallel)
        self.dispatcher = DISPATCHERS[c.moe.moe_token_dispatcher_type](c.moe.num_experts,
                                                                        self.experts.num_local_experts, parallel)
        self.shared_experts = None
        if c.moe.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExperts(c, sequence_parallel, output_init_std, params_dtype, device,
                                                parallel.tp_group)
        self.recompute_moe = c.recompute.recomputes("moe")  # see forward
        self.recompute_shared_experts = c.recompute.recomputes("shared_experts") and not self.recompute_moe
        self._rng = Shared(tracker_or_current(rng_tracker))  # the run's streams, for the recompute

    def forward(self, x: torch.Tensor):
        """``x``: ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism) -> ``(out [same], None)``.
        ``--recompute-modules moe`` keeps the layer's input only and runs it all again in backward (routing,
        dispatch, experts, shared experts); ``shared_experts`` does so for the shared experts alone."""
        if self.recompute_moe and self.training:
            return checkpoint(self._forward, x, tracker=self._rng.value, contexts=self.recompute_contexts), None
        return self._forward(x), None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        probs, routing_map = self.router(x)  # [T, E] each
        rows, counts, row_probs = self.dispatcher.dispatch(x.reshape(-1, h), probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, counts, row_probs)).view(s, b, h)
        if self.shared_experts is not None:
            if self.recompute_shared_experts and self.training:
                shared = checkpoint(lambda y: self.shared_experts(y)[0], x, tracker=self._rng.value,
                                    contexts=self.recompute_contexts)
            else:
                shared, _ = self.shared_experts(x)
            out = out + shared
        return out
