"""``--calculate-per-token-loss`` (Megatron's semantics): the loss and its gradients are normalized by the loss
tokens of the whole global batch, across microbatches and DP (x CP), not per microbatch.

Data: a corpus of short documents with ``--eod-mask-loss``, so every microbatch has a different number of loss
tokens and the normalization matters.

- One process: the iteration's gradients equal those of ``sum(token losses) / sum(tokens)`` over the global
  batch computed directly on the model, and differ from the per-microbatch-mean default.
- Every layout (TP, PP with and without interleaving, DP with accumulation, CP, TP x PP, TP x DP, PP x DP) gives
  one process's fp32 losses and every gradient (gathered to its global shape) at rtol 1e-5, same seed; the
  distributed optimizer and the native fused cross entropy give the same losses.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.data.gpt_dataset import get_batch
from megatronish.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path
from megatronish.parallel import groups
from megatronish.parallel.init import gather_to_global
from megatronish.testing import run_distributed
from megatronish.training.pretrain import apply_update, compute_gradients, setup

V = 95  # NullTokenizer --vocab-size 95: ids 0..94, eod 95
EOD = V
ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V),
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "0.5", "--optimizer", "sgd",
        "--sgd-momentum", "0", "--clip-grad", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "9", "--eod-mask-loss"]
PER_TOKEN = ["--calculate-per-token-loss"]
FOUR_LAYERS = ["--num-layers", "4"]  # the interleaved layout's (the rest train 2 layers: the suite's time)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("per_token")
    prefix = str(d / "short_docs")
    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(300):
        n = int(rng.integers(2, 12))
        builder.add_document(np.append(rng.integers(0, V, n - 1), EOD), [n])
    builder.finalize(get_idx_path(prefix))
    return ["--train-data-path", prefix, "--data-cache-path", str(d / "cache")]


def _global_grads(run):
    """Every parameter's gradient, gathered to its global shape, by global name (this rank's chunks)."""
    out = {}
    for chunk in run.chunks:
        for name, p in chunk.module.named_global_parameters():
            out[name] = gather_to_global(p.main_grad.float(), p.desc, run.parallel.tp_group).numpy()
    return out


def _train(rank, world, cases, data, direct=None):
    """Per case: ITERS iterations through compute_gradients / apply_update; the losses and the gradients of the
    first and last iteration (merged over ranks)."""
    out = {}
    for name, argv in cases.items():
        groups.destroy_model_parallel()
        run, state = setup(configs_from_args(parse_args(BASE + data + argv), world))
        losses, grads = [], []
        for it in range(ITERS):
            if name == direct and it == 0:  # the case whose model also computes the direct gradients
                out["direct"] = _direct_grads(run)
            losses.append(compute_gradients(run, state))
            if it in (0, ITERS - 1):
                merged = [None] * world
                dist.all_gather_object(merged, _global_grads(run))
                grads.append({k: v for part in merged for k, v in part.items()})
            apply_update(run, state, losses[-1])
        out[name] = (losses, grads)
    return out


def _direct_grads(run):
    """One process: the whole global batch through the bare model, loss = sum of masked token losses / tokens."""
    model, ddp = run.models[0], run.chunks[0]
    batch = get_batch(run.train_ds, list(range(8)))
    ddp.zero_grad_buffer()
    losses = model(batch["tokens"].long(), labels=batch["labels"].long())
    mask = batch["loss_mask"].float()
    counts = mask.view(4, 2, -1).sum((1, 2))  # tokens of each micro-batch of 2: they differ
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.main_grad.detach().clone().numpy() for n, p in model.named_global_parameters()}  # DDP's hook
    ddp.zero_grad_buffer()
    return loss.item(), grads, counts.tolist()


def _close(got, ref, what):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    for i, (g, r) in enumerate(zip(got[1], ref[1])):
        assert g.keys() == r.keys(), what
        for n in r:
            rows = V + 1 if g[n].shape != r[n].shape else None  # the vocabulary is padded to 128 x TP
            torch.testing.assert_close(torch.from_numpy(g[n][:rows]), torch.from_numpy(r[n][:rows]), rtol=1e-5,
                                       atol=1e-7,
                                       msg=lambda m: f"{what} iteration-{i} grad {n}: {m}")


@pytest.fixture(scope="module")
def reference(corpus):
    cases = {"per_token": ["--micro-batch-size", "2"] + PER_TOKEN, "default": ["--micro-batch-size", "2"],
             "per_token-4-layers": ["--micro-batch-size", "2"] + FOUR_LAYERS + PER_TOKEN}
    return run_distributed(_train, 1, cases, corpus, direct="default")[0]


def test_one_process_normalizes_by_the_global_batch_tokens(reference):
    direct_loss, direct_grads, counts = reference["direct"]
    assert len(set(counts)) > 1, f"the micro-batches must have different token counts: {counts}"
    losses, grads = reference["per_token"]
    assert losses[0] == pytest.approx(direct_loss, rel=1e-6)  # Megatron's reporting: sum / tokens
    for n, g in direct_grads.items():
        torch.testing.assert_close(torch.from_numpy(grads[0][n]), torch.from_numpy(g), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{n}: {m}")
    # the default (a mean per micro-batch, averaged) reports the same first loss but has other gradients
    default_losses, default_grads = reference["default"]
    assert default_losses[0] == pytest.approx(losses[0], rel=1e-6)
    diff = max(np.abs(default_grads[0][n] - g).max() / np.abs(g).max() for n, g in direct_grads.items())
    assert diff > 1e-3, diff


def test_every_layout_equals_one_process(reference, corpus):
    ref = reference["per_token"]
    two = {"tp2": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"],
           "pp2-vp2": ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"] + FOUR_LAYERS,
           "dp2": ["--micro-batch-size", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
           "cp2": ["--micro-batch-size", "2", "--context-parallel-size", "2"]}
    for name, got in run_distributed(_train, 2, {k: v + PER_TOKEN for k, v in two.items()}, corpus)[0].items():
        _close(got, reference["per_token-4-layers"] if FOUR_LAYERS[0] in two[name] else ref, name)
    four = {"tp2-pp2": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2"],
            "tp2-dp2": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"],
            "pp2-dp2": ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]}
    for name, got in run_distributed(_train, 4, {k: v + PER_TOKEN for k, v in four.items()}, corpus)[0].items():
        _close(got, ref, name)


def test_distributed_optimizer_and_native_fused_loss(reference, corpus):
    ref_losses = reference["per_token"][0]
    cases = {"dp2-distopt": ["--micro-batch-size", "2", "--use-distributed-optimizer"],
             "tp2-fused-ce": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                              "--cross-entropy-loss-fusion"]}
    for name, (losses, grads) in run_distributed(_train, 2, {k: v + PER_TOKEN for k, v in cases.items()},
                                                 corpus)[0].items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        if name == "tp2-fused-ce":
            _close((losses, grads), reference["per_token"], name)
