"""How ``setup`` wraps this rank's model chunks for data parallelism: our DDP (contiguous gradient buffers,
optionally the distributed optimizer) or FSDP2 (``--use-torch-fsdp2``, :mod:`megatronish.parallel.fsdp`).

Under FSDP2 the model is built in fp32 (the sharded parameters are the master weights) and ``--bf16`` / ``--fp16``
become FSDP2's compute dtype; with a data-parallel (x context-parallel) size of 1 there is nothing to shard: a
warning, and the run uses DDP.
"""
from __future__ import annotations

import torch

from ..parallel.context import ParallelContext
from ..parallel.ddp import DistributedDataParallel


def model_params_dtype(cfg) -> torch.dtype:
    """The dtype the model's parameters are built in: fp32 under FSDP2 (its policy casts for compute)."""
    return torch.float32 if cfg.fsdp_active else cfg.optim.params_dtype


def wrap_model_chunks(models, cfg, parallel: ParallelContext, print_fn=print) -> list:
    """One DDP or FSDP2 wrapper per model chunk (collective); called once per run, which warns once."""
    o = cfg.optim
    if o.use_torch_fsdp2 and not cfg.fsdp_active:
        print_fn("WARNING: --use-torch-fsdp2 with a data-parallel size of 1: nothing to shard; running as DDP")
    if cfg.fsdp_active:
        from ..parallel.fsdp import FullyShardedDataParallel, resolve_reshard_after_forward

        reshard = resolve_reshard_after_forward(o.fsdp_reshard_after_forward, cfg.parallel.pp > 1)
        return [FullyShardedDataParallel(m, dp_group=parallel.dp_cp_group, param_dtype=o.params_dtype,
                                         reduce_dtype=o.grad_dtype, reshard_after_forward=reshard,
                                         prefetch_layers=o.fsdp_prefetch_layers)
                if any(True for _ in m.parameters()) else DistributedDataParallel(m, dp_group=parallel.dp_cp_group)
                for m in models]  # (an empty pipeline stage has nothing to shard)
    return [DistributedDataParallel(m, dp_group=parallel.dp_cp_group, overlap_grad_reduce=o.overlap_grad_reduce,
                                    bucket_size=o.ddp_bucket_size, grad_dtype=o.grad_dtype,
                                    use_distributed_optimizer=o.use_distributed_optimizer,
                                    overlap_param_gather=o.overlap_param_gather,
                                    expert_dp_group=parallel.expert_dp_group,
                                    average=not cfg.train.calculate_per_token_loss)
            for m in models]


__all__ = ["model_params_dtype", "wrap_model_chunks"]
