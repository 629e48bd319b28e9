"""Mixture of experts under the routing real data produces: the MoE layer alone, with routing maps chosen by
the test (``TopKRouter.choose``), at every expert layout, against the same layer in one process.

Mock data routes evenly; real training does not, and a rank whose experts get no tokens must still run every
collective of the forward and the backward in the same order as the others. Routing maps are drawn by hypothesis
(derandomized) in the parent: each rank's tokens choose among a subset of the experts, so a rank, an expert or
every expert but the chosen ones can receive nothing, and tokens can all go to one expert. Every example runs the
layer forward and backward on every rank; every rank issues the same collectives in the same order (the
recorded ring of ``parallel/comm_log``), and the output, the input gradient, the router's gradient (summed over the
ranks, which hold different tokens) and every expert weight's gradient (this rank's slice) equal the one-process
layer's on all tokens (fp32, rtol 1e-5). A rank that skipped a backward collective would hang: the harness fails
the test at its timeout.
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronish.arguments import configs_from_args, parse_args
from megatronish.model.moe.layer import MoELayer
from megatronish.parallel import comm_log, groups
from megatronish.parallel.context import ParallelContext
from megatronish.parallel.init import initialize_slice, split_global, split_ranks
from megatronish.testing import run_distributed

E, H, S_LOCAL, B = 8, 32, 4, 2  # experts; hidden; this rank's sequence rows and batch: 8 tokens a rank
HOWS = ("sequential", "batched", "grouped")
ARGS = ["--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-experts", str(E),
        "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0", "--train-iters", "1", "--lr", "1e-3"]
# world -> layouts: (name, parallel flags)
A2A, AG = ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]
LAYOUTS = {
    2: [("ep2-" + d, ["--expert-model-parallel-size", "2"] + f) for d, f in (("allgather", AG), ("alltoall", A2A))]
    + [("tp2-sp-etp1-ep2-" + d, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"] + f)
       for d, f in (("allgather", AG), ("alltoall", A2A))],
    4: [("ep4-" + d, ["--expert-model-parallel-size", "4"] + f) for d, f in (("allgather", AG), ("alltoall", A2A))]
    + [("tp2-sp-etp2-ep2-" + d, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--expert-model-parallel-size", "2"] + f)
       for d, f in (("allgather", AG), ("alltoall", A2A))],
}


@st.composite
def routings(draw, world: int):
    """``(k, how, table [world * tokens, k], seed)``: each rank's tokens choose k distinct experts among a drawn
    subset (so whole ranks, single experts or all but k experts can get nothing)."""
    k = draw(st.sampled_from([1, 2]))
    how = draw(st.sampled_from(HOWS))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(world):
        allowed = sorted(draw(st.sets(st.integers(0, E - 1), min_size=k, max_size=E)))
        pick = torch.rand(S_LOCAL * B, len(allowed), generator=gen).argsort(dim=1)[:, :k]
        rows.append(torch.tensor(allowed)[pick])
    return k, how, torch.cat(rows), seed


def draw_examples(world: int, n: int) -> list:
    out = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(routings(world))
    def collect(example):
        out.append(example)

    collect()
    # the extremes, always: every token to experts 0..k-1 (everything on EP rank 0; ranks > 0 get nothing)
    out += [(k, how, torch.arange(k).expand(world * S_LOCAL * B, k).clone(), -1) for k in (1, 2) for how in HOWS]
    return out


def _layer(cfg, parallel, how):
    layer = MoELayer(cfg.model, parallel.tp_size > 1, cfg.model.init_method_std, parallel=parallel)
    for name, p in layer.named_parameters():
        initialize_slice(p, p.desc, 5, name, *split_ranks(p.desc, parallel))
    layer.experts.how = how
    return layer


def _run(layer, x, table, weights):
    """Forward and backward of ``(out * weights).sum()`` with the routing ``table``."""
    layer.router.choose = lambda scores: table
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    (out * weights.view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.requires_grad}


def _worker(rank, world, examples):
    torch.manual_seed(0)
    x_all = torch.randn(world * S_LOCAL * B, 1, H)  # every rank's tokens, rank after rank
    w_all = torch.randn(world * S_LOCAL * B, 1, H)  # the output's gradient
    mine = slice(rank * S_LOCAL * B, (rank + 1) * S_LOCAL * B)
    checked = 0
    for name, flags in LAYOUTS[world]:
        groups.destroy_model_parallel()
        per_k = {}
        for k in (1, 2):
            cfg = configs_from_args(parse_args(ARGS + flags + ["--moe-router-topk", str(k)]), world)
            parallel = groups.initialize_model_parallel(cfg.parallel) if k == 1 else per_k[1][0]
            per_k[k] = (parallel, cfg)
        for k, how, table, seed in examples:
            parallel, cfg = per_k[k]
            ref = _layer(cfg, ParallelContext.single(), how)
            layer = _layer(cfg, parallel, how)
            out_r, dx_r, grads_r = _run(ref, x_all, table, w_all)
            before = comm_log.log().seq
            out, dx, grads = _run(layer, x_all[mine].view(S_LOCAL, B, H), table[mine], w_all[mine])
            # every rank issued the same collectives, in the same order, on the same kinds of group
            issued = [(kind, group, site) for seq, _, kind, group, _, path, line, _ in comm_log.log().ring
                      if seq > before for site in [f"{path}:{line}"]]
            assert 0 < len(issued) == comm_log.log().seq - before < comm_log.RING_SIZE
            everyone = [None] * world
            dist.all_gather_object(everyone, issued)
            assert all(other == issued for other in everyone), (name, k, how, seed, everyone)
            errors = [(out.reshape(-1, H) - out_r[mine].reshape(-1, H)).abs().max() / out_r.abs().max(),
                      (dx.reshape(-1, H) - dx_r[mine].reshape(-1, H)).abs().max() / dx_r.abs().max()]
            for pname, g in grads.items():
                p = dict(layer.named_parameters())[pname]
                want = grads_r[pname]
                if p.desc.expert:
                    want = split_global(p.desc, want, *split_ranks(p.desc, parallel))
                else:  # replicated, each rank's gradient from its own tokens: the sum is the whole gradient
                    g = g.clone()
                    dist.all_reduce(g)
                scale = want.abs().max().clamp_min(1e-30)
                errors.append((g - want).abs().max() / scale)
            worst = torch.stack(errors).max().reshape(1)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank fails together, not one alone
            assert worst.item() <= 1e-5, (name, k, how, seed, table.tolist(), [float(e) for e in errors], list(grads))
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_forced_routing_equals_one_process(world):
    examples = draw_examples(world, 20 if world == 2 else 12)
    counts = run_distributed(_worker, world, examples, timeout=300)
    assert counts == [len(examples) * len(LAYOUTS[world])] * world
