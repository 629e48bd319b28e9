"""Process groups built on every rank match ParallelDims' rank lists and really communicate."""
import copy

import torch
import torch.distributed as dist

from megatronish.config import gpt2
from megatronish.model import GPTModel
from megatronish.parallel import groups
from megatronish.parallel.context import ParallelContext, group_rank, group_size
from megatronish.parallel.dims import ParallelDims
from megatronish.testing import run_distributed


def _worker(rank, world):
    dims = ParallelDims(world_size=world, tp=2, pp=2, tie_embeddings=True)  # dp = 2
    ctx = groups.initialize_model_parallel(dims)
    c = dims.coords(rank)
    # the context the package passes around, and the Megatron-named accessors over it, agree with the dims
    assert (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank) == (c["tp"], c["pp"], c["dp"], c["cp"])
    assert (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.dp_cp_size) == (2, 2, 2, 2)
    fake = ParallelContext.fake(dims, rank)  # the same answers without torch.distributed
    for kind in ParallelDims.GROUP_KINDS:
        assert fake.ranks(kind) == ctx.ranks(kind) == tuple(dims.group_of(kind, rank)), kind
        if ctx.ranks(kind):
            assert group_size(fake.group(kind)) == group_size(ctx.group(kind)) == len(ctx.ranks(kind)), kind
            assert group_rank(fake.group(kind)) == group_rank(ctx.group(kind)) == ctx.rank_in(kind), kind
    assert (fake.next_pp_rank, fake.prev_pp_rank) == (ctx.next_pp_rank, ctx.prev_pp_rank)
    assert groups.get_context() is ctx
    # a model holds its groups; a deep copy shares them (process groups cannot be copied) and computes the same
    model = GPTModel(gpt2(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=4,
                          hidden_dropout=0.0, attention_dropout=0.0), parallel=ctx)
    model.init_parameters(3)
    twin = copy.deepcopy(model)
    assert twin.parallel is ctx and twin.output_layer.tp_group is ctx.tp_group
    ids = torch.arange(8).view(2, 4)
    assert torch.equal(twin(ids), model(ids))
    assert groups.get_tensor_model_parallel_rank() == c["tp"]
    assert groups.get_pipeline_model_parallel_rank() == c["pp"]
    assert groups.get_data_parallel_rank() == c["dp"]
    assert groups.get_tensor_model_parallel_world_size() == 2
    assert groups.get_data_parallel_world_size() == 2
    pp_ranks = dims.group_of("pp", rank)
    assert groups.get_pipeline_model_parallel_next_rank() == pp_ranks[(c["pp"] + 1) % 2]
    assert groups.is_rank_in_embedding_group()  # PP=2 and tied: both stages hold the embedding
    # each group sums exactly its members' ranks
    for kind in (*ParallelDims.GROUP_KINDS, "io"):
        members = list(range(world)) if kind == "io" else dims.group_of(kind, rank)
        if not members:
            assert groups.get_group(kind) is None
            continue
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=groups.get_group(kind))
        assert x.item() == sum(members), (kind, members, x.item())
    # two-level CP: the cp_inner/cp_outer groups exist with the degree and match the fake context
    dims = ParallelDims(world_size=world, tp=2, cp=4, cp_inner=2)
    ctx, fake = groups.initialize_model_parallel(dims), ParallelContext.fake(dims, rank)
    for kind in ("cp_inner", "cp_outer"):
        assert fake.ranks(kind) == ctx.ranks(kind) == tuple(dims.group_of(kind, rank)) and len(ctx.ranks(kind)) == 2
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=ctx.group(kind))
        assert x.item() == sum(ctx.ranks(kind)), kind
    # built again: the groups of the same kind, ranks and timeout are the same objects (torch.distributed keeps
    # every group it made, with its connections and threads, so a test process building hundreds of contexts would
    # pile them up); other ranks or another timeout make new ones; they still communicate
    made = len(dist.distributed_c10d._world.pg_map)
    again = groups.initialize_model_parallel(dims)
    assert all(again.group(k) is ctx.group(k) for k in (*ParallelDims.GROUP_KINDS, "io") if ctx.ranks(k))
    assert len(dist.distributed_c10d._world.pg_map) == made
    other = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=4))
    assert other.tp_group is not ctx.tp_group and other.ranks("tp") != ctx.ranks("tp")
    assert other.group("io") is ctx.group("io")  # the same ranks under another kind's neighbours
    slow = groups.initialize_model_parallel(dims, timeout_minutes=1.0)
    assert slow.tp_group is not ctx.tp_group and slow.ranks("tp") == ctx.ranks("tp")
    for c2 in (again, other, slow):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=c2.tp_group)
        assert x.item() == sum(c2.ranks("tp"))
    return True


def test_groups_match_dims_and_communicate():
    assert all(run_distributed(_worker, 8))
