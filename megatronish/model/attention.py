"""Causal self-attention with grouped-query support on a fused, column-parallel QKV projection.

Fused QKV layout (Megatron's): the output dim is ``num_query_groups`` blocks, each holding that group's
``heads/groups`` query heads, then its key head, then its value head, ``kv_channels`` rows each. A
contiguous TP split along that dim gives every rank whole groups.

``--qk-layernorm`` (Megatron's): the model's norm (``--normalization``) over each query and key head
(``kv_channels`` wide) after the QKV projection and before RoPE; weights ``q_layernorm.weight`` /
``k_layernorm.weight`` ``[kv_channels]``, replicated over TP. Each TP rank normalizes only its own heads, so
their gradients are partial sums over TP, summed after backward like the sequence-parallel norm weights (as
Megatron's ``finalize_model_grads`` does for them).

The core attention follows ``--attention-backend`` (Megatron's names, :func:`resolve_attention_backend`):
``auto`` lets PyTorch's ``scaled_dot_product_attention`` pick its kernel; ``flash`` and ``fused`` put SDPA's flash
kernel, respectively its cuDNN / memory-efficient kernels, first (CUDA; PyTorch falls back to its next kernel for
a call they cannot take, e.g. a document mask); ``unfused`` is SDPA's math path; ``local`` is the explicit
``softmax(q k^T / sqrt(d) + mask) v`` with the softmax in fp32. Context-parallel attention has its own kernels.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import ParallelContext, Shared
from ..parallel.context_parallel import context_parallel_attention
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.random import RNGStatesTracker, checkpoint, tracker_or_current
from .norms import build_norm
from .rope import apply_rotary

_SDPA_PRIORITY = {"flash": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"),
                  "fused": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"),
                  "unfused": ("MATH",)}


def resolve_attention_backend(backend: str, device_type: str) -> tuple[str, str]:
    """``(backend used, why it differs)`` for ``--attention-backend backend`` on ``device_type``: ``flash`` and
    ``fused`` are CUDA kernels, elsewhere they run as ``auto`` does."""
    if backend in ("flash", "fused") and device_type != "cuda":
        return "auto", f"SDPA's {backend} kernels need CUDA (this is {device_type})"
    return backend, ""


def attention_core_kind(model_cfg, cp: int, device_type: str) -> str:
    """What the attention core keeps for its backward on ``device_type``: ``"flash"`` (q, k, v, the output and the
    fp32 log-sum-exp, no score matrix: context parallelism's block kernels; on CUDA SDPA's flash, memory-efficient
    and cuDNN kernels under ``--attention-backend auto/flash/fused``; elsewhere SDPA's flash kernel, which ``auto``
    takes without attention dropout when queries and values have one head size), ``"math"`` (SDPA's math path:
    ``unfused``, and off CUDA ``auto`` with dropout or MLA's unequal head sizes, the probabilities kept) or
    ``"local"`` (the explicit softmax). The memory report and the planner read it."""
    at = model_cfg.attention
    if cp > 1:
        return "flash"
    backend = resolve_attention_backend(at.attention_backend, device_type)[0]
    if backend in ("local", "unfused"):
        return "math" if backend == "unfused" else "local"
    same_head_size = not at.multi_latent_attention or at.qk_head_dim + at.qk_pos_emb_head_dim == at.v_head_dim
    return "flash" if device_type == "cuda" or (not at.attention_dropout and same_head_size) else "math"


def _sdpa_backends(backend: str):
    """The SDPA kernel-priority context of ``backend`` (a no-op context for ``auto``)."""
    names = _SDPA_PRIORITY.get(backend)
    if names is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, n) for n in names], set_priority=len(names) > 1)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    dropout: float = 0.0) -> torch.Tensor:
    """``--attention-backend local``: ``softmax(q k^T * scale + mask) -> dropout -> @ v`` written out, the scores
    and softmax in fp32; ``mask`` (True = attend) broadcasts to ``[b, heads, s, s]``, None = causal. ``q``
    ``[b, heads, s, d]``, ``k``/``v`` ``[b, groups, s, d]`` (grouped-query heads share their group's k/v)."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [b, heads, s, s]
    if mask is None:
        s = q.size(2)
        mask = torch.ones(s, k.size(2), dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.to(v.dtype), v)


class CoreAttention(nn.Module):
    """The part every attention variant shares: ``softmax(q k^T * softmax_scale + mask) -> dropout -> @ v`` over
    the local heads (``--attention-backend``, context parallelism, selective recompute, the generation cache).
    Subclasses make q, k, v and set ``softmax_scale``, ``heads_per_group``, ``local_groups`` and ``kv_channels``
    (the key head size, which the generation cache also uses for values)."""

    softmax_scale: float
    heads_per_group: int

    def _init_core(self, config: ModelConfig, parallel: ParallelContext | None, layer_number: int,
                   rng_tracker: RNGStatesTracker | None) -> ParallelContext:
        self.parallel = parallel = parallel or ParallelContext.single()
        self._rng = Shared(tracker_or_current(rng_tracker))  # dropout of the probabilities, replayed on recompute
        self.cp_comm_type = config.attention.cp_comm_type_of(layer_number)  # --cp-comm-type, one or per layer
        self.dropout = config.attention.attention_dropout
        self.attention_backend = config.attention.attention_backend  # resolved per call on the tensors' device
        # --recompute-modules core_attn (selective recompute's default): keep no activations of the core
        # attention (scores, softmax, dropout mask), only q, k, v; recompute it in backward with the RNG replayed.
        self.recompute_core_attention = config.recompute.recomputes("core_attn")
        return parallel

    def _attention(self, q, k, v, document_ids=None, kv_cache=None) -> torch.Tensor:
        """[b, heads, s, d] q/k/v (k/v: [b, groups, s, d]) -> [b, heads, s, d_v], through the generation cache,
        selective recompute or straight."""
        if kv_cache is not None:
            offset = kv_cache.offset
            k, v = kv_cache.append(k, v)  # [b, groups/t, offset + s, d]: the cached keys/values and this step's
            return self._cached_attention(q, k, v, offset)
        if self.recompute_core_attention and self.training:
            return checkpoint(lambda *qkv: self._core_attention(*qkv, document_ids), q, k, v, tracker=self._rng.value)
        return self._core_attention(q, k, v, document_ids)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(q k^T * scale + mask) -> dropout -> @ v``: [b, heads, s, d] -> [b, heads, s, d]; the mask is
        causal, and with ``document_ids`` ([b, s] of the whole sequence) also "same document". Under context
        parallelism ``s`` is this rank's two chunks and the keys of the whole sequence take part."""
        p = self.parallel
        if p.cp_size > 1:  # no attention dropout here (checked with the flags)
            return context_parallel_attention(q, k, v, group=p.cp_group, comm_type=self.cp_comm_type,
                                              scale=self.softmax_scale,
                                              inner_group=p.group("cp_inner"), outer_group=p.group("cp_outer"),
                                              document_ids=document_ids)
        dropout = self.dropout if self.training else 0.0
        mask = None
        if document_ids is not None:  # [b, 1, s, s]: causal and within one document (Megatron's dense mask)
            s = q.size(2)
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            mask = ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)
        # Dropout of the local heads' probabilities is inside the TP region: model-parallel RNG stream.
        rng = self._rng.value.fork() if dropout > 0 else contextlib.nullcontext()
        backend = resolve_attention_backend(self.attention_backend, q.device.type)[0]
        with rng:
            if backend == "local":
                return local_attention(q, k, v, mask, self.softmax_scale, dropout)
            with _sdpa_backends(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                      is_causal=mask is None, scale=self.softmax_scale,
                                                      enable_gqa=self.heads_per_group > 1)

    def _cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
        """Queries at positions ``offset ...`` over keys ``0 ... offset + s - 1`` (no dropout):
        [b, heads, s, d] x [b, groups, offset + s, d] -> [b, heads, s, d]."""
        s, total = q.size(2), k.size(2)
        mask = None
        if s > 1 and offset > 0:  # query i sees keys up to offset + i (SDPA's is_causal aligns top-left)
            mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s > 1 and offset == 0,
                                              scale=self.softmax_scale, enable_gqa=self.heads_per_group > 1)


class SelfAttention(CoreAttention):
    def __init__(self, config: ModelConfig, sequence_parallel: bool, output_init_std: float,
                 params_dtype=torch.float32, device=None, parallel: ParallelContext | None = None,
                 layer_number: int = 0, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        parallel = self._init_core(config, parallel, layer_number, rng_tracker)
        tp, tp_group = parallel.tp_size, parallel.tp_group
        c = config
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        self.local_groups = c.num_query_groups // tp
        self.kv_channels = c.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(c.kv_channels)
        qkv_out = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
        self.linear_qkv = ColumnParallelLinear(c.hidden_size, qkv_out, bias=c.qkv_bias, gather_output=False,
                                               sequence_parallel=sequence_parallel, init_std=c.init_method_std,
                                               params_dtype=params_dtype, device=device, tp_group=tp_group)
        self.linear_proj = RowParallelLinear(c.num_attention_heads * c.kv_channels, c.hidden_size,
                                             bias=c.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
                                             sequence_parallel=sequence_parallel, init_std=output_init_std,
                                             params_dtype=params_dtype, device=device, tp_group=tp_group)
        self.q_layernorm = self.k_layernorm = None
        if c.attention.qk_layernorm:  # grads marked for the TP all-reduce (each rank sees its own heads): see above
            self.q_layernorm = build_norm(c.normalization, c.kv_channels, c.norm_epsilon, True, params_dtype, device)
            self.k_layernorm = build_norm(c.normalization, c.kv_channels, c.norm_epsilon, True, params_dtype, device)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                document_ids: torch.Tensor | None = None, kv_cache=None):
        """``document_ids``: ``[b, s]`` of the whole sequence (``--reset-attention-mask``). ``kv_cache``
        (generation): this layer's cache (``megatronish.inference.kv_cache``); the step's keys and values are
        appended at its ``offset`` and the queries attend to every cached position."""
        qkv, _ = self.linear_qkv(x)  # [s, b, groups/t * (heads/groups + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.kv_channels)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.kv_channels)  # [s, b, heads/t, d]
        k = qkv[:, :, :, self.heads_per_group]  # [s, b, groups/t, d]
        v = qkv[:, :, :, self.heads_per_group + 1]  # [s, b, groups/t, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        ctx = self._attention(q, k, v, document_ids, kv_cache)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads/t * d]
        return self.linear_proj(ctx)  # (out, bias)
