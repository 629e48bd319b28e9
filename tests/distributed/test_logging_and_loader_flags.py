"""Flags that used to be parsed and ignored:

- ``--num-workers 0/2/4``: identical micro-batches (file and mock data), and a mid-epoch resume with workers is
  exact (losses equal an uninterrupted run with no workers);
- ``--timing-log-level 0|1|2``: Megatron's timer names, (min, max) over ranks; ``--log-throughput`` adds the
  throughput field as Megatron's log line does;
- ``--log-straggler``: a rank slowed on purpose is named with its ratio to the median;
- the test split (``--split``'s third share) is evaluated once at the end.
"""
import contextlib
import io
import json
import os
import time

import numpy as np
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.data import build_gpt_datasets
from megatronish.data.indexed_dataset import IndexedDatasetBuilder
from megatronish.data.loader import MicroBatchLoader
from megatronish.data.mock import MockGPTDataset
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import initialize
from megatronish.training.batches import batch_reader
from megatronish.training.pretrain import pretrain

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--log-interval", "2", "--seed", "5"]


def _dataset(prefix):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(3)
    for _ in range(300):
        b.add_item(rng.integers(1, 120, int(rng.integers(3, 50))))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _batches(read, workers, consumed=0, iterations=6):
    loader = MicroBatchLoader(read, consumed=consumed, micro_batch_size=2, dp_size=2, dp_rank=1, global_batch_size=12,
                              iterations=iterations, num_workers=workers)
    out = [b for _ in range(iterations) for b in loader.next_iteration()]
    loader.close()
    return out


def _equal(xs, ys):
    return len(xs) == len(ys) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                      for x, y in zip(xs, ys))


def test_num_workers_give_identical_batches_and_resume(tmp_path):
    prefix = _dataset(str(tmp_path / "d"))
    train, _, _ = build_gpt_datasets([prefix], "100,0,0", 16, 1, (200, None, None), eod_id=128,
                                     cache_dir=str(tmp_path / "c"))
    for ds in (train, MockGPTDataset(128, 16, seed=2)):
        read = batch_reader(ds)
        ref = _batches(read, 0)
        assert len(ref) == 18
        for workers in (2, 4):
            assert _equal(_batches(read, workers), ref), workers
        # mid-epoch resume: a new loader at iteration 4's consumed samples continues the same sequence
        assert _equal(_batches(read, 2, consumed=4 * 12, iterations=2), ref[12:])


def _run(argv, world, slow_rank=None):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    if slow_rank is not None and int(os.environ["RANK"]) == slow_rank:
        real = initialize.make_forward_step

        def slowed(*a, **k):
            step = real(*a, **k)

            def forward_step(data_iterator, model):
                time.sleep(0.1)  # large beside a loaded machine's noise in a 2-layer step
                return step(data_iterator, model)

            return forward_step

        initialize.make_forward_step = slowed
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain(cfg).state
    return [loss for _, loss in state.history], state.test_history, out.getvalue()


def _worker(rank, world, root, prefix):
    data = ["--data-path", prefix, "--split", "80,10,10", "--data-cache-path", os.path.join(root, "cache"),
            "--eval-iters", "1", "--eval-interval", "100"]
    res = {}
    res["w0"] = _run(data + ["--train-iters", "8", "--num-workers", "0"], world)
    res["w2"] = _run(data + ["--train-iters", "8", "--num-workers", "2", "--timing-log-level", "2",
                             "--log-throughput"], world)
    ck = os.path.join(root, "ck")
    res["first"] = _run(data + ["--train-iters", "8", "--num-workers", "4", "--save", ck, "--exit-interval", "3"],
                        world)
    res["resumed"] = _run(data + ["--train-iters", "8", "--num-workers", "4", "--load", ck], world)
    res["level1"] = _run(["--mock-data", "--train-iters", "2", "--eval-iters", "0", "--timing-log-level", "1",
                          "--use-distributed-optimizer"], world)
    res["level0"] = _run(["--mock-data", "--train-iters", "2", "--eval-iters", "0"], world)
    metrics = os.path.join(root, "straggler.jsonl")
    _run(["--mock-data", "--train-iters", "4", "--eval-iters", "0", "--log-straggler", "--metrics-file", metrics],
         world, slow_rank=1)
    if rank == 0:
        with open(metrics) as f:
            res["straggler"] = [json.loads(line)["straggler"] for line in f]
    return res


def test_workers_resume_timers_straggler_and_test_split(tmp_path):
    prefix = _dataset(str(tmp_path / "d"))
    res = run_distributed(_worker, 2, str(tmp_path), prefix)  # DP 2
    r0, r1 = res
    losses, test, out = r0["w0"]
    assert len(losses) == 8
    assert r0["w2"][0] == losses  # --num-workers 2: the same batches, so the same losses
    assert r0["first"][0] == losses[:3] and r0["resumed"][0] == losses[3:]  # exact resume with workers
    # the test split: evaluated once, at the end, named as Megatron does
    assert len(test) == 1 and test[0][0] == 8 and np.isfinite(test[0][1])
    assert "validation loss at iteration 8 on test set | lm loss value: " in out
    assert r0["first"][1] == []  # an --exit-interval exit skips the final evaluations
    # --log-throughput adds the field; without it the line has none
    assert "throughput per GPU (TFLOP/s/GPU)" in r0["w2"][2] and "throughput per GPU" not in out
    # timers: printed by the last rank, Megatron's names, by level
    timing2, timing1, timing0 = r1["w2"][2], r1["level1"][2], r1["level0"][2]
    assert "(min, max) time across ranks (ms):" not in r0["w2"][2]
    for name in ("forward-backward", "grads-all-reduce", "optimizer", "batch-generator"):
        assert f"    {name} ." in timing2, (name, timing2)
    for name in ("forward-backward", "grads-reduce-scatter", "params-all-gather", "optimizer"):
        assert f"    {name} ." in timing1, (name, timing1)
    assert "batch-generator" not in timing1 and "grads-all-reduce ." not in timing1
    assert "(min, max) time across ranks" not in timing0  # level 0: none, as Megatron
    # --log-straggler: rank 1 sleeps 100 ms per micro-batch (2 per iteration) and is named
    assert len(r0["straggler"]) == 2
    for rec in r0["straggler"]:
        assert rec["straggler_rank"] == 1 and rec["max_rank"] == 1 and rec["max_over_median"] > 1.2, rec
