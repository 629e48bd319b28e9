"""Flag group of the parallel layout and the data-parallel wrappers."""
from __future__ import annotations

from ..parallel.dims import PIPELINE_SCHEDULES
from ._group import flag, on


def add_parallel_flags(p) -> None:
    """Degrees, communication and the data-parallel wrappers."""
    g = p.add_argument_group("parallelism")
    flag(g, "--tensor-model-parallel-size", type=int, default=1)
    flag(g, "--pipeline-model-parallel-size", type=int, default=1)
    flag(g, "--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    flag(g, "--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    flag(g, "--pipeline-schedule", default=None, choices=list(PIPELINE_SCHEDULES),
         help="ours: the pipeline schedule (default: 1f1b, interleaved-1f1b with virtual stages); zb-h1, zbv and "
         "dualpipev split the backward (docs/pipeline.md); zbv and dualpipev imply 2 virtual stages per rank, in a V")
    flag(g, "--overlap-p2p-communication", dest="overlap_p2p_comm", **on,
         help="post each pipeline receive ahead and wait for it only when its step runs (interleaved and "
         "zero-bubble schedules; 1F1B ignores it, as Megatron-LM)")
    flag(g, "--overlap-p2p-comm", dest="overlap_p2p_comm", **on, help="the same as --overlap-p2p-communication")
    flag(g, "--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
         help="every pipeline exchange is posted as one batch and waited for at once (the default here)")
    flag(g, "--decoder-first-pipeline-num-layers", type=int, default=None,
         help="layers on the first pipeline rank (the ranks between the first and last share the rest evenly)")
    flag(g, "--decoder-last-pipeline-num-layers", type=int, default=None,
         help="layers on the last pipeline rank")
    flag(g, "--pipeline-model-parallel-layout", default=None,
         help="what every (virtual) stage holds, e.g. 'Et*3|(tt|)*2,tL': E embedding, t transformer layer, m "
         "multi-token prediction, L loss, '|' between stages (docs/pipeline.md, Layouts)")
    flag(g, "--account-for-embedding-in-pipeline-split", **on,
         help="the embedding counts as one layer when the layers split evenly over the stages")
    flag(g, "--account-for-loss-in-pipeline-split", **on,
         help="the loss counts as one layer when the layers split evenly over the stages")
    flag(g, "--sequence-parallel", **on, help="sequence parallelism in TP regions (no-op at TP 1)")
    flag(g, "--context-parallel-size", type=int, default=1,
         help="split every sequence over this many ranks (docs/context_parallel.md)")
    flag(g, "--cp-comm-type", nargs="+", default=["p2p"], choices=["p2p", "a2a", "allgather", "a2a+p2p"],
         help="context-parallel attention communication: one type, or one per layer")
    flag(g, "--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
         help="a2a+p2p: the all-to-all size (adjacent ranks) and the ring size; their product is the CP size")
    flag(g, "--expert-model-parallel-size", type=int, default=1,
         help="experts of every MoE layer spread over this many ranks (docs/moe.md)")
    flag(g, "--expert-tensor-parallel-size", type=int, default=None,
         help="tensor parallelism inside each expert (default --tensor-model-parallel-size)")
    flag(g, "--distributed-backend", default=None, choices=["nccl", "gloo"],
         help="default: nccl on CUDA, gloo on CPU (Megatron's default is nccl)")
    flag(g, "--distributed-timeout-minutes", type=int, default=10)
    flag(g, "--use-distributed-optimizer", **on)
    flag(g, "--overlap-grad-reduce", **on, help="overlap the DP gradient reduce with backward, per bucket")
    flag(g, "--overlap-param-gather", **on)
    flag(g, "--ddp-bucket-size", type=int, default=None, help="elements per gradient bucket")
    flag(g, "--use-cpu-initialization", **on, help="accepted; initialization is layout-invariant either way")
    flag(g, "--tp-comm-overlap", **on)
    flag(g, "--use-torch-fsdp2", **on, help="shard parameters, gradients and optimizer state over DP with "
         "PyTorch FSDP2 (docs/fsdp.md)")
    flag(g, "--fsdp-reshard-after-forward", default="default", choices=["default", "always", "never"],
         help="FSDP2: free gathered parameters after each layer's forward (default: never under pipeline "
         "parallelism, else always; torchtitan's rule)")
    flag(g, "--fsdp-prefetch-layers", type=int, default=1,
         help="FSDP2: all-gather the next N layers' parameters ahead (0: FSDP2's implicit prefetch)")
    flag(g, "--torch-compile", **on, help="torch.compile each transformer layer and the loss (torchtitan's "
         "compile; docs/fsdp.md)")
    flag(g, "--use-megatron-fsdp", **on)


