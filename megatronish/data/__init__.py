"""Data: tokenizers, indexed datasets (.bin/.idx), GPT datasets, blending and samplers."""
from megatronish.data.blending import BlendedDataset, BlendError, get_blend_from_list, parse_and_normalize_split
from megatronish.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, Split, build_gpt_datasets
from megatronish.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megatronish.data.sampler import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatronish.data.tokenizers import TokenizerError, build_tokenizer

__all__ = [
    "BlendedDataset",
    "BlendError",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "MockGPTDataset",
    "Split",
    "TokenizerError",
    "build_gpt_datasets",
    "build_pretraining_data_loader",
    "build_tokenizer",
    "get_blend_from_list",
    "parse_and_normalize_split",
]
