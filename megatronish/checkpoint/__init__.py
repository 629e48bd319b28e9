"""Distributed checkpoints on ``torch.distributed.checkpoint`` in Megatron's directory layout; any parallel
layout loads any other. See docs/checkpoint.md."""
from .dcp_io import CheckpointError

__all__ = ["CheckpointError"]
