"""The key/value cache of one pipeline stage's layers for generation.

Preallocated once per layer as ``[max_batch, groups/t, max_sequence, d]``: only this rank's tensor-parallel
share of the key/value heads, and only the ``num_query_groups`` key/value heads (grouped-query attention reads
each cached head for all of its query heads; nothing is expanded). A generation step hands the model
``InferenceParams``; every layer appends the step's keys and values at ``offset`` and attends to positions
``0 ... offset + s - 1``; the engine then advances ``offset`` by ``s``.
"""
from __future__ import annotations

import torch

__all__ = ["InferenceParams"]


class _LayerCache:
    """One layer's view of the cache (what :class:`~megatronish.model.attention.SelfAttention` receives)."""

    __slots__ = ("params", "key", "value")

    def __init__(self, params: "InferenceParams", key: torch.Tensor, value: torch.Tensor):
        self.params, self.key, self.value = params, key, value

    @property
    def offset(self) -> int:
        return self.params.offset

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[b, groups/t, s, d]`` at ``offset``; return the cached ``[b, groups/t, offset+s, d]``."""
        b, start, end = k.size(0), self.params.offset, self.params.offset + k.size(2)
        if end > self.key.size(2) or b > self.key.size(0):
            raise ValueError(f"the KV cache holds {self.key.size(0)} sequences of {self.key.size(2)} tokens; "
                             f"this step needs {b} of {end} (raise --inference-max-sequence-length / "
                             "--inference-max-requests)")
        self.key[:b, :, start:end] = k
        self.value[:b, :, start:end] = v
        return self.key[:b, :, :end], self.value[:b, :, :end]


class InferenceParams:
    """The caches of ``layers`` (global layer numbers) for up to ``max_batch`` sequences of ``max_sequence``
    tokens. ``offset``: tokens of every sequence already cached; ``last_logits_only``: the model's last stage
    returns the logits of the last position only (decoding without log-probs)."""

    def __init__(self, layers, *, max_batch: int, max_sequence: int, local_groups: int, kv_channels: int,
                 dtype=torch.float32, device=None):
        shape = (max_batch, local_groups, max_sequence, kv_channels)
        self.max_batch, self.max_sequence = max_batch, max_sequence
        self._layers = {n: _LayerCache(self, torch.zeros(shape, dtype=dtype, device=device),
                                       torch.zeros(shape, dtype=dtype, device=device)) for n in layers}
        self.offset = 0
        self.last_logits_only = False

    @classmethod
    def for_model(cls, model, *, max_batch: int, max_sequence: int, dtype=None, device=None) -> "InferenceParams":
        """Caches for every layer of ``model`` (a :class:`~megatronish.model.gpt.GPTModel` chunk)."""
        layers = [layer.layer_number for layer in model.decoder.layers]
        attn = model.decoder.layers[0].self_attention if layers else None
        p = next(model.parameters())
        return cls(layers, max_batch=max_batch, max_sequence=max_sequence,
                   local_groups=attn.local_groups if attn else 0, kv_channels=attn.kv_channels if attn else 0,
                   dtype=dtype or p.dtype, device=device or p.device)

    def layer_cache(self, layer_number: int) -> _LayerCache:
        return self._layers[layer_number]

    def reset(self) -> None:
        """Start new sequences (the stale entries are overwritten before they are read)."""
        self.offset = 0
        self.last_logits_only = False

    def advance(self, tokens: int) -> None:
        self.offset += tokens

    def nbytes(self) -> int:
        return sum(c.key.nbytes + c.value.nbytes for c in self._layers.values())
