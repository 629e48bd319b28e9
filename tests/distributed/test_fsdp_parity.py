"""FSDP2 (``--use-torch-fsdp2``): every layout trains exactly as one process.

Each case runs 3 iterations through the training step (setup / train_step) and compares against a one-process
run of the same model (same seed, no weight copying): the losses, the gradient norms, and every parameter's
reduced gradient of every iteration (assembled from the ranks' FSDP shards of their tensor-parallel slices, before
the optimizer step clips them), fp32, rtol 1e-5. SGD with momentum and an active clip (the norm exceeds 0.5), so a
wrong reduction, scale or norm shows up in the following iterations' numbers.
"""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.optim.clip_grads import global_norm
from megatronish.parallel import groups
from megatronish.parallel.fsdp import is_sharded
from megatronish.testing import assert_parity, global_tensors, run_distributed
from megatronish.training import pretrain as training

ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", str(ITERS), "--optimizer", "sgd", "--lr", "0.3",
        "--lr-decay-style", "constant", "--clip-grad", "0.5", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "7"]
FSDP = ["--use-torch-fsdp2"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
FOUR_LAYERS = ["--num-layers", "4"]  # the interleaved layout's (the rest train 2 layers: the suite's time)
CASES = {  # name: (world, flags)
    "fsdp-dp2": (2, FSDP),
    "fsdp-dp2-recompute": (2, FSDP + RECOMPUTE),
    "fsdp-dp4": (4, FSDP),
    "fsdp-dp4-untied-never-reshard": (4, FSDP + ["--untie-embeddings-and-output-weights",
                                                 "--fsdp-reshard-after-forward", "never"]),
    "tp2-fsdp2": (4, FSDP + TP2),
    "tp2-fsdp2-recompute-swiglu": (4, FSDP + TP2 + RECOMPUTE + ["--swiglu"]),
    "pp2-fsdp2": (4, FSDP + PP2),
    "pp2-fsdp2-recompute-always-reshard": (4, FSDP + PP2 + RECOMPUTE + ["--fsdp-reshard-after-forward", "always"]),
    "cp2-fsdp2": (4, FSDP + ["--context-parallel-size", "2"]),  # the mesh is DP x CP
    # two roots per rank: 2 stages x 2 virtual stages of 1 layer
    "pp2-vp2-fsdp2": (4, FSDP + PP2 + FOUR_LAYERS + ["--num-layers-per-virtual-pipeline-stage", "1"]),
}
BF16 = {"fsdp-dp2-bf16": FSDP + ["--bf16"], "ddp-dp2-bf16": ["--bf16"]}  # FSDP2's mixed-precision policy


def _run(argv, world):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    run, state = training.setup(cfg)
    sharded = all(is_sharded(p) for m in run.models for p in m.parameters())
    grads = []
    step = run.optimizer.step

    def step_and_record():  # the reduced gradients, before clipping and the update
        grads.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel, grads=True).items()})
        return step()

    run.optimizer.step = step_and_record
    losses, norms = [], []
    for _ in range(ITERS):
        result = training.train_step(run, state)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    params_norm = global_norm([p for m in run.models for p in m.parameters()], use_grad=False, parallel=run.parallel)
    return {"losses": losses, "grads": grads, "norms": norms, "sharded": sharded, "params_norm": params_norm}


def _worker(rank, world, cases):
    out = {name: _run(argv, world) for name, argv in cases.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    variants = {"tied": [], "untied": ["--untie-embeddings-and-output-weights"], "swiglu": ["--swiglu"],
                "tied-4-layers": FOUR_LAYERS}
    refs = run_distributed(_worker, 1, variants)[0]
    got = {}
    for world in (2, 4):
        cases = {name: flags for name, (w, flags) in CASES.items() if w == world}
        if world == 2:
            cases.update(BF16)
        got.update(run_distributed(_worker, world, cases, timeout=600)[0])
    return refs, got


def _ref_of(flags):
    return "untied" if "--untie-embeddings-and-output-weights" in flags else "swiglu" if "--swiglu" in flags \
        else "tied-4-layers" if "--num-layers" in flags else "tied"


@pytest.mark.parametrize("name", sorted(CASES))
def test_fsdp_layout_equals_one_process(results, name):
    refs, got = results
    ref, out = refs[_ref_of(CASES[name][1])], got[name]
    assert out["sharded"], f"{name}: the parameters should be FSDP2 DTensors"
    assert_parity(out["losses"], ref["losses"], f"{name} losses")
    assert_parity(out["norms"], ref["norms"], f"{name} grad norms")
    assert_parity(out["params_norm"], ref["params_norm"], f"{name} params norm (--log-params-norm)")
    for it, (g, r) in enumerate(zip(out["grads"], ref["grads"])):
        assert sorted(g) == sorted(r), f"{name}: parameter names differ"
        for param in r:
            a, b = torch.as_tensor(g[param]), torch.as_tensor(r[param])
            if a.shape[0] != b.shape[0]:  # the vocabulary is padded to a multiple of 128 x TP
                rows = min(a.shape[0], b.shape[0])
                assert not a[rows:].abs().any() and not b[rows:].abs().any()
                a, b = a[:rows], b[:rows]
            assert_parity(a, b, f"{name} iteration {it + 1} gradient of {param}")


def test_reference_clips(results):
    refs, _ = results
    for variant, ref in refs.items():
        assert min(ref["norms"]) > 0.5, f"{variant}: the clip should be active: {ref['norms']}"
        assert not ref["sharded"]


def test_bf16_compute_through_the_mixed_precision_policy(results):
    """bf16 compute with fp32 master shards and fp32 reductions: the losses follow the fp32 run as closely as
    our DDP's bf16 run (fp32 master copies, fp32 gradient buffers) does."""
    refs, got = results
    ref = torch.tensor(refs["tied"]["losses"])
    fsdp, ddp = torch.tensor(got["fsdp-dp2-bf16"]["losses"]), torch.tensor(got["ddp-dp2-bf16"]["losses"])
    assert got["fsdp-dp2-bf16"]["sharded"] and not got["ddp-dp2-bf16"]["sharded"]
    assert not torch.equal(fsdp, ref), "bf16 compute should differ from fp32"
    assert (fsdp - ref).abs().max() < 1e-2 and (fsdp - ref).abs().max() < 4 * (ddp - ref).abs().max() + 1e-3
