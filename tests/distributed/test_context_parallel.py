"""Context parallelism through ``pretrain()`` is the one-process model: for GPT-2 and Llama (GQA), every CP comm
type at CP 2 and 4, a2a+p2p 2 x 2, TP 2 x CP 2 with SP, CP 2 x PP 2 (interleaved too), CP 2 x DP 2 with the
distributed optimizer and CP 2 with full or selective recompute give the losses and gradient norms of 3
iterations and the parameters after every one of them of one process (fp32, rtol 1e-5), the CP replicas of each
parameter agreeing; the padded vocabulary rows stay zero. Plain SGD makes the parameters a linear function of the
gradients, so equal parameters after every step mean equal gradients."""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import global_tensors, run_distributed
from megatronish.training import pretrain as training
from megatronish.training.pretrain import pretrain

ITERS = 6
# Iterations run per world size: the 2- and 4-rank layouts run the first half of the reference's (the suite's time);
# every step's loss, grad norm and parameters are compared either way
ITERS_AT = {2: ITERS // 2, 4: ITERS // 2}
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
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
FOUR_LAYERS = ["--num-layers", "4"]  # the interleaved layout's (the rest train 2 layers: the suite's time)
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
        "cp2-pp2-vp2": CP2 + FOUR_LAYERS + ["--pipeline-model-parallel-size", "2",
                                            "--num-layers-per-virtual-pipeline-stage", "1"],
        "cp2-dp2-distopt": CP2 + ["--use-distributed-optimizer", "--cp-comm-type", "allgather"]},
}


def _run(argv, world, iters=ITERS):
    """Each iteration's loss and gradient norm, and the global parameters after it (every replica agreeing)."""
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(BASE + argv), world))
    losses, norms, params = [], [], []
    for _ in range(iters):
        result = training.train_step(run, state)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        params.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel).items()})  # by value
    return losses, norms, params, run.cfg.model.vocab_size


def _worker(rank, world, cases):
    out = {}
    for name, argv in cases.items():
        result = _run(argv, world, ITERS_AT.get(world, ITERS))
        if rank == 0:
            out[name] = result
    return out


@pytest.fixture(scope="module")
def references():
    """Each flavor's one-process run, at 2 layers and (its name + ``-4-layers``) at 4."""
    return run_distributed(_worker, 1, {**FLAVORS, **{f"{f}-4-layers": FOUR_LAYERS + extra
                                                      for f, extra in FLAVORS.items()}})[0]


def _reference_of(flavor, argv):
    return f"{flavor}-4-layers" if "--num-layers" in argv else flavor


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _assert_same(got, ref, what):
    """``got`` against the first iterations of the one-process reference (all ITERS of them, or fewer)."""
    (losses, norms, steps, vocab), (r_losses, r_norms, r_steps, r_vocab) = got, ref
    n = len(steps)
    assert n in (ITERS, ITERS // 2), what
    r_losses, r_norms, r_steps = r_losses[:n], r_norms[:n], r_steps[:n]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(r_norms), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} grad norms: {m}")
    assert len(steps) == len(r_steps) and vocab == r_vocab, what
    for it, (params, r_params) in enumerate(zip(steps, r_steps)):
        assert params.keys() == r_params.keys(), what
        for n, p in params.items():
            p, r = torch.from_numpy(p), torch.from_numpy(r_params[n])
            if n in VOCAB_ROWS:  # padded to a multiple of 128 x TP: the padding rows stay zero
                assert p.shape[0] > vocab and r.shape[0] > vocab, (what, n, p.shape, r.shape)
                assert not p[vocab:].any() and not r[vocab:].any(), f"{what} iteration {it + 1}: padded rows of {n}"
                p, r = p[:vocab], r[:vocab]
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} iteration {it + 1} {n}: {m}")


# a2a scatters the local query groups over CP: Llama's 2 groups allow CP 2, GPT-2's 4 heads CP 4
ONLY = {("gpt2", 4): {"cp4-a2a": ["--context-parallel-size", "4", "--cp-comm-type", "a2a"]}}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_equals_one_process(world, references):
    for flavor, extra in FLAVORS.items():
        cases = {name: argv + extra for name, argv in {**CASES[world], **ONLY.get((flavor, world), {})}.items()}
        got = run_distributed(_worker, world, cases, timeout=600)[0]
        for name, result in got.items():
            _assert_same(result, references[_reference_of(flavor, cases[name])], f"{flavor} {name}")


def _resume_worker(rank, world, argv, tmp):
    state = pretrain(configs_from_args(parse_args(BASE + argv), world)).state
    return [loss for _, loss in state.history], state.consumed_samples


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(references, tmp_path):
    """CP does not change parameter shards: a save at CP 2 (iteration 4 of 6, --exit-interval) continues at CP 1
    and CP 4 with the one-process losses of iterations 5-6, from the saved data position."""
    ckpt = str(tmp_path / "ckpt")
    first, consumed = run_distributed(_resume_worker, 2, CP2 + ["--save", ckpt, "--exit-interval", "4"], ckpt)[0]
    ref = references["gpt2"][0]
    assert consumed == 32
    torch.testing.assert_close(torch.tensor(first), torch.tensor(ref[:4]), rtol=1e-5, atol=0)
    for world, cp in ((1, []), (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a"])):
        rest, consumed = run_distributed(_resume_worker, world, cp + ["--load", ckpt], ckpt)[0]
        assert consumed == 8 * ITERS
        torch.testing.assert_close(torch.tensor(rest), torch.tensor(ref[4:]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"resumed at world {world}: {m}")


def _bf16_worker(rank, world, argv):
    state = pretrain(configs_from_args(parse_args(BASE + argv + ["--bf16", "--train-iters", "4"]), world)).state
    return [loss for _, loss in state.history]


def test_bf16_context_parallel_equals_bf16_one_process():
    """bf16 (fp32 main weights): CP 2 p2p and a2a against the bf16 one-process run, at the tolerance the
    mixed-precision tests measure for bf16 layouts (2e-4)."""
    ref = run_distributed(_bf16_worker, 1, FLAVORS["llama"])[0]
    for t in ("p2p", "a2a"):
        got = run_distributed(_bf16_worker, 2, FLAVORS["llama"] + CP2 + ["--cp-comm-type", t])[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-4, atol=0,
                                   msg=lambda m: f"bf16 CP2 {t}: {m}")
