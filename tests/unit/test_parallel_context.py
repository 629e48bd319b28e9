"""The parallel context without processes: ``ParallelContext.fake(dims, rank)`` answers every size, rank and
rank list as the real groups would (``tests/distributed/test_groups.py`` checks them against each other), so a
model for any rank of any layout can be built and inspected in one process."""
import pytest
import torch

from megatronish.config import gpt2, llama
from megatronish.model import GPTModel
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import FakeGroup, ParallelContext, group_rank, group_size
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.init import local_shape


def test_single_is_one_process_without_groups():
    ctx = ParallelContext.single()
    assert (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.cp_size, ctx.world_size) == (1, 1, 1, 1, 1)
    assert (ctx.tp_rank, ctx.pp_rank, ctx.dp_cp_rank) == (0, 0, 0)
    assert ctx.is_first_stage and ctx.is_last_stage
    assert all(ctx.group(k) is None for k in ParallelDims.GROUP_KINDS)
    assert group_size(None) == 1 and group_rank(None) == 0


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2), dict(tp=4), dict(pp=4, vp=2), dict(tp=2, cp=2),
                                    dict(cp=4, cp_inner=2)])
def test_fake_context_matches_the_dims(layout):
    dims = ParallelDims(world_size=8, **layout)
    for rank in range(8):
        ctx = ParallelContext.fake(dims, rank)
        c = dims.coords(rank)
        assert (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank) == (c["tp"], c["pp"], c["dp"], c["cp"])
        assert ctx.dp_cp_size == dims.dp * dims.cp and ctx.ranks("dp_cp") == tuple(dims.group_of("dp_cp", rank))
        for kind in ("cp_inner", "cp_outer"):  # two-level CP's groups exist only with the degree
            assert ctx.ranks(kind) == tuple(dims.group_of(kind, rank))
            assert (ctx.group(kind) is not None) == (dims.cp_inner is not None)
        ring = dims.group_of("pp", rank)  # first stage to last
        i = ring.index(rank)
        assert (ctx.next_pp_rank, ctx.prev_pp_rank) == (ring[(i + 1) % dims.pp], ring[(i - 1) % dims.pp])
        assert (ctx.is_first_stage, ctx.is_last_stage) == (i == 0, i == dims.pp - 1)
        if dims.tp > 1:
            assert isinstance(ctx.tp_group, FakeGroup) and ctx.tp_group.size() == dims.tp
            assert ctx.tp_group.rank() == c["tp"]
        else:
            assert ctx.tp_group is None


def test_every_rank_of_a_layout_builds_its_slice_of_the_one_process_model():
    """TP 2 x PP 2 x VP 2: the union over ranks of every chunk's parameters is the one-process model's,
    each with its global shape split along its TP dimension; layers are where Megatron puts them."""
    cfg = llama(num_layers=8, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=100, seq_length=16)
    whole = {n: p.shape for n, p in GPTModel(cfg, device="meta").named_global_parameters()}
    dims = ParallelDims(world_size=8, tp=2, pp=2, vp=2, tie_embeddings=False)
    seen = {}
    for rank in range(8):
        ctx = ParallelContext.fake(dims, rank)
        for chunk in build_model_chunks(cfg, ctx, device="meta"):
            assert chunk.parallel is ctx
            for name, p in chunk.named_global_parameters():
                assert tuple(p.shape) == local_shape(p.desc, 2), name
                seen.setdefault(name, set()).add(ctx.tp_rank)
                global_shape = tuple(p.desc.global_shape)
                if name != "embedding.word_embeddings.weight" and name != "output_layer.weight":
                    assert global_shape == tuple(whole[name]), name
    assert seen.keys() == whole.keys()
    assert all(ranks == {0, 1} for ranks in seen.values())  # both TP ranks hold a piece of (or a copy of) each


def test_forward_over_a_fake_group_refuses_to_communicate():
    cfg = gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    model = GPTModel(cfg, parallel=ParallelContext.fake(ParallelDims(world_size=2, tp=2), 1))
    model.init_parameters(1)
    with pytest.raises(RuntimeError, match="fake process group .* cannot communicate"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_context_is_shared_not_copied():
    import copy

    ctx = ParallelContext.fake(ParallelDims(world_size=2, tp=2), 0)
    model = GPTModel(gpt2(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8),
                     parallel=ctx)
    assert copy.deepcopy(model).parallel is ctx
