"""Process groups built on every rank match ParallelDims' rank lists and really communicate."""
import torch
import torch.distributed as dist

from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.testing import run_distributed


def _worker(rank, world):
    dims = ParallelDims(world_size=world, tp=2, pp=2, tie_embeddings=True)  # dp = 2
    groups.initialize_model_parallel(dims)
    c = dims.coords(rank)
    assert groups.get_tensor_model_parallel_rank() == c["tp"]
    assert groups.get_pipeline_model_parallel_rank() == c["pp"]
    assert groups.get_data_parallel_rank() == c["dp"]
    assert groups.get_tensor_model_parallel_world_size() == 2
    assert groups.get_data_parallel_world_size() == 2
    pp_ranks = dims.group_of("pp", rank)
    assert groups.get_pipeline_model_parallel_next_rank() == pp_ranks[(c["pp"] + 1) % 2]
    assert groups.is_rank_in_embedding_group()  # PP=2 and tied: both stages hold the embedding
    # each group sums exactly its members' ranks
    for kind in ("tp", "pp", "dp", "dp_cp", "mp", "tp_dp", "embedding", "position_embedding"):
        members = dims.group_of(kind, rank)
        if not members:
            assert groups.get_group(kind) is None
            continue
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=groups.get_group(kind))
        assert x.item() == sum(members), (kind, members, x.item())
    return True


def test_groups_match_dims_and_communicate():
    assert all(run_distributed(_worker, 8))
