"""Mixture of experts: every expert layout trains exactly as one process with the same routing.

Each case runs 3 iterations through the training step (setup / train_step) and compares, against a one-process
run of the same model (same seed, no weight copying, the same micro-batch size so every routing call sees the
same tokens): the losses, every parameter's reduced gradient of every iteration (assembled from the ranks'
slices, before the optimizer step clips them), and the router expert biases (fp32, rtol 1e-5). Load-balancing
and z losses are on, so their gradients take part. SGD with gradient clipping (the clip is active: the norm
exceeds 0.5), so a wrong reduction, scale or norm shows up in the next iteration's numbers; Adam would turn the
reduction-order noise of near-zero gradients into full-size updates.

The ``forced-*`` variants fix the routing (``TopKRouter.choose``: the top-k of the scores plus a large bias per
expert, the same in every layout) to the maps real data produces and mock data never does: every token on EP
rank 0's experts (the other ranks' experts get nothing), one expert empty, every token to one expert, and one
expert over capacity. Every rank must still run the same collectives; a rank that skipped a backward
collective would hang until the harness's timeout.
"""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.model.moe.router import TopKRouter
from megatronish.parallel import groups
from megatronish.testing import global_tensors, run_distributed
from megatronish.training import pretrain as training

ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", str(ITERS), "--optimizer", "sgd", "--lr", "0.3",
        "--lr-decay-style", "constant", "--clip-grad", "0.5", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0",
        "--log-interval", "100", "--seed", "7", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2",
        "--moe-z-loss-coeff", "1e-3"]


BIG = 1e4
# forced variant -> the bias added to the scores for the choice of experts (the probabilities stay the scores')
FORCE = {"forced-rank0-experts": [BIG, BIG, 0, 0], "forced-expert3-empty": [0, 0, 0, -BIG],
         "forced-one-expert-top1": [BIG, 0, 0, 0], "forced-over-capacity": [BIG, 0, 0, -BIG]}


def _force(models, bias, k):
    bias = torch.tensor(bias)
    for model in models:
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.choose = lambda scores: torch.topk(scores + bias.to(scores.dtype), k, dim=1)[1]


class _ExpertBiases:
    """A model seen by ``global_tensors`` as its router expert biases only (assembling every parameter after every
    iteration costs as much as the training step)."""

    def __init__(self, model):
        self.model = model

    def named_global_parameters(self):
        return ((n, p) for n, p in self.model.named_global_parameters() if n.endswith("expert_bias"))


def _run(argv, world, force=None):
    """Losses, gradients and expert biases of every iteration."""
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    run, state = training.setup(cfg)
    if force is not None:
        _force(run.models, force, cfg.model.moe.moe_router_topk)
    grads, biases = [], []
    step = run.optimizer.step

    def step_and_record():  # the reduced gradients, before clipping and the update
        grads.append(global_tensors(run.models, run.parallel, grads=True, optimizer=run.optimizer))
        return step()

    run.optimizer.step = step_and_record
    losses, norms, metrics = [], [], []
    for it in range(ITERS):
        result = training.train_step(run, state)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        metrics.append(result.moe)
        # the expert biases after every step; every parameter (its replicas agreeing) after the last one
        params = global_tensors(run.models if it == ITERS - 1 else [_ExpertBiases(m) for m in run.models],
                                run.parallel)
        biases.append({n: t for n, t in params.items() if n.endswith("expert_bias")})
    return {"losses": losses, "grads": grads, "biases": biases, "norms": norms, "metrics": metrics}


def _numpy(x):
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numpy(v) for v in x]
    return x.numpy() if torch.is_tensor(x) else x


def _worker(rank, world, cases):
    # numpy, not tensors: results travel to the parent through a pipe
    return {name: _numpy(_run(argv, world, FORCE.get(v))) for name, (argv, v) in cases.items()} \
        if rank == 0 else {name: _run(argv, world, FORCE.get(v)) and None
                           for name, (argv, v) in cases.items()}


# layout flags (ranks) -> model/routing variants run at that layout
MODEL = {
    "top2-softmax": [],
    "top1-softmax": ["--moe-router-topk", "1"],
    "sigmoid-bias": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                     "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "seq_aux_loss"],
    "shared-gate": ["--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate"],
    "capacity-probs": ["--moe-expert-capacity-factor", "1.0"],
    "capacity-position-pad": ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "position",
                              "--moe-pad-expert-input-to-capacity"],
    "per-token": ["--calculate-per-token-loss", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                  "--moe-aux-loss-coeff", "1e-2", "1e-2"],
    "grouped-pre-softmax": ["--moe-grouped-gemm", "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor",
                            "2.0"],
    "forced-rank0-experts": [],
    "forced-expert3-empty": [],
    "forced-one-expert-top1": ["--moe-router-topk", "1"],
    "forced-over-capacity": ["--moe-expert-capacity-factor", "1.0"],
}
A2A, AG = ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]
EP2 = ["--expert-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CASES = {  # name: (world, layout flags, model variant)
    "ep2-allgather-top2": (2, EP2 + AG, "top2-softmax"),
    "ep2-alltoall-top2": (2, EP2 + A2A, "top2-softmax"),
    "ep2-alltoall-top1": (2, EP2 + A2A, "top1-softmax"),
    "ep2-allgather-top1": (2, EP2 + AG, "top1-softmax"),
    "ep2-alltoall-sigmoid-bias": (2, EP2 + A2A, "sigmoid-bias"),
    "ep2-allgather-shared": (2, EP2 + AG, "shared-gate"),
    "ep2-alltoall-capacity": (2, EP2 + A2A, "capacity-probs"),
    "ep2-allgather-capacity-pad": (2, EP2 + AG, "capacity-position-pad"),
    "ep2-alltoall-grouped": (2, EP2 + A2A, "grouped-pre-softmax"),
    "ep2-alltoall-recompute": (2, EP2 + A2A + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                               "--recompute-num-layers", "1"], "sigmoid-bias"),
    "tp2-etp1-ep2-alltoall": (2, TP2 + EP2 + ["--expert-tensor-parallel-size", "1"] + A2A, "top2-softmax"),
    "tp2-etp1-ep2-allgather": (2, TP2 + EP2 + ["--expert-tensor-parallel-size", "1"] + AG, "shared-gate"),
    "ep2-alltoall-per-token": (2, EP2 + A2A, "per-token"),
    "ep2-tp2-sp-allgather-per-token": (4, EP2 + TP2 + AG, "per-token"),
    "ep4-alltoall": (4, ["--expert-model-parallel-size", "4"] + A2A, "top2-softmax"),
    "ep4-allgather": (4, ["--expert-model-parallel-size", "4"] + AG, "sigmoid-bias"),
    "ep2-tp2-sp-alltoall": (4, EP2 + TP2 + A2A, "top2-softmax"),
    "ep2-tp2-sp-allgather": (4, EP2 + TP2 + AG, "shared-gate"),
    "ep2-pp2-alltoall": (4, EP2 + ["--pipeline-model-parallel-size", "2"] + A2A, "sigmoid-bias"),
    "ep2-dp4-distopt-alltoall": (4, EP2 + ["--use-distributed-optimizer"] + A2A, "top2-softmax"),
    "ep2-dp4-distopt-allgather": (4, EP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                            "--ddp-bucket-size", "2000"] + AG, "capacity-probs"),
    # routing forced to what real data does (FORCE): ranks, experts with no tokens
    "forced-ep2-allgather-rank1-empty": (2, EP2 + AG, "forced-rank0-experts"),
    "forced-ep2-alltoall-rank1-empty": (2, EP2 + A2A, "forced-rank0-experts"),
    "forced-ep2-alltoall-grouped-rank1-empty": (2, EP2 + A2A + ["--moe-grouped-gemm"], "forced-rank0-experts"),
    "forced-ep2-alltoall-recompute-rank1-empty": (2, EP2 + A2A + ["--recompute-granularity", "full",
                                                                  "--recompute-method", "uniform",
                                                                  "--recompute-num-layers", "1"],
                                                  "forced-rank0-experts"),
    "forced-ep2-alltoall-expert-empty": (2, EP2 + A2A, "forced-expert3-empty"),
    "forced-ep2-allgather-one-expert": (2, EP2 + AG, "forced-one-expert-top1"),
    "forced-ep2-alltoall-one-expert": (2, EP2 + A2A, "forced-one-expert-top1"),
    "forced-ep2-alltoall-over-capacity": (2, EP2 + A2A, "forced-over-capacity"),
    "forced-tp2-etp1-ep2-alltoall-rank1-empty": (2, TP2 + EP2 + ["--expert-tensor-parallel-size", "1"] + A2A,
                                                 "forced-rank0-experts"),
    "forced-ep4-allgather-ranks23-empty": (4, ["--expert-model-parallel-size", "4"] + AG, "forced-rank0-experts"),
    "forced-ep4-alltoall-ranks23-empty": (4, ["--expert-model-parallel-size", "4"] + A2A, "forced-rank0-experts"),
    "forced-ep2-etp2-sp-allgather-rank1-empty": (4, EP2 + TP2 + AG, "forced-rank0-experts"),
    "forced-ep2-etp2-sp-alltoall-one-expert": (4, EP2 + TP2 + A2A, "forced-one-expert-top1"),
    "forced-ep2-pp2-alltoall-rank1-empty": (4, EP2 + ["--pipeline-model-parallel-size", "2"] + A2A,
                                            "forced-rank0-experts"),
    "forced-ep2-pp2-allgather-one-expert": (4, EP2 + ["--pipeline-model-parallel-size", "2"] + AG,
                                            "forced-one-expert-top1"),
    "forced-ep2-dp4-distopt-alltoall-rank1-empty": (4, EP2 + ["--use-distributed-optimizer"] + A2A,
                                                    "forced-rank0-experts"),
}


@pytest.fixture(scope="module")
def results():
    refs = run_distributed(_worker, 1, {v: (MODEL[v], v) for v in MODEL})[0]
    got = {}
    for world in (2, 4):
        cases = {name: (flags + MODEL[variant], variant) for name, (w, flags, variant) in CASES.items()
                 if w == world}
        got.update(run_distributed(_worker, world, cases, timeout=600)[0])
    return refs, got


def _close(got, want, what):
    """rtol 1e-5; elements near zero are held to 1e-5 of the tensor's largest magnitude (reduction order)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_equals_one_process(results, name):
    refs, got = results
    ref, out = refs[CASES[name][2]], got[name]
    _close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), f"{name} losses")
    _close(torch.tensor(out["norms"]), torch.tensor(ref["norms"]), f"{name} grad norms (each expert counted once)")
    assert len(out["grads"]) == len(ref["grads"]) == ITERS
    for it, (g, r) in enumerate(zip(out["grads"], ref["grads"])):
        assert sorted(g) == sorted(r), f"{name}: parameter names differ"
        for param in r:
            got, want = g[param], r[param]
            if got.shape[0] != want.shape[0]:  # the vocabulary is padded to a multiple of 128 x TP
                rows = min(got.shape[0], want.shape[0])
                assert not abs(got[rows:]).any() and not abs(want[rows:]).any()
                got, want = got[:rows], want[:rows]
            _close(got, want, f"{name} iteration {it + 1} gradient of {param}")
    for it, (b, r) in enumerate(zip(out["biases"], ref["biases"])):
        for param in r:
            _close(b[param], r[param], f"{name} iteration {it + 1} {param}")
    # the logged MoE metrics do not depend on the layout
    for it, (m, r) in enumerate(zip(out["metrics"], ref["metrics"])):
        assert sorted(m) == sorted(r)
        for key in r:
            want = [v for v in r[key] if v is not None] if isinstance(r[key], list) else r[key]
            have = [v for v in m[key] if v is not None] if isinstance(m[key], list) else m[key]
            _close(have, want, f"{name} iteration {it + 1} metric {key}")


def test_reference_routes_and_learns(results):
    refs, _ = results
    for variant, ref in refs.items():
        assert ref["losses"][-1] < ref["losses"][0], f"{variant}: loss should fall: {ref['losses']}"
        assert min(ref["norms"]) > 0.5, f"{variant}: the clip should be active: {ref['norms']}"
    # metrics: every token goes to k experts unless dropped; losses near their balanced values
    for variant, ref in refs.items():
        for m in ref["metrics"]:
            k = 1 if "top1" in variant else 2
            routed = 8 * 16 * k  # global batch x sequence x top-k, per layer
            assert m["tokens_per_expert_max"] >= routed / 4 * (1 - m["dropped_token_fraction"]) - 1e-6
            assert m["expert_imbalance"] >= 1.0
            if "capacity" not in variant:
                assert m["dropped_token_fraction"] == 0.0
            else:
                assert 0 < m["dropped_token_fraction"] < 0.5
    bias = refs["sigmoid-bias"]["biases"]
    assert any(abs(t).sum() > 0 for t in bias[-1].values()), "the expert bias should move"
    # every expert receives gradient (tokens reach all of them) and the router learns
    g = refs["top2-softmax"]["grads"][0]
    fc1 = g["decoder.layers.0.mlp.experts.linear_fc1.weight"]
    assert all(abs(fc1[e]).sum() > 0 for e in range(4))
    assert abs(g["decoder.layers.0.mlp.router.weight"]).sum() > 0
    # the forced routings route as forced: exactly the experts they leave tokens to get gradient
    for variant, experts in (("forced-rank0-experts", {0, 1}), ("forced-expert3-empty", {0, 1, 2}),
                             ("forced-one-expert-top1", {0}), ("forced-over-capacity", {0, 1, 2})):
        for it, g in enumerate(refs[variant]["grads"]):
            fc1 = g["decoder.layers.0.mlp.experts.linear_fc1.weight"]
            assert {e for e in range(4) if abs(fc1[e]).sum() > 0} == experts, (variant, it)
