"""Multi-latent attention (DeepSeek-V2/V3; ``--multi-latent-attention``), Megatron's ``MLASelfAttention``.

Per token ``x`` ``[h]`` and head ``i`` (``n`` heads; ``d_nope`` = ``--qk-head-dim``, ``d_rope`` =
``--qk-pos-emb-head-dim``, ``d_v`` = ``--v-head-dim``, ``r_q``/``r_kv`` = ``--q-lora-rank``/``--kv-lora-rank``)::

    q_i           = W_q_up  norm_q(W_q_down x)      (or W_q x with --q-lora-rank unset)    [d_nope + d_rope]
    c, k_rope     = W_kv_down x                                                           [r_kv], [d_rope]
    k_nope_i, v_i = W_kv_up norm_kv(c)                                                    [d_nope], [d_v]
    k_i           = [k_nope_i ; rope(k_rope)]   (the RoPE key is shared by all heads)
    q_i           = [q_nope_i ; rope(q_rope_i)]
    out           = W_proj [softmax(q_i k_i^T * scale + causal) v_i  for each i]

``scale = 1 / sqrt(d_nope + d_rope)``, times ``mscale(factor, --mscale-all-dim)^2`` under YaRN. The norms exist
with ``--qk-layernorm`` (as in Megatron-LM's layer specs; DeepSeek-V3 uses them), of ``--normalization``. RoPE
uses DeepSeek's interleaved pair layout (:func:`~megatronish.model.rope.apply_rotary_interleaved`).

Parameters (global names under ``decoder.layers.<i>.self_attention.``, Megatron's): ``linear_q_down_proj.weight``
``[r_q, h]``, ``q_layernorm.weight`` ``[r_q]``, ``linear_q_up_proj.weight`` ``[n (d_nope + d_rope), r_q]`` (or
``linear_q_proj.weight`` ``[n (d_nope + d_rope), h]``), ``linear_kv_down_proj.weight`` ``[r_kv + d_rope, h]`` (rows:
the latent, then the RoPE key), ``kv_layernorm.weight`` ``[r_kv]``, ``linear_kv_up_proj.weight``
``[n (d_nope + d_v), r_kv]`` (per head: its ``k_nope`` rows, then its ``v`` rows), ``linear_proj.weight``
``[h, n d_v]``.

Tensor parallelism: the up-projections (and the full-rank query projection) are column-parallel by heads and
``linear_proj`` row-parallel, as in the standard attention. The down-projections and their norms are small and
replicated over TP (Megatron's Transformer Engine layout, ``parallel_mode="duplicated"``): without sequence
parallelism every rank computes them on the whole sequence and their gradients are complete (the up-projections'
input gradients are all-reduced, and so is the shared RoPE key's); with it, each rank computes them on its
sequence chunk, the up-projections all-gather the latents, the RoPE key is all-gathered, and the replicated
weights' gradients are partial sums over TP, marked ``sequence_parallel`` like the norms' (summed after backward).

Keys and values have different head sizes; context parallelism carries one size, so there the smaller of the two
is zero-padded to the larger (zero key channels leave the scores unchanged, zero value channels are sliced off the
output).

Generation (``kv_cache``, ``megatronish.inference.kv_cache``) caches per token only the latent ``norm_kv(c)``
``[r_kv]`` and the rotated RoPE key ``[d_rope]``, whole on every TP rank, and attends from them in one of two
exact ways. Default: up-project the cached latents to this rank's heads' ``k_nope``/``v`` at each step. With
``--cache-mla-latents`` (the cache's ``absorb``), DeepSeek's weight absorption: with ``W_UK_i``/``W_UV_i`` head
``i``'s ``k_nope``/``v`` rows of ``W_kv_up``, ``q_nope_i . k_nope_i = (W_UK_i^T q_nope_i) . norm_kv(c)`` and
``sum_j p_ij v_ij = W_UV_i (sum_j p_ij norm_kv(c_j))``, so every head attends over the one shared latent key
``[norm_kv(c) ; rope(k_rope)]`` (``r_kv + d_rope`` wide) with the query ``[W_UK_i^T q_nope_i ; rope(q_rope_i)]``
and the latent as its value, and ``W_UV_i`` maps the result to ``d_v``: no per-head key or value exists.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import ParallelContext
from ..parallel.init import TensorDesc, set_desc
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from ..parallel.random import RNGStatesTracker
from .attention import CoreAttention
from .norms import build_norm
from .recompute import discard_output
from .rope import apply_rotary_interleaved, yarn_softmax_mscale


class ReplicatedLinear(nn.Module):
    """``x W^T`` with ``W`` ``[out, in]`` whole on every TP rank; ``sequence_parallel``: its gradient is a partial
    sum over TP (the input is this rank's sequence chunk), all-reduced after backward."""

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool, init_std: float,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype, device=device))
        set_desc(self.weight, TensorDesc((output_size, input_size), None, 1, "normal", init_std,
                                         sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLASelfAttention(CoreAttention):
    recompute_contexts = None  # as TransformerLayer's: its up-projections' recompute enters TE's FP8 state

    def __init__(self, config: ModelConfig, sequence_parallel: bool, output_init_std: float,
                 params_dtype=torch.float32, device=None, parallel: ParallelContext | None = None,
                 layer_number: int = 0, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        c, a = config, config.attention
        parallel = self._init_core(c, parallel, layer_number, rng_tracker)
        tp_group = parallel.tp_group
        self.sequence_parallel = sequence_parallel
        heads = c.num_attention_heads
        self.local_heads = heads // parallel.tp_size
        self.heads_per_group, self.local_groups = 1, self.local_heads  # every head its own key/value
        self.qk_head_dim, self.rope_dim, self.v_head_dim = a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim
        self.kv_lora_rank = a.kv_lora_rank
        q_head = self.qk_head_dim + self.rope_dim
        self.kv_channels = max(q_head, self.v_head_dim)  # context parallelism's head size (both padded to it)
        self.softmax_scale = yarn_softmax_mscale(a) / math.sqrt(q_head)
        self.recompute_up_proj = c.recompute.recomputes("mla_up_proj")  # see forward
        std = c.init_method_std

        def column(in_size, out_size):
            return ColumnParallelLinear(in_size, out_size, bias=False, sequence_parallel=sequence_parallel,
                                        init_std=std, params_dtype=params_dtype, device=device, tp_group=tp_group)

        def replicated(in_size, out_size):
            return ReplicatedLinear(in_size, out_size, sequence_parallel, std, params_dtype, device)

        def norm(size):  # --qk-layernorm: the latents' norms (Megatron builds them only then)
            return build_norm(c.normalization, size, c.norm_epsilon, sequence_parallel, params_dtype, device) \
                if a.qk_layernorm else None

        self.q_lora = a.q_lora_rank is not None
        if self.q_lora:
            self.linear_q_down_proj = replicated(c.hidden_size, a.q_lora_rank)
            self.q_layernorm = norm(a.q_lora_rank)
            self.linear_q_up_proj = column(a.q_lora_rank, heads * q_head)
        else:
            self.linear_q_proj = column(c.hidden_size, heads * q_head)
        self.linear_kv_down_proj = replicated(c.hidden_size, a.kv_lora_rank + self.rope_dim)
        self.kv_layernorm = norm(a.kv_lora_rank)
        self.linear_kv_up_proj = column(a.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim))
        self.linear_proj = RowParallelLinear(heads * self.v_head_dim, c.hidden_size, bias=c.add_bias_linear,
                                             input_is_parallel=True, skip_bias_add=True,
                                             sequence_parallel=sequence_parallel, init_std=output_init_std,
                                             params_dtype=params_dtype, device=device, tp_group=tp_group)

    def _query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """``norm_q(W_q_down x)`` ``[s(/t), b, r_q]``, or ``x`` itself without ``--q-lora-rank``."""
        if not self.q_lora:
            return x
        latent = self.linear_q_down_proj(x)  # [s(/t), b, r_q]
        return latent if self.q_layernorm is None else self.q_layernorm(latent)

    def _query_up(self, latent: torch.Tensor) -> torch.Tensor:
        """[s(/t), b, r_q or h] -> [s, b, heads/t * (d_nope + d_rope)]"""
        return (self.linear_q_up_proj if self.q_lora else self.linear_q_proj)(latent)[0]

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, ...] | None = None,
                document_ids: torch.Tensor | None = None, kv_cache=None):
        """``x``: ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism); ``rotary``: the tables of
        ``--qk-pos-emb-head-dim`` (GPTModel's); the rest as :class:`~megatronish.model.attention.SelfAttention`."""
        d_nope, d_rope, d_v, heads = self.qk_head_dim, self.rope_dim, self.v_head_dim, self.local_heads
        q_latent = self._query_latent(x)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, d_rope], dim=-1)  # [s(/t), b, .]
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        if kv_cache is not None:  # generation: the latent cache (no sequence parallelism there)
            q = self._query_up(q_latent)
            s, b = q.shape[:2]
            cos, sin = rotary[0], rotary[1]
            q_nope, q_rope = q.view(s, b, heads, d_nope + d_rope).split([d_nope, d_rope], dim=-1)
            k_rope = apply_rotary_interleaved(k_rope.unsqueeze(2), cos, sin)[:, :, 0]  # [s, b, d_rope]
            ctx = self._cached(q_nope, apply_rotary_interleaved(q_rope, cos, sin), latent, k_rope, kv_cache)
            return self.linear_proj(ctx)
        # the shared RoPE key feeds every rank's heads: its gradient is summed over TP
        tp_group = self.parallel.tp_group
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, True, tp_group)  # [s, b, d_rope]
        else:
            k_rope = copy_to_tensor_model_parallel_region(k_rope, tp_group)
        # --recompute-modules mla_up_proj: keep the latents and the RoPE key, recompute q, k, v in backward
        (q, k, v), block = discard_output(self.recompute_up_proj and self.training, self._up_proj_and_rope,
                                          q_latent, latent, k_rope, rotary[0], rotary[1],
                                          contexts=self.recompute_contexts)
        s, b = k_rope.shape[:2]
        with block:
            ctx = self._attention(q, k, v, document_ids)  # [b, heads/t, s, d_v (padded)]
        if self.parallel.cp_size > 1:
            ctx = ctx[..., :d_v]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, heads * d_v)  # [s, b, heads/t * d_v]
        return self.linear_proj(ctx)  # (out, bias)

    def _up_proj_and_rope(self, q_latent, latent, k_rope, cos, sin):
        """The query and key/value up-projections and RoPE: the latents (``[s(/t), b, r_q or h]``,
        ``[s(/t), b, r_kv]``) and the RoPE key ``[s, b, d_rope]`` -> q, k, v ``[b, heads/t, s, d]`` (padded to one
        head size under context parallelism)."""
        d_nope, d_rope, d_v, heads = self.qk_head_dim, self.rope_dim, self.v_head_dim, self.local_heads
        q = self._query_up(q_latent)
        s, b = q.shape[:2]
        q = q.view(s, b, heads, d_nope + d_rope)  # [s, b, heads/t, d_nope + d_rope]
        kv = self.linear_kv_up_proj(latent)[0].view(s, b, heads, d_nope + d_v)  # [s, b, heads/t, d_nope + d_v]
        k_nope, v = kv.split([d_nope, d_v], dim=-1)
        q_nope, q_rope = q.split([d_nope, d_rope], dim=-1)
        # (the fused in-place kernel is not used on these slices)
        q_rope = apply_rotary_interleaved(q_rope, cos, sin)
        k_rope = apply_rotary_interleaved(k_rope.unsqueeze(2), cos, sin)  # [s, b, 1, d_rope]
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(s, b, heads, d_rope)), dim=-1)  # [s, b, heads/t, d_nope + d_rope]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/t, s, d]
        if self.parallel.cp_size > 1:  # one head size for keys and values: pad
            q, k, v = (F.pad(t, (0, self.kv_channels - t.size(-1))) for t in (q, k, v))
        return q, k, v

    def _cached(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                cache) -> torch.Tensor:
        """Generation: store the step's ``latent`` ``[s, b, r_kv]`` and rotated ``k_rope`` ``[s, b, d_rope]`` in
        ``cache`` at its offset and attend from every cached position (the module docstring's two ways);
        ``q_nope``/``q_rope`` ``[s, b, heads/t, .]`` (rotated). Returns ``[s, b, heads/t * d_v]``."""
        d_nope, d_v, r_kv = self.qk_head_dim, self.v_head_dim, self.kv_lora_rank
        s, b, heads = q_nope.shape[:3]
        offset = cache.offset
        (entry,) = cache.append(torch.cat((latent, k_rope), dim=-1).transpose(0, 1))  # [b, T, r_kv + d_rope]
        c, k_r = entry.split([r_kv, entry.size(-1) - r_kv], dim=-1)  # [b, T, r_kv], [b, T, d_rope]
        q_nope, q_rope = (t.permute(1, 2, 0, 3) for t in (q_nope, q_rope))  # [b, heads/t, s, .]
        if not cache.absorb:  # this rank's heads' keys and values from the cached latents
            total = c.size(1)
            kv = self.linear_kv_up_proj(c.transpose(0, 1))[0].view(total, b, heads, d_nope + d_v)  # [T, b, h/t, .]
            k_nope, v = kv.permute(1, 2, 0, 3).split([d_nope, d_v], dim=-1)  # [b, heads/t, T, .]
            k = torch.cat((k_nope, k_r.unsqueeze(1).expand(b, heads, total, k_r.size(-1))), dim=-1)
            ctx = self._cached_attention(torch.cat((q_nope, q_rope), dim=-1), k, v, offset)  # [b, h/t, s, d_v]
            return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * d_v)
        w = self.linear_kv_up_proj.weight.view(heads, d_nope + d_v, r_kv)
        w_uk, w_uv = w.split([d_nope, d_v], dim=1)  # [heads/t, d_nope, r_kv], [heads/t, d_v, r_kv]
        q = torch.cat((torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk), q_rope), dim=-1)  # [b, h/t, s, r_kv + d_rope]
        # one key/value head (the latent) for every query head: fold the heads into the query rows
        q = q.reshape(b, 1, heads * s, q.size(-1))  # [b, 1, heads/t * s, r_kv + d_rope], head-major
        k = entry.unsqueeze(1)  # [b, 1, T, r_kv + d_rope]: the cache as it is
        mask = None
        if s > 1:  # query i of every head sees keys up to offset + i
            mask = torch.ones(s, c.size(1), dtype=torch.bool, device=q.device).tril(offset).repeat(heads, 1)
        o = F.scaled_dot_product_attention(q, k, c.unsqueeze(1), attn_mask=mask, scale=self.softmax_scale)
        ctx = torch.einsum("bhsr,hvr->sbhv", o.view(b, heads, s, r_kv), w_uv)  # [s, b, heads/t, d_v]
        return ctx.reshape(s, b, heads * d_v)
