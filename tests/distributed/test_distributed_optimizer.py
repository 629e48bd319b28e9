"""The distributed optimizer (ZeRO-1 over DP) against the plain optimizer, both through ``pretrain()`` in the same
layout and from the same seed: losses, final parameters and the checkpoint view of the optimizer state
(``sharded_param_state``) agree to rtol 1e-6 over 10 Adam steps at DP 2 and DP 4, with TP 2 (+SP) and with PP 2
(tied embedding split over two stages, 1F1B and interleaved); several buckets, overlapped gradient
reduce-scatter and parameter all-gather included. Its optimizer state per rank is 1/DP of the plain one plus at
most the bucket padding. Against one process (gradients and parameters every iteration at DP 2):
tests/distributed/test_dp_parity.py."""
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

ITERS = 10
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "0.5",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "100",
        "--seed", "7", "--micro-batch-size", "1", "--disable-bias-linear"]
# No linear biases: the key bias's true gradient is exactly zero (softmax is invariant to it), so Adam turns its
# rounding noise into full-size updates and any two summation orders diverge there. LayerNorm biases remain.
DIST = ["--use-distributed-optimizer"]


def _run(argv, world):
    groups.destroy_model_parallel()
    result = pretrain(configs_from_args(parse_args(BASE + argv), world))
    state, ctx = result.state, result.context
    names = {id(p): f"{i}.{n}" for i, m in enumerate(ctx.models) for n, p in m.named_parameters()}
    opt = ctx.optimizer
    # numpy: results travel back through a pipe, by value
    opt_state = {names[id(p)]: {k: v.numpy().copy() for k, v in d.items()} for p, d in opt.sharded_param_state()}
    return {"losses": [loss for _, loss in state.history],
            "params": {names[id(p)]: p.detach().numpy().copy() for m in ctx.models for p in m.parameters()},
            "opt_state": opt_state, "state_bytes": opt.state_bytes(),
            "padding": sum(b.buffer.numel() - sum(p.numel() for p in b.params) for c in ctx.chunks
                           for b in c.buckets),
            "num_buckets": sum(len(c.buckets) for c in ctx.chunks),
            "main_is_model": all(s.main.data_ptr() == s.model.data_ptr() + s.lo * s.model.element_size()
                                 for s in opt.slots),
            # which elements of which parameter this rank's optimizer holds state for: [lo, hi) per slot, with the
            # sizes of the Adam state tensors it really keeps there
            "held": [(names[id(s.model)], s.lo, s.hi, s.model.numel(),
                      sorted({v.numel() for v in opt.optimizer.state[s.main].values() if torch.is_tensor(v)
                              and v.dim() > 0})) for s in opt.slots],
            "coords": (ctx.parallel.tp_rank, ctx.parallel.pp_rank)}


def _worker(rank, world, cases):
    return {name: (_run(plain, world), _run(plain + DIST + extra, world)) for name, (plain, extra) in cases.items()}


def _close(a, b, what):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _check(results, dp):
    for rank, per_case in enumerate(results):
        for name, (plain, dist) in per_case.items():
            what = f"{name} rank {rank}"
            _close(torch.tensor(dist["losses"]), torch.tensor(plain["losses"]), f"{what} losses")
            assert plain["losses"][-1] < plain["losses"][0] - 0.05, plain["losses"]
            assert dist["params"].keys() == plain["params"].keys()
            for n in plain["params"]:
                _close(dist["params"][n], plain["params"][n], f"{what} param {n}")
                assert dist["opt_state"][n].keys() == plain["opt_state"][n].keys() == {"exp_avg", "exp_avg_sq"}
                for k in plain["opt_state"][n]:
                    _close(dist["opt_state"][n][k], plain["opt_state"][n][k], f"{what} {k} of {n}")
            assert dist["main_is_model"]  # fp32: the main params are views of the model params, no copy
            # optimizer state memory: 1/DP of the plain optimizer's, plus at most this rank's share of padding
            full = plain["state_bytes"]
            assert dist["state_bytes"] <= full / dp + 8 * dist["padding"] / dp + 1e-9, (dist["state_bytes"], full)
            assert dist["state_bytes"] >= full / dp - 8 * dist["padding"], (dist["state_bytes"], full)
            assert dist["padding"] < dp * dist["num_buckets"]
    # each element's state is held by exactly one DP rank: within each DP group (same TP/PP coordinates) the ranks'
    # [lo, hi) ranges of every parameter are disjoint and cover it, and the Adam tensors are the range's size
    groups_of = {}
    for per_case in results:
        for name, (_, dist) in per_case.items():
            groups_of.setdefault((name, dist["coords"]), []).append((dist["held"], set(dist["params"])))
    for (name, coords), members in groups_of.items():
        assert len(members) == dp, (name, coords, len(members))
        ranges, numel = {}, {}
        for held, _ in members:
            for pname, lo, hi, n, state_sizes in held:
                assert 0 <= lo < hi <= n and state_sizes == [hi - lo], (name, pname, lo, hi, state_sizes)
                ranges.setdefault(pname, []).append((lo, hi))
                numel[pname] = n
        assert ranges.keys() == members[0][1]  # every parameter of these model chunks
        for pname, rs in ranges.items():
            rs.sort()
            assert rs[0][0] == 0 and rs[-1][1] == numel[pname], (name, coords, pname, rs)
            assert all(a[1] == b[0] for a, b in zip(rs, rs[1:])), (name, coords, pname, rs)  # no gap, no overlap
    return True


def test_distributed_optimizer_dp2():
    cases = {"dp2": ([], []),
             "dp2-buckets-overlap": (["--ddp-bucket-size", "1500", "--overlap-grad-reduce"],
                                     ["--overlap-param-gather"])}
    results = run_distributed(_worker, 2, cases)
    _check(results, 2)
    # DP ranks hold disjoint shards covering everything: their state bytes sum to the plain optimizer's
    for name in cases:
        plain, dists = results[0][name][0]["state_bytes"], [r[name][1]["state_bytes"] for r in results]
        assert sum(dists) == plain, (name, dists, plain)


def test_distributed_optimizer_dp4_tp2_pp2():
    cases = {"dp4": (["--ddp-bucket-size", "2000"], []),
             "tp2-sp-dp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], []),
             "pp2-dp2": (["--pipeline-model-parallel-size", "2"], []),
             # 2 stages x 2 virtual stages of 1 layer (the other layouts train 2 layers: the suite's time)
             "pp2-vp2-dp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--micro-batch-size", "2", "--num-layers", "4"], [])}
    results = run_distributed(_worker, 4, cases)
    world_dp = {"dp4": 4, "tp2-sp-dp2": 2, "pp2-dp2": 2, "pp2-vp2-dp2": 2}
    for name, dp in world_dp.items():
        _check([{name: r[name]} for r in results], dp)
    # DP 4: the four shards sum to the plain optimizer's state
    assert sum(r["dp4"][1]["state_bytes"] for r in results) == results[0]["dp4"][0]["state_bytes"]
