"""``--rampup-batch-size``: the batch size of every iteration equals Megatron's calculator formula and
megatron-core's own ``RampupBatchsizeNumMicroBatchesCalculator`` (installed with the dev extra); the training
length from ``--train-samples`` is Megatron's ``update_train_iters``; the LR schedule advances by each ramped
batch; bad ramps are one line each; the ``--num-workers`` loader reads each ramped batch."""
import math

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args, validate_args
from megatronish.config import rampup_global_batch_size, rampup_steps, rampup_train_iters
from megatronish.errors import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3"]

# (start, increment, ramp-up samples, global batch size, micro batch x DP)
RAMPS = [(16, 16, 5859375, 1536, 1), (2, 2, 18, 8, 2), (4, 4, 100, 32, 4), (3, 3, 1000, 30, 3), (8, 8, 7, 64, 8)]


def _formula(consumed, start, inc, samples, gbs):
    """Megatron's documented rule, written independently: (gbs - start) / inc increments spread evenly over the
    ramp-up samples, the batch size jumping by inc after each ``samples / increments`` samples."""
    if consumed > samples:
        return gbs
    return start + math.floor(consumed / (samples / ((gbs - start) / inc))) * inc


@pytest.mark.parametrize("start, inc, samples, gbs, per_step", RAMPS)
def test_batch_sizes_match_the_formula_and_megatron_core(start, inc, samples, gbs, per_step):
    from support.megatron_core_support import import_or_skip  # under CI a failure, not a skip
    calc_mod = import_or_skip("megatron.core.num_microbatches_calculator")
    calc = calc_mod.RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=gbs, micro_batch_size=per_step, data_parallel_size=1, decrease_batch_size_if_needed=False,
        rank=1, start_global_batch_size=start, batch_size_increment=inc, ramup_samples=samples)
    consumed, seen = 0, set()
    for _ in range(40_000):  # the whole ramp of every case, then some constant iterations
        ours = rampup_global_batch_size(consumed, start, inc, samples, gbs)
        calc.update(consumed, consistency_check=True)
        assert ours == calc.get_current_global_batch_size() == _formula(consumed, start, inc, samples, gbs), \
            consumed
        assert ours // per_step == calc.get() and ours % per_step == 0
        seen.add(ours)
        consumed += ours
        if consumed > samples + 3 * gbs:
            break
    assert max(seen) == gbs and min(seen) == start


def test_train_iters_from_train_samples_is_megatrons():
    """Megatron's update_train_iters: ramp iterations while consumed <= ramp-up samples (and <= train samples),
    then whole global batches of the rest."""
    for start, inc, samples, gbs, _ in RAMPS:
        for train_samples in (samples // 2, samples, samples + 5 * gbs + 3):
            iters, consumed = 0, 0
            while consumed <= samples and consumed <= train_samples:
                consumed += _formula(consumed, start, inc, samples, gbs)
                iters += 1
            if train_samples > consumed:
                iters += (train_samples - consumed) // gbs
            assert rampup_train_iters(train_samples, [start, inc, samples], gbs) == iters
    cfg = configs_from_args(parse_args(BASE + ["--micro-batch-size", "2", "--global-batch-size", "8",
                                               "--rampup-batch-size", "2", "2", "18", "--train-samples", "100"]), 1)
    assert cfg.train.train_iters == rampup_train_iters(100, [2, 2, 18], 8) == 6 + (100 - 20) // 8
    assert [cfg.global_batch_size_at(c) for c, _ in rampup_steps([2, 2, 18], 8)] == [2, 2, 2, 4, 4, 6]
    assert [cfg.num_microbatches_at(c) for c in (0, 6, 14, 20, 10_000)] == [1, 2, 3, 4, 4]


def test_lr_schedule_advances_by_each_ramped_batch():
    """The scheduler counts samples: after the ramp's iterations it stands at the samples consumed."""
    from megatronish.optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config

    cfg = configs_from_args(parse_args(BASE + ["--micro-batch-size", "2", "--global-batch-size", "8",
                                               "--rampup-batch-size", "2", "2", "18", "--train-samples", "100",
                                               "--lr-decay-style", "linear", "--min-lr", "1e-4"]), 1)
    sched = OptimizerParamScheduler(None, **scheduler_steps_from_config(cfg))
    consumed = 0
    for _ in range(cfg.train.train_iters):
        b = cfg.global_batch_size_at(consumed)
        sched.step(increment=b)
        consumed += b
        assert sched.num_steps == consumed
        assert sched.lr == pytest.approx(1e-4 + (1e-3 - 1e-4) * (1 - min(consumed, 100) / 100))


@pytest.mark.parametrize("ramp, extra, expected", [
    (["0", "2", "18"], [], "must be >= 1"),
    (["2", "2", "0"], [], "must be >= 1"),
    (["8", "2", "18"], [], "minus the start batch size must be a positive multiple"),
    (["2", "4", "18"], [], "minus the start batch size must be a positive multiple"),
    (["2", "2", "18"], ["--micro-batch-size", "4"], "not divisible by --micro-batch-size x data-parallel size = 4"),
])
def test_bad_ramps_are_one_line(ramp, extra, expected):
    argv = BASE + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "100",
                   "--rampup-batch-size", *ramp] + extra
    with pytest.raises(ConfigError) as e:
        validate_args(parse_args(argv), 1)
    lines = [line for line in str(e.value).splitlines() if "--rampup-batch-size" in line]
    assert len(lines) == 1 and expected in lines[0], str(e.value)


def test_interleaving_checks_every_ramp_size():
    argv = BASE + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5",
                   "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    validate_args(parse_args(argv + ["--rampup-batch-size", "2", "2", "18"]), 2)
    with pytest.raises(ConfigError,
                       match=r"multiple of --pipeline-model-parallel-size 2, but it is 1 \(--global-batch-size 1 "):
        validate_args(parse_args(argv + ["--rampup-batch-size", "1", "1", "18"]), 2)


def test_three_numbers():
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--micro-batch-size", "1", "--rampup-batch-size", "2", "2"])


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_reads_each_ramped_batch_and_resumes(workers):
    """``--num-workers`` under a ramp: the loader's micro-batches of every iteration are those the training process
    reads itself (``global_batch_indices`` at each iteration's consumed samples and ramped size), from the start and
    from a resume in the middle of the ramp."""
    from megatronish.data.loader import MicroBatchLoader
    from megatronish.data.sampler import global_batch_indices

    cfg = configs_from_args(parse_args(BASE + ["--micro-batch-size", "1", "--global-batch-size", "8",
                                               "--rampup-batch-size", "2", "2", "18", "--train-iters", "9"]), 2)
    read = lambda idx: {"idx": torch.tensor(idx)}  # noqa: E731 (the sample ids themselves)

    def expected(consumed, iterations):
        out = []
        for _ in range(iterations):
            out.append(list(global_batch_indices(consumed, 1, 2, 1, cfg.num_microbatches_at(consumed))))
            consumed += cfg.global_batch_size_at(consumed)
        return out

    def loaded(consumed, iterations):
        loader = MicroBatchLoader(read, consumed=consumed, micro_batch_size=1, dp_size=2, dp_rank=1,
                                  global_batch_size=cfg.global_batch_size_at, iterations=iterations,
                                  num_workers=workers)
        out = [[b["idx"].tolist() for b in loader.next_iteration()] for _ in range(iterations)]
        loader.close()
        return out

    ref = expected(0, 9)
    assert [len(r) for r in ref] == [1, 1, 1, 2, 2, 3, 4, 4, 4]  # the ramp 2, 2, 2, 4, 4, 6, 8 over DP 2
    assert loaded(0, 9) == ref
    assert loaded(10, 5) == ref[4:]  # resumed after 4 iterations (2 + 2 + 2 + 4 samples)
