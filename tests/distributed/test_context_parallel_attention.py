"""Causal attention split over context-parallel ranks (load-balanced chunks; ring, all-to-all, all-gather and the
hierarchical a2a+p2p communication) equals dense causal attention on one process: outputs and the gradients of q,
k and v (fp32, rtol 1e-5), with and without grouped-query attention, with and without document masking (a token
attends only to earlier tokens of its own document; the reference is SDPA with the dense mask), including document
layouts where every pair of different chunks is skipped; every rank issues the same collectives whatever it skips."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish.parallel import comm_log, groups
from megatronish.parallel.context_parallel import (
    context_parallel_attention,
    cp_chunk_index,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from megatronish.parallel.dims import ParallelDims
from megatronish.testing import run_distributed

B, S, D = 2, 32, 8
CASES = [(8, 8), (8, 4), (4, 4)]  # (query heads, key/value heads)


def _inputs(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(B, hq, S, D, generator=g)


DOCS = (None, "random", "singletons", "quads")


def _docs(with_docs):
    """Document ids [B, S]. ``random``: short documents of random lengths (some inside one chunk, some across
    chunks); the extremes real data produces and random lengths rarely do, where every pair of different chunks
    shares no document and the block plan skips it (a ring step with nothing to attend on some ranks, the K/V
    still passed on): ``singletons`` (every token its own document) and ``quads`` (4-token documents: at CP 4
    exactly the chunks)."""
    if not with_docs:
        return None
    if with_docs == "singletons":
        return torch.arange(S).expand(B, S).clone()
    if with_docs == "quads":
        return (torch.arange(S) // 4).expand(B, S).clone()
    g = torch.Generator().manual_seed(4)
    return torch.cumsum((torch.rand(B, S, generator=g) < 0.15).long(), dim=1)


def _reference(hq, hkv, with_docs=False):
    q, k, v, dout = _inputs(hq, hkv)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    docs = _docs(with_docs)
    mask = None if docs is None else (docs[:, :, None] == docs[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=docs is None, scale=1 / math.sqrt(D),
                                         attn_mask=None if mask is None else mask[:, None], enable_gqa=hq != hkv)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, refs):
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, cp=world))
    g, r = ctx.cp_group, ctx.cp_rank
    for comm in ("p2p", "a2a", "allgather"):
        for ((hq, hkv), with_docs), ref in refs:
            if comm == "a2a" and hkv % world:
                continue
            q, k, v, dout = (split_for_context_parallel(t, 2, world, r) for t in _inputs(hq, hkv))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            before = comm_log.log().seq
            out = context_parallel_attention(q, k, v, group=g, comm_type=comm, scale=1 / math.sqrt(D),
                                             document_ids=_docs(with_docs))
            out.backward(dout)
            what = f"CP{world} {comm} heads {hq}/{hkv} documents={with_docs}"
            # whatever the plan skips, every rank issues the same collectives in the same order
            issued = [(kind, group) for seq, _, kind, group, *_ in comm_log.log().ring if seq > before]
            assert 0 < len(issued) == comm_log.log().seq - before <= comm_log.RING_SIZE, what
            everyone = [None] * world
            dist.all_gather_object(everyone, issued)
            assert all(other == issued for other in everyone), f"{what}: {everyone}"
            for name, mine, full in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
                torch.testing.assert_close(gather_from_context_parallel(mine, 2, g), full, rtol=1e-5,
                                           atol=_atol(with_docs), msg=lambda m: f"{what} {name}: {m}")
    return True


def _hierarchical_worker(rank, world, refs):
    """a2a+p2p at CP 4 with inner (a2a, adjacent ranks) x outer (ring) sizes 2 x 2, 4 x 1 and 1 x 4."""
    for a in (2, 4, 1):  # the context's cp_inner (adjacent ranks) and cp_outer (ring) groups
        ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, cp=world, cp_inner=a))
        g, r = ctx.cp_group, ctx.cp_rank
        inner, outer = ctx.group("cp_inner"), ctx.group("cp_outer")
        assert ctx.ranks("cp_inner") == tuple(range(r // a * a, r // a * a + a))
        assert ctx.ranks("cp_outer") == tuple(range(r % a, world, a))
        for ((hq, hkv), with_docs), ref in refs:
            if hkv % a:
                continue
            q, k, v, dout = (split_for_context_parallel(t, 2, world, r) for t in _inputs(hq, hkv))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            out = context_parallel_attention(q, k, v, group=g, comm_type="a2a+p2p", scale=1 / math.sqrt(D),
                                             inner_group=inner, outer_group=outer, document_ids=_docs(with_docs))
            out.backward(dout)
            what = f"CP{world} a2a+p2p {a}x{world // a} heads {hq}/{hkv} documents={with_docs}"
            for name, mine, full in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
                torch.testing.assert_close(gather_from_context_parallel(mine, 2, g), full, rtol=1e-5,
                                           atol=_atol(with_docs), msg=lambda m: f"{what} {name}: {m}")
    return True


def test_hierarchical_context_parallel_attention_matches_dense():
    assert all(run_distributed(_hierarchical_worker, 4, _references()))


def _atol(with_docs):
    # a document's first token attends only to itself: its exact gradient is 0, ours is rounding (~1e-6)
    return 1e-5 if with_docs else 1e-6


def _references():
    return [((case, docs), _reference(*case, docs)) for case in CASES for docs in DOCS]


def test_chunk_index_is_megatrons_split():
    assert cp_chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    idx = torch.cat([cp_chunk_index(24, 3, r) for r in range(3)])
    assert sorted(idx.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        cp_chunk_index(12, 4, 0)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_dense(world):
    assert all(run_distributed(_worker, world, _references()))


def test_one_process_document_attention_matches_dense_mask():
    """CP 1 with documents: the block plan over two chunks equals SDPA with the dense mask."""
    for ((hq, hkv), with_docs), ref in _references():
        q, k, v, dout = _inputs(hq, hkv)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(q, k, v, group=None, scale=1 / math.sqrt(D), document_ids=_docs(with_docs))
        out.backward(dout)
        for mine, full in zip((out.detach(), q.grad, k.grad, v.grad), ref):
            torch.testing.assert_close(mine, full, rtol=1e-5, atol=_atol(with_docs))
