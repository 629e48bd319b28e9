"""The GPT model (GPT-2 and Llama flavors) on tensor-parallel layers."""
from .gpt import GPTModel

__all__ = ["GPTModel"]
