"""Data parallelism (with and without overlapped, bucketed reduction) and gradient accumulation give the
single-process losses; at DP 2, DP 4 and DP 2 with the distributed optimizer every iteration's reduced gradients
and updated parameters equal one process's (rtol 1e-5); the global grad norm under TP x DP equals the
single-process norm; a skipped DP reduction is caught by the test helper that assembles global tensors."""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import gpt2
from megatronish.model import GPTModel
from megatronish.optim.clip_grads import global_norm
from megatronish.parallel import groups
from megatronish.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megatronish.parallel.dims import ParallelDims
from megatronish.testing import assert_parity, global_tensors, run_distributed
from megatronish.training import pretrain as training
from megatronish.training.pretrain import pretrain

ITERS = 10
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "100",
        "--seed", "11"]


def _losses(argv, world):
    cfg = configs_from_args(parse_args(BASE + argv), world)
    return [loss for _, loss in pretrain(cfg).state.history]


def _worker(rank, world, cases):
    out = {}
    for name, argv in cases.items():
        groups.destroy_model_parallel()
        out[name] = _losses(argv, world)
    return out


def _reference(argv):
    groups.destroy_model_parallel()
    # single process: run in one forked rank so the parent stays free of process groups
    return run_distributed(_worker, 1, {"ref": argv})[0]["ref"]


# Adam is nearly invariant to a gradient's scale; SGD (with clipping off) is not, so a wrong DP average
# or a missed reduction shows up in its losses.
OPTIMIZERS = {"adam": ["--optimizer", "adam"], "sgd": ["--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0"]}


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def opt(request):
    return OPTIMIZERS[request.param]


@pytest.fixture(scope="module")
def reference(opt):
    return _reference(["--micro-batch-size", "8"] + opt)


def _assert_losses(got, ref, what):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what}: {m}")


def test_loss_falls_and_accumulation_parity(reference, opt):
    assert reference[-1] < reference[0] - 0.05, f"loss should fall: {reference}"
    accum = _reference(["--micro-batch-size", "1"] + opt)  # 8 microbatches of 1
    _assert_losses(accum, reference, "micro 1 x 8 vs micro 8 x 1")


def test_dp_and_tp_dp_parity(reference, opt):
    cases = {
        "dp2": ["--micro-batch-size", "2"],
        "dp2-overlap-buckets": ["--micro-batch-size", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "500"],
        "tp2": ["--micro-batch-size", "4", "--tensor-model-parallel-size", "2"],
        "tp2-sp-overlap": ["--micro-batch-size", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--overlap-grad-reduce", "--ddp-bucket-size", "700"],
    }
    cases = {k: v + opt for k, v in cases.items()}
    dp2 = {k: v for k, v in cases.items() if k.startswith("dp2")}
    for name, losses in run_distributed(_worker, 2, dp2)[0].items():
        _assert_losses(losses, reference, name)
    tp_dp = {"tp2-dp2": cases["tp2"][:1] + ["2"] + cases["tp2"][2:],  # micro batch 2 instead of 4
             "tp2-dp2-sp-overlap": ["--micro-batch-size", "2"] + cases["tp2-sp-overlap"][2:]}
    for name, losses in run_distributed(_worker, 4, tp_dp)[0].items():
        _assert_losses(losses, reference, name)


def _trace(argv, world):
    """Each iteration's loss, reduced gradients (before clipping and the update) and updated parameters, as global
    tensors."""
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(BASE + argv), world))
    grads, params, losses = [], [], []
    step = run.optimizer.step

    def step_and_record():
        grads.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel, grads=True,
                                                                optimizer=run.optimizer).items()})
        return step()

    run.optimizer.step = step_and_record
    for _ in range(ITERS):
        losses.append(training.train_step(run, state).loss)
        params.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel).items()})
    return {"losses": losses, "grads": grads, "params": params, "distributed": run.optimizer.distributed}


def _trace_worker(rank, world, cases):
    out = {name: _trace(argv, world) for name, argv in cases.items()}
    return out if rank == 0 else None


# Adam without linear biases (the key bias's true gradient is zero: Adam would turn its rounding noise into
# full-size updates), and SGD, whose update is the gradient itself
TRACED = {"adam": ["--optimizer", "adam", "--disable-bias-linear"], "sgd": OPTIMIZERS["sgd"]}
DIST = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def traces():
    cases = {f"{o}-{layout}": ["--micro-batch-size", str(8 // dp)] + flags + TRACED[o]
             for o in TRACED for layout, dp, flags in (("ref", 1, []), ("dp2", 2, []), ("dp2-distopt", 2, DIST),
                                                       ("dp4", 4, []))}
    out = {}
    for world in (1, 2, 4):
        mine = {k: v for k, v in cases.items() if v[1] == str(8 // world)}
        out.update(run_distributed(_trace_worker, world, mine, timeout=600)[0])
    return out


@pytest.mark.parametrize("layout", ["dp2", "dp2-distopt", "dp4"])
@pytest.mark.parametrize("optimizer", sorted(TRACED))
def test_gradients_and_parameters_every_iteration(traces, optimizer, layout):
    ref, got = traces[f"{optimizer}-ref"], traces[f"{optimizer}-{layout}"]
    assert got["distributed"] == layout.endswith("distopt") and not ref["distributed"]
    assert len(got["grads"]) == len(got["params"]) == len(ref["grads"]) == ITERS
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, ref["losses"]
    assert_parity(got["losses"], ref["losses"], f"{layout} losses")
    for it in range(ITERS):
        for what in ("grads", "params"):
            r, g = ref[what][it], got[what][it]
            assert sorted(g) == sorted(r), f"{layout}: parameter names differ"
            for name in r:
                assert_parity(g[name], r[name], f"{optimizer} {layout} iteration {it + 1} {what[:-1]} of {name}")


def _skipped_reduction_worker(rank, world):
    """DP 2, different data per rank: with the DP all-reduce skipped the ranks' gradients differ and
    global_tensors refuses them; after it they agree."""
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world))
    cfg = gpt2(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=16,
               attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(cfg, parallel=ctx)
    model.init_parameters(5)
    ddp = DistributedDataParallel(model, dp_group=ctx.dp_cp_group)
    g = torch.Generator().manual_seed(1 + rank)
    ddp(torch.randint(0, 96, (2, 16), generator=g), labels=torch.randint(0, 96, (2, 16), generator=g)).mean().backward()
    try:
        global_tensors([model], ctx, grads=True)
        unreduced = None
    except AssertionError as e:
        unreduced = str(e)
    finalize_model_grads([ddp], ctx)
    reduced = global_tensors([model], ctx, grads=True)
    return unreduced, sorted(reduced)


def test_global_tensors_catches_a_skipped_dp_reduction():
    for unreduced, names in run_distributed(_skipped_reduction_worker, 2):
        assert unreduced and "replicas of" in unreduced and "disagree" in unreduced and "\n" not in unreduced, \
            unreduced
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in names


def _norm_worker(rank, world, tp, ref_norm):
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=tp))
    cfg = gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=16,
               attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(cfg, sequence_parallel=True, parallel=ctx)
    model.init_parameters(5)
    ddp = DistributedDataParallel(model, dp_group=ctx.dp_cp_group, bucket_size=300)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 96, (4, 16), generator=g), torch.randint(0, 96, (4, 16), generator=g)
    dp, dp_rank = groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()
    b = 4 // dp
    ddp(ids[dp_rank * b:(dp_rank + 1) * b], labels=labels[dp_rank * b:(dp_rank + 1) * b]).mean().backward()
    finalize_model_grads([ddp], ctx)
    return global_norm(model.parameters(), parallel=ctx)


def test_global_grad_norm_matches_single_process():
    ref = run_distributed(_norm_worker, 1, 1, None)[0]
    for norm in run_distributed(_norm_worker, 4, 2, ref):  # TP 2 x DP 2, sequence parallel
        assert norm == pytest.approx(ref, rel=1e-5)


def test_pipeline_layouts_through_the_training_loop():
    """pretrain() with PP (1F1B and interleaved) and TP x PP reproduces the single-process losses."""
    deep = ["--num-layers", "4", "--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0"]
    ref = _reference(["--micro-batch-size", "2"] + deep)
    pp2 = {"pp2": ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"] + deep,
           "pp2-vp2": ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"] + deep}
    for name, losses in run_distributed(_worker, 2, pp2)[0].items():
        _assert_losses(losses, ref, name)
    tp_pp = {"tp2-pp2-sp": ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", "--sequence-parallel"] + deep}
    results = run_distributed(_worker, 4, tp_pp)
    for rank_result in results:  # every rank reports the loss, first stage included
        _assert_losses(rank_result["tp2-pp2-sp"], ref, "tp2-pp2-sp")
