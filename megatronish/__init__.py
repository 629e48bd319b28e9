"""megatronish: Megatron-style 3D-parallel GPT pretraining on PyTorch."""

__version__ = "0.1.0"
