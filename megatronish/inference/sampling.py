"""Choosing the next token from the logits of the last position (Megatron's rules).

``top_k == 1``: greedy (argmax). Otherwise the logits are divided by ``temperature``, then filtered to the
``top_k`` largest (``top_k > 1``) or to the smallest set whose probability reaches ``top_p``
(``0 < top_p <= 1``; the most likely token always stays), and a token is drawn with ``generator``.
``top_k`` and ``top_p`` together are refused, as Megatron's server does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 1: greedy; 0: no top-k filter
    top_p: float = 0.0  # 0: no nucleus filter
    seed: int = 1234

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k > 1 and self.top_p > 0:
            raise ValueError("top_k and top_p cannot both be set; choose one")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """``logits`` ``[b, V]`` (the true vocabulary) -> next tokens ``[b]`` (int64)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 1:
        kth = torch.topk(logits, min(params.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum > params.top_p
        drop[:, 1:] = drop[:, :-1].clone()  # keep the token that crosses top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
