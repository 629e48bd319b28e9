"""``--pipeline-schedule`` through pretrain_gpt's path (``configs_from_args`` -> ``setup`` -> ``train_step``) at
PP 2: ZB-H1's losses and gradient norms equal 1F1B's (rtol 1e-6; the same computation, the weight gradients
later), ZBV's (two chunks per rank in a V, the tied embedding's copies both on rank 0) equal them to fp32 rtol
1e-5; a checkpoint saved under ZBV loads under 1F1B (global layer numbers) and the next iteration's loss equals
ZBV's own; an uneven split (``--decoder-first-pipeline-num-layers 1``: 1 + 3 layers) trains as the even one and
its checkpoint continues under the even split (2 + 2). ``--pipeline-model-parallel-layout``: ZBV with an
embedding-only and a loss-only stage (``E|tt|tt|L``, both on rank 0) trains as 1F1B, and a checkpoint saved under
``Et|tttL`` continues under ``E|tt|t|tL`` (PP 2 x VP 2, interleaved) with 1F1B's third loss."""
import os
import tempfile

import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training

ITERS = 3
LAYOUT = "--pipeline-model-parallel-layout"
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "11", "--pipeline-model-parallel-size", "2"]


def _run(argv, world, until=ITERS):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    run, state = training.setup(cfg)
    out = [training.train_step(run, state) for _ in range(until - state.iteration)]
    if cfg.checkpoint.save:
        run.checkpointer.save(state)
        run.checkpointer.wait()
    return [r.loss for r in out], [float(r.grad_norm) for r in out], run.parallel.pp_rank


def _worker(rank, world, cases, save_dir):
    out = {name: _run(argv, world) for name, argv in cases.items()}
    # ZBV (and the uneven splits) save after two iterations; another layout loads that and runs the third
    for name, argv, then in (("zbv", ["--pipeline-schedule", "zbv"], []),
                             ("uneven", ["--decoder-first-pipeline-num-layers", "1"], []),
                             ("layout", [LAYOUT, "Et|tttL"], [LAYOUT, "E|tt|t|tL"])):
        out[f"{name}-saved"] = _run(argv + ["--save", f"{save_dir}-{name}"], world, until=2)
        out[f"{name}-then-1f1b"] = _run(["--load", f"{save_dir}-{name}"] + then, world)
    groups.destroy_model_parallel()
    return out


def test_zero_bubble_schedules_through_the_training_loop():
    cases = {"1f1b": ["--pipeline-schedule", "1f1b"], "zb-h1": ["--pipeline-schedule", "zb-h1"],
             "zbv": ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"],
             "zbv-layout": ["--pipeline-schedule", "zbv", LAYOUT, "E|tt|tt|L"]}
    with tempfile.TemporaryDirectory() as d:
        results = run_distributed(_worker, 2, cases, os.path.join(d, "ckpt"), timeout=300)
    for out in results:  # every rank reports the loss and the norm
        ref_losses, ref_norms, _ = out["1f1b"]
        for name, rtol in (("zb-h1", 1e-6), ("zbv", 1e-5), ("zbv-layout", 1e-5)):
            losses, norms, _ = out[name]
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses,
                                       dtype=torch.float64), rtol=rtol, atol=0, msg=lambda m: f"{name} loss: {m}")
            torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64), torch.tensor(ref_norms,
                                       dtype=torch.float64), rtol=rtol, atol=0, msg=lambda m: f"{name} norm: {m}")
        assert out["zbv-saved"][0] == out["zbv"][0][:2]
        for name in ("uneven", "layout"):
            chained = out[f"{name}-saved"][0] + out[f"{name}-then-1f1b"][0]
            torch.testing.assert_close(torch.tensor(chained, dtype=torch.float64), torch.tensor(
                ref_losses, dtype=torch.float64), rtol=1e-5, atol=0, msg=lambda m: f"{name}, then another: {m}")
        (loaded,), _, _ = out["zbv-then-1f1b"]
        assert abs(loaded - out["zbv"][0][2]) <= 1e-5 * abs(loaded), \
            f"1f1b from the zbv checkpoint: {loaded} vs zbv's third iteration {out['zbv'][0][2]}"
