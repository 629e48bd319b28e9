"""``--mock-data``: a deterministic, learnable synthetic corpus.

Sample ``i`` depends only on ``(seed, i)``, so every parallel layout sees the same global batch. Each sample
walks a fixed random cycle through the vocabulary (the next token is a function of the current one) from a
random start, with 10% of the tokens replaced by random ones: a model can learn it, so the loss falls.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["MockGPTDataset"]


def _sample_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"mock|{seed}|{index}".encode()).digest()[:8], "little") >> 1


class MockGPTDataset:
    """Items are dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (each ``[seq_length]``)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, num_samples: int = 2**62,
                 noise: float = 0.1):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.num_samples, self.noise = num_samples, noise
        self.cycle = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(_sample_seed(self.seed, index))
        n = self.seq_length + 1
        start = int(torch.randint(self.vocab_size, (1,), generator=g))
        text = self.cycle[(start + torch.arange(n)) % self.vocab_size]
        noisy = torch.rand(n, generator=g) < self.noise
        text = torch.where(noisy, torch.randint(self.vocab_size, (n,), generator=g), text)
        return {"tokens": text[:-1].clone(), "labels": text[1:].clone(),
                "loss_mask": torch.ones(self.seq_length), "position_ids": torch.arange(self.seq_length)}
