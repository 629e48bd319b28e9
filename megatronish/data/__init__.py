"""Data: tokenizers, indexed datasets (.bin/.idx), GPT datasets, blending, the mock dataset and the sampler.

The names below load their module on first use, so ``megatronish.data.mock`` and ``megatronish.data.sampler``
(all a ``--mock-data`` run needs) do not load the compiled index helpers or the tokenizers."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "BlendedDataset": "blending",
    "BlendError": "blending",
    "get_blend_from_list": "blending",
    "parse_and_normalize_split": "blending",
    "GPTDataset": "gpt_dataset",
    "GPTDatasetConfig": "gpt_dataset",
    "Split": "gpt_dataset",
    "build_gpt_datasets": "gpt_builder",
    "DType": "indexed_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "MockGPTDataset": "mock",
    "MegatronPretrainingSampler": "sampler",
    "collate": "sampler",
    "global_batch_indices": "sampler",
    "TokenizerError": "tokenizers",
    "build_tokenizer": "tokenizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
