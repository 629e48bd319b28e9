"""Timers by level (Megatron's names), the (min, max) block, and the straggler line."""
import pytest
import torch

from megatronish.training.timers import TIMER_LEVELS, Timers, straggler_lines


def test_levels_and_min_max_block():
    for level in (0, 1, 2):
        t = Timers(level)
        assert t.names() == [n for n, lv in TIMER_LEVELS.items() if lv <= level]
        for name in TIMER_LEVELS:
            with t(name):
                pass
        ran = set(t._timers)
        assert ran == {n for n, lv in TIMER_LEVELS.items() if lv <= level}
    t = Timers(0, always=("forward-backward",))
    assert t.names() == ["forward-backward"]
    times = torch.tensor([[0.004], [0.002]], dtype=torch.float64)  # [rank, timer] seconds
    # forward-backward is gathered for the straggler report but not printed at level 0 (Megatron prints none)
    assert t.min_max_string(times, t.names(), normalizer=2) is None
    t = Timers(1)
    times = torch.tensor([[0.010, 0.0, 0.0, 0.0, 0.004], [0.020, 0.0, 0.0, 0.0, 0.006]], dtype=torch.float64)
    assert t.names() == ["forward-backward", "grads-all-reduce", "grads-reduce-scatter", "params-all-gather",
                         "optimizer"]
    assert t.min_max_string(times, t.names(), normalizer=2) == (
        "(min, max) time across ranks (ms):\n    forward-backward " + "." * 31 + ": (5.00, 10.00)\n"
        "    optimizer " + "." * 38 + ": (2.00, 3.00)")  # timers no rank ran are left out


def test_straggler_named_above_the_ratio():
    line, rec = straggler_lines([0.010, 0.011, 0.030, 0.0105], count=2)
    assert rec == {"min_rank": 0, "max_rank": 2, "max_over_median": pytest.approx(0.030 / 0.01075),
                   "straggler_rank": 2}
    assert line.startswith("straggler: compute time per iteration (ms/rank) min 10.00ms/0, 10.50ms/3 | max "
                           "30.00ms/2, 11.00ms/1 | median 10.75ms")
    assert line.endswith("rank 2 is a straggler: 2.79x the median")
    line, rec = straggler_lines([0.010, 0.0105])
    assert "straggler_rank" not in rec and "is a straggler" not in line
