"""``--rampup-batch-size`` through ``pretrain()`` on DP 2: a run stopped in the middle of the ramp
(``--exit-interval``) and resumed with ``--load`` gives exactly the uninterrupted run: losses, learning rates,
batch sizes and consumed samples of every iteration (the checkpoint restores the consumed samples, which set the
batch size, the data position and the LR schedule). The interrupted and resumed runs read through ``--num-workers 2``
worker processes, the uninterrupted one in the training process: the same batches."""
import json

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import rampup_global_batch_size
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import batches
from megatronish.training.pretrain import pretrain

ITERS = 10
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "18",
        "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "1", "--seed", "21"]


def _run(rank, world, argv, metrics):
    groups.destroy_model_parallel()
    loaders, real = [], batches.MicroBatchLoader

    def recorded(*a, **kw):  # the loaders the run builds, by worker count
        loaders.append(kw["num_workers"])
        return real(*a, **kw)

    batches.MicroBatchLoader = recorded
    try:
        state = pretrain(configs_from_args(parse_args(BASE + argv + ["--metrics-file", metrics]), world)).state
    finally:
        batches.MicroBatchLoader = real
    return state.iteration, state.consumed_samples, loaders


def _records(path):
    return [json.loads(line) for line in open(path)]


def test_resume_in_the_middle_of_the_ramp_is_exact(tmp_path):
    full = str(tmp_path / "full.jsonl")
    run_distributed(_run, 2, [], full)
    ckpt = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--num-workers", "2"]
    first, second = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")
    (stop, consumed, loaders), _ = run_distributed(_run, 2, ckpt + ["--exit-interval", "4"], first)
    assert stop == 4 and consumed == 10  # 2 + 2 + 2 + 4: the ramp has not reached 8 yet
    assert rampup_global_batch_size(consumed, 2, 2, 18, 8) == 4
    assert loaders == [2]  # the batches came through the worker processes
    (end, _, loaders), _ = run_distributed(_run, 2, ckpt, second)
    assert end == ITERS and loaders == [2]
    resumed = _records(first) + _records(second)
    uninterrupted = _records(full)
    keys = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in uninterrupted]
    sizes = [b - a for a, b in zip([0] + [r["consumed_samples"] for r in uninterrupted],
                                   [r["consumed_samples"] for r in uninterrupted])]
    assert sizes == [2, 2, 2, 4, 4, 6, 8, 8, 8, 8]
