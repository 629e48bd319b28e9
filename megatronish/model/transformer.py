"""Pre-norm transformer layer and the block of this pipeline stage's layers."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import ParallelContext, Shared
from ..parallel.random import RNGStatesTracker, checkpoint, tracker_or_current
from .attention import SelfAttention
from .mla import MLASelfAttention
from .mlp import MLP
from .moe.layer import MoELayer, is_moe_layer
from .norms import build_norm
from .recompute import discard_output


def _with_bias(x, bias):
    return x if bias is None else x + bias


def _bias_dropout_add(x, bias, residual, p, training):
    return residual + F.dropout(_with_bias(x, bias), p=p, training=training)


class TransformerLayer(nn.Module):
    """``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``; ``layer_number`` is global (0-based)."""

    recompute_contexts = None  # its checkpoints' (forward, recompute) contexts: TE's FP8 state (precision/te_layers)

    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool,
                 params_dtype=torch.float32, device=None, parallel: ParallelContext | None = None,
                 rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        c = config
        self.layer_number = layer_number
        self.hidden_dropout = c.hidden_dropout
        # Megatron's scaled init for the two output projections: std / sqrt(2 * num_layers).
        out_std = c.init_method_std / math.sqrt(2.0 * c.num_layers)
        def norm():
            return build_norm(c.normalization, c.hidden_size, c.norm_epsilon, sequence_parallel, params_dtype, device,
                              c.apply_layernorm_1p)
        self.input_layernorm = norm()
        parallel = parallel or ParallelContext.single()
        attention = MLASelfAttention if c.attention.multi_latent_attention else SelfAttention
        self.self_attention = attention(c, sequence_parallel, out_std, params_dtype, device, parallel, layer_number,
                                        rng_tracker)
        self.pre_mlp_layernorm = norm()
        moe = is_moe_layer(c, layer_number)
        if moe:
            self.mlp = MoELayer(c, sequence_parallel, out_std, params_dtype, device, parallel, layer_number,
                                rng_tracker)
        else:
            self.mlp = MLP(c, sequence_parallel, out_std, params_dtype, device, parallel.tp_group)
        # --recompute-modules (selective): `layernorm` keeps the two norms' inputs, not their outputs (recomputed
        # when backward needs them); `mlp` keeps the dense MLP's input only (an MoE layer's is `moe`'s).
        self.recompute_layernorm = c.recompute.recomputes("layernorm")
        self.recompute_mlp = c.recompute.recomputes("mlp") and not moe
        self._rng = Shared(tracker_or_current(rng_tracker))

    def _mlp(self, y: torch.Tensor):
        if self.recompute_mlp and self.training:
            return checkpoint(lambda h: _with_bias(*self.mlp(h)), y, tracker=self._rng.value,
                              contexts=self.recompute_contexts), None
        return self.mlp(y)

    def forward(self, x: torch.Tensor, rotary=None, document_ids=None, inference_params=None) -> torch.Tensor:
        kv_cache = None if inference_params is None else inference_params.layer_cache(self.layer_number)
        norm = self.recompute_layernorm and self.training
        y, block = discard_output(norm, self.input_layernorm, x)
        with block:
            out, bias = self.self_attention(y, rotary, document_ids, kv_cache)
        x = _bias_dropout_add(out, bias, x, self.hidden_dropout, self.training)
        y, block = discard_output(norm, self.pre_mlp_layernorm, x)
        with block:
            out, bias = self._mlp(y)
        return _bias_dropout_add(out, bias, x, self.hidden_dropout, self.training)


class TransformerBlock(nn.Module):
    """This stage's layers (global numbers ``first_layer ...``), plus the final norm on the last stage.

    Under sequence parallelism the hidden states are sequence-sharded, so every dropout here draws from the
    model-parallel RNG stream (different per TP rank), as in Megatron; ``rng_tracker`` holds the streams (None:
    the current tracker), which full recompute replays.
    """

    recompute_contexts = None  # as TransformerLayer's

    def __init__(self, config: ModelConfig, first_layer: int, num_layers: int, post_process: bool,
                 sequence_parallel: bool, params_dtype=torch.float32, device=None,
                 parallel: ParallelContext | None = None, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        self.config = config
        self.sequence_parallel = sequence_parallel
        rng_tracker = tracker_or_current(rng_tracker)
        self._rng = Shared(rng_tracker)
        self.layers = nn.ModuleList(TransformerLayer(config, first_layer + i, sequence_parallel, params_dtype,
                                                     device, parallel, rng_tracker) for i in range(num_layers))
        self.final_layernorm = build_norm(config.normalization, config.hidden_size, config.norm_epsilon,
                                          sequence_parallel, params_dtype, device,
                                          config.apply_layernorm_1p) if post_process else None

    def _run(self, start, end, x, rotary, docs, inference_params=None):
        for layer in self.layers[start:end]:
            x = layer(x, rotary, docs, inference_params)
        return x

    def forward(self, x: torch.Tensor, rotary=None, document_ids=None, inference_params=None) -> torch.Tensor:
        """``document_ids``: ``[b, s]`` of the whole sequence (``--reset-attention-mask``), or None (causal).
        ``inference_params`` (generation, eval mode): the KV caches of the layers, keyed by global layer."""
        docs = document_ids
        c = self.config
        if inference_params is not None:
            x = self._run(0, len(self.layers), x, rotary, docs, inference_params)
            return x if self.final_layernorm is None else self.final_layernorm(x)
        dropout = self.training and (c.hidden_dropout > 0 or c.attention.attention_dropout > 0)
        tracker = self._rng.value
        rng = tracker.fork() if self.sequence_parallel and dropout else contextlib.nullcontext()
        n = len(self.layers)
        with rng:
            if c.recompute.recompute_granularity != "full" or not self.training:
                x = self._run(0, n, x, rotary, docs)
            elif c.recompute.recompute_method == "uniform":  # checkpoint every `recompute_num_layers` layers as a chunk
                k = c.recompute.recompute_num_layers
                for start in range(0, n, k):
                    x = checkpoint(lambda h, s=start: self._run(s, min(s + k, n), h, rotary, docs), x,
                                   tracker=tracker, contexts=self.recompute_contexts)
            else:  # "block": checkpoint the first `recompute_num_layers` layers of this stage one by one
                k = min(c.recompute.recompute_num_layers, n)
                for i in range(n):
                    x = checkpoint(lambda h, i=i: self._run(i, i + 1, h, rotary, docs), x, tracker=tracker,
                                   contexts=self.recompute_contexts) if i < k else self._run(i, i + 1, x, rotary, docs)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
