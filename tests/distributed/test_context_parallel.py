"""Context parallelism through ``pretrain()`` is the one-process model: for GPT-2 and Llama (GQA), every CP comm
type at CP 2 and 4, a2a+p2p 2 x 2, TP 2 x CP 2 with SP, CP 2 x PP 2 (interleaved too), CP 2 x DP 2 with the
distributed optimizer and CP 2 with full or selective recompute give the losses and gradient norms of 8
iterations and the final parameters of one process (fp32, rtol 1e-5). Plain SGD makes the parameters a linear
function of the gradients, so equal parameters after every step mean equal gradients."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel.init import gather_to_global
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

ITERS = 8
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", str(ITERS), "--lr", "0.5",
        "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--seed", "11"]
FLAVORS = {
    "gpt2": [],
    "llama": ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"],
}
CP2 = ["--context-parallel-size", "2"]
CASES = {
    2: {**{f"cp2-{t}": CP2 + ["--cp-comm-type", t] for t in ("p2p", "a2a", "allgather")},
        "cp2-full-recompute": CP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"],
        "cp2-selective-recompute": CP2 + ["--recompute-activations", "--cp-comm-type", "a2a"]},
    4: {"cp4-p2p": ["--context-parallel-size", "4"],
        "cp4-allgather": ["--context-parallel-size", "4", "--cp-comm-type", "allgather"],
        "cp4-a2a+p2p-2x2": ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                            "--hierarchical-context-parallel-sizes", "2", "2"],
        "tp2-cp2-sp": CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "cp2-pp2": CP2 + ["--pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a"],
        "cp2-pp2-vp2": CP2 + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        "cp2-dp2-distopt": CP2 + ["--use-distributed-optimizer", "--cp-comm-type", "allgather"]},
}


def _run(argv, world, tmp):
    metrics = os.path.join(tmp, f"m{dist.get_rank() if dist.is_initialized() else 0}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    state = pretrain(configs_from_args(parse_args(BASE + argv + ["--metrics-file", metrics]), world))
    ctx = state.context
    params = {}
    for model in ctx.models:
        for name, p in model.named_global_parameters():
            params[name] = gather_to_global(p.detach(), p.desc, ctx.parallel.tp_group)
    everyone = [None] * world
    dist.all_gather_object(everyone, params)
    merged = {k: v.numpy() for part in everyone for k, v in part.items()}  # by value through the result pipe
    norms = [json.loads(line)["grad_norm"] for line in open(metrics)] if os.path.exists(metrics) else None
    dist.all_gather_object(everyone, norms)  # only the logging rank (last stage) writes metrics
    norms = next(n for n in everyone if n is not None)
    return [loss for _, loss in state.history], norms, merged


def _worker(rank, world, cases, tmp):
    out = {}
    for name, argv in cases.items():
        losses, norms, params = _run(argv, world, tmp)
        if rank == 0:
            out[name] = (losses, norms, params)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cp-ref"))
    return {f: run_distributed(_worker, 1, {f: extra}, tmp)[0][f] for f, extra in FLAVORS.items()}


def _assert_same(got, ref, what):
    (losses, norms, params), (r_losses, r_norms, r_params) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(r_norms), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} grad norms: {m}")
    assert params.keys() == r_params.keys(), what
    for n, p in params.items():
        p, r = torch.from_numpy(p), torch.from_numpy(r_params[n])
        p = p[: r.shape[0]] if p.shape != r.shape else p  # vocabulary padded further at TP 2
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {n}: {m}")


# a2a scatters the local query groups over CP: Llama's 2 groups allow CP 2, GPT-2's 4 heads CP 4
ONLY = {("gpt2", 4): {"cp4-a2a": ["--context-parallel-size", "4", "--cp-comm-type", "a2a"]}}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_equals_one_process(world, references, tmp_path):
    for flavor, extra in FLAVORS.items():
        cases = {name: argv + extra for name, argv in {**CASES[world], **ONLY.get((flavor, world), {})}.items()}
        got = run_distributed(_worker, world, cases, str(tmp_path), timeout=600)[0]
        for name, result in got.items():
            _assert_same(result, references[flavor], f"{flavor} {name}")


def _resume_worker(rank, world, argv, tmp):
    state = pretrain(configs_from_args(parse_args(BASE + argv), world))
    return [loss for _, loss in state.history], state.consumed_samples


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(references, tmp_path):
    """CP does not change parameter shards: a save at CP 2 (iteration 4 of 8, --exit-interval) continues at CP 1
    and CP 4 with the one-process losses of iterations 5-8, from the saved data position."""
    ckpt = str(tmp_path / "ckpt")
    first, consumed = run_distributed(_resume_worker, 2, CP2 + ["--save", ckpt, "--exit-interval", "4"], ckpt)[0]
    ref = references["gpt2"][0]
    assert consumed == 32
    torch.testing.assert_close(torch.tensor(first), torch.tensor(ref[:4]), rtol=1e-5, atol=0)
    for world, cp in ((1, []), (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a"])):
        rest, consumed = run_distributed(_resume_worker, world, cp + ["--load", ckpt], ckpt)[0]
        assert consumed == 64
        torch.testing.assert_close(torch.tensor(rest), torch.tensor(ref[4:]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"resumed at world {world}: {m}")


def _bf16_worker(rank, world, argv):
    state = pretrain(configs_from_args(parse_args(BASE + argv + ["--bf16", "--train-iters", "4"]), world))
    return [loss for _, loss in state.history]


def test_bf16_context_parallel_equals_bf16_one_process():
    """bf16 (fp32 main weights): CP 2 p2p and a2a against the bf16 one-process run, at the tolerance the
    mixed-precision tests measure for bf16 layouts (2e-4)."""
    ref = run_distributed(_bf16_worker, 1, FLAVORS["llama"])[0]
    for t in ("p2p", "a2a"):
        got = run_distributed(_bf16_worker, 2, FLAVORS["llama"] + CP2 + ["--cp-comm-type", t])[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-4, atol=0,
                                   msg=lambda m: f"bf16 CP2 {t}: {m}")
