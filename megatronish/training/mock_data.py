"""``--mock-data``: a deterministic, learnable synthetic corpus.

Sample ``i`` depends only on ``(seed, i)``, so every parallel layout sees the same global batch. Each sample
walks a fixed random cycle through the vocabulary (the next token is a function of the current one) from a
random start, with 10% of the tokens replaced by random ones: a model can learn it, so the loss falls.
"""
from __future__ import annotations

import hashlib

import torch


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


def global_batch_indices(consumed_samples: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                         num_microbatches: int) -> list[list[int]]:
    """Megatron's pretraining sampler: each step of ``micro_batch_size * dp`` consecutive samples is split
    into DP slices; returns this rank's sample indices for each microbatch of the iteration."""
    out = []
    for m in range(num_microbatches):
        base = consumed_samples + m * micro_batch_size * dp_size + dp_rank * micro_batch_size
        out.append(list(range(base, base + micro_batch_size)))
    return out


def collate(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
