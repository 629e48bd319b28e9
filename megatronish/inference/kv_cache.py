"""The key/value cache of one pipeline stage's layers for generation.

Standard attention: preallocated once per layer as ``[max_batch, groups/t, max_sequence, d]``: only this rank's
tensor-parallel share of the key/value heads, and only the ``num_query_groups`` key/value heads (grouped-query
attention reads each cached head for all of its query heads; nothing is expanded).

Multi-latent attention (``model/mla.py``): per layer and token only the compressed key/value latent (``r_kv`` =
``--kv-lora-rank`` values, after its norm) and the shared RoPE key (``d_rope`` = ``--qk-pos-emb-head-dim``
values, rotated), one tensor ``[max_batch, max_sequence, r_kv + d_rope]`` (each token's latent, then its RoPE
key: the key that absorbed attention reads whole, its first ``r_kv`` channels the value); no per-head keys or
values. The down-projection is replicated over tensor parallelism, so every TP rank caches the whole latent and
up-projects it for its own heads. ``absorb`` (``--cache-mla-latents``) makes the layer attend in the latent space
(the up-projection folded into the query and the output) instead of up-projecting the cached latents at each
step.

A generation step hands the model ``InferenceParams``; every layer appends the step's entries at ``offset`` and
attends to positions ``0 ... offset + s - 1``; the engine then advances ``offset`` by ``s``.
"""
from __future__ import annotations

import torch

__all__ = ["InferenceParams"]


class _LayerCache:
    """One layer's view of the cache: ``entries`` (``key``, ``value`` for standard attention; the latents and RoPE
    keys, one tensor, for multi-latent attention), each ``[max_batch, ..., max_sequence, ...]`` with the sequence
    at ``seq_dim``."""

    __slots__ = ("params", "entries", "seq_dim")

    def __init__(self, params: "InferenceParams", entries: tuple[torch.Tensor, ...], seq_dim: int):
        self.params, self.entries, self.seq_dim = params, entries, seq_dim

    @property
    def offset(self) -> int:
        return self.params.offset

    @property
    def key(self) -> torch.Tensor:
        return self.entries[0]

    @property
    def value(self) -> torch.Tensor:
        return self.entries[1]

    @property
    def absorb(self) -> bool:
        """Multi-latent attention attends in the latent space (``--cache-mla-latents``)."""
        return self.params.absorb

    def append(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store each of ``new`` (the layout of its entry, ``b`` sequences of ``s`` tokens) at ``offset``; return
        the cached ``offset + s`` positions of each entry."""
        d, first = self.seq_dim, self.entries[0]
        b, start = new[0].size(0), self.params.offset
        end = start + new[0].size(d)
        if end > first.size(d) or b > first.size(0):
            raise ValueError(f"the KV cache holds {first.size(0)} sequences of {first.size(d)} tokens; "
                             f"this step needs {b} of {end} (raise --inference-max-sequence-length / "
                             "--inference-max-requests)")
        out = []
        for cache, t in zip(self.entries, new):
            cache.narrow(0, 0, b).narrow(d, start, end - start).copy_(t)
            out.append(cache.narrow(0, 0, b).narrow(d, 0, end))
        return tuple(out)


class InferenceParams:
    """The caches of ``layers`` (global layer numbers) for up to ``max_batch`` sequences of ``max_sequence``
    tokens. ``offset``: tokens of every sequence already cached; ``last_logits_only``: the model's last stage
    returns the logits of the last position only (decoding without log-probs).

    Standard attention: ``local_groups`` key/value heads of ``kv_channels``. Multi-latent attention:
    ``mla_latent = (kv_lora_rank, qk_pos_emb_head_dim)``, the latent and the RoPE key of each token; ``absorb``:
    attend in the latent space."""

    def __init__(self, layers, *, max_batch: int, max_sequence: int, local_groups: int = 0, kv_channels: int = 0,
                 mla_latent: tuple[int, int] | None = None, absorb: bool = False, dtype=torch.float32,
                 device=None):
        if absorb and mla_latent is None:
            raise ValueError("absorb (--cache-mla-latents) applies to multi-latent attention's latent cache")
        if mla_latent is None:  # [b, groups/t, s, d] keys and values
            shapes, seq_dim = [(max_batch, local_groups, max_sequence, kv_channels)] * 2, 2
        else:  # [b, s, r_kv + d_rope]: the latents, then the RoPE keys
            shapes, seq_dim = [(max_batch, max_sequence, sum(mla_latent))], 1
        self.max_batch, self.max_sequence = max_batch, max_sequence
        self.mla_latent, self.absorb = mla_latent, absorb
        self._layers = {n: _LayerCache(self, tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes),
                                       seq_dim) for n in layers}
        self.offset = 0
        self.last_logits_only = False

    @classmethod
    def for_model(cls, model, *, max_batch: int, max_sequence: int, cache_mla_latents: bool = False, dtype=None,
                  device=None) -> "InferenceParams":
        """Caches for every layer of ``model`` (a :class:`~megatronish.model.gpt.GPTModel` chunk): latent caches
        for multi-latent attention (``cache_mla_latents``: attend in the latent space), else keys and values."""
        layers = [layer.layer_number for layer in model.decoder.layers]
        attn = model.decoder.layers[0].self_attention if layers else None
        a = model.config.attention
        if cache_mla_latents and not a.multi_latent_attention:
            raise ValueError("cache_mla_latents (--cache-mla-latents) needs a multi-latent-attention model")
        kw = {}
        if a.multi_latent_attention:
            kw = dict(mla_latent=(a.kv_lora_rank, a.qk_pos_emb_head_dim), absorb=cache_mla_latents)
        elif attn is not None:
            kw = dict(local_groups=attn.local_groups, kv_channels=attn.kv_channels)
        p = next(model.parameters())
        return cls(layers, max_batch=max_batch, max_sequence=max_sequence, dtype=dtype or p.dtype,
                   device=device or p.device, **kw)

    def layer_cache(self, layer_number: int) -> _LayerCache:
        return self._layers[layer_number]

    def reset(self) -> None:
        """Start new sequences (the stale entries are overwritten before they are read)."""
        self.offset = 0
        self.last_logits_only = False

    def advance(self, tokens: int) -> None:
        self.offset += tokens

    def nbytes(self) -> int:
        """Bytes of every layer's cache tensors."""
        return sum(t.nbytes for c in self._layers.values() for t in c.entries)
