"""Text generation from a checkpoint at any layout: KV-cached decoding with TP/PP (docs/generation.md)."""
from .engine import GenerationOutput, Generator
from .kv_cache import InferenceParams
from .sampling import SamplingParams, sample

__all__ = ["GenerationOutput", "Generator", "InferenceParams", "SamplingParams", "sample"]
