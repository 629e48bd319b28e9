"""LR and weight-decay schedules against closed-form values (Megatron-LM's formulas), counted in samples."""
import argparse
import math

import pytest
import torch

from megatronish.optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_args
from megatronish.parallel.dims import ConfigError

MAX, MIN, INIT = 1e-3, 1e-5, 1e-6
W, D = 100, 1000  # warm-up and decay lengths in samples


def sched(style="linear", warmup=W, decay=D, init=INIT, **kw):
    base = dict(max_lr=MAX, min_lr=MIN, lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style,
                start_wd=0.1, end_wd=0.1, wd_incr_steps=decay, wd_incr_style="constant", init_lr=init)
    base.update(kw)
    return OptimizerParamScheduler(None, **base)


def ratio(n, warmup=W, decay=D):
    return (n - warmup) / (decay - warmup)


@pytest.mark.parametrize("n", [0, 1, 37, 50, 99, 100])
@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_is_linear_from_init(style, n):
    s = sched(style, wsd_decay_steps=200, lr_wsd_decay_style="linear")
    assert s.get_lr(n) == pytest.approx(INIT + (MAX - INIT) * n / W, rel=1e-12)


def test_no_warmup_starts_at_max():
    assert sched("linear", warmup=0).get_lr(0) == pytest.approx(MAX)


@pytest.mark.parametrize("n", [150, 400, 999, 1000, 1001, 5000])
def test_constant(n):
    assert sched("constant").get_lr(n) == MAX


@pytest.mark.parametrize("n", [101, 250, 550, 999, 1000])
def test_linear(n):
    assert sched("linear").get_lr(n) == pytest.approx(MIN + (MAX - MIN) * (1 - ratio(n)), rel=1e-12)


@pytest.mark.parametrize("n", [101, 250, 550, 777, 1000])
def test_cosine(n):
    expected = MIN + (MAX - MIN) * 0.5 * (1 + math.cos(math.pi * ratio(n)))
    assert sched("cosine").get_lr(n) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [101, 400, 1000])
def test_inverse_square_root(n):
    expected = max(MIN, MAX * math.sqrt(W) / math.sqrt(n))
    assert sched("inverse-square-root").get_lr(n) == pytest.approx(expected, rel=1e-12)


def test_inverse_square_root_floors_at_min_lr():
    s = sched("inverse-square-root", warmup=1, decay=10**9, init=0.0)
    assert s.get_lr(10**8) == MIN  # max*1/1e4 = 1e-7 < min


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD"])
def test_after_decay_is_min_lr(style):
    s = sched(style, wsd_decay_steps=200, lr_wsd_decay_style="cosine")
    assert s.get_lr(D + 1) == MIN and s.get_lr(10 * D) == MIN


WSD_COEFF = {
    "linear": lambda q: 1 - q,
    "cosine": lambda q: 0.5 * (math.cos(math.pi * q) + 1),
    "exponential": lambda q: 2 * 0.5 ** q - 1,
    "minus_sqrt": lambda q: 1 - math.sqrt(q),
}


@pytest.mark.parametrize("wsd_style", sorted(WSD_COEFF))
@pytest.mark.parametrize("n", [101, 500, 800, 801, 850, 900, 999, 1000])
def test_wsd(wsd_style, n):
    S = 200  # anneal over the last 200 samples of the decay: stable until 800
    s = sched("WSD", wsd_decay_steps=S, lr_wsd_decay_style=wsd_style)
    start = D - S
    expected = MAX if n <= start else MIN + (MAX - MIN) * WSD_COEFF[wsd_style]((n - start) / S)
    assert s.get_lr(n) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [0, 100, 333, 1000, 2000])
@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_increment(style, n):
    start, end, incr = (0.1, 0.1, 1000) if style == "constant" else (0.01, 0.1, 1000)
    s = sched("linear", start_wd=start, end_wd=end, wd_incr_steps=incr, wd_incr_style=style)
    if n > incr or style == "constant":
        expected = end
    elif style == "linear":
        expected = start + (end - start) * n / incr
    else:
        expected = start + (end - start) * 0.5 * (math.cos(math.pi * (1 - n / incr)) + 1)
    assert s.get_wd(n) == pytest.approx(expected, rel=1e-12)


def test_step_sets_param_groups_with_multipliers():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = torch.optim.AdamW([{"params": [a], "wd_mult": 1.0, "lr_mult": 1.0},
                             {"params": [b], "wd_mult": 0.0, "lr_mult": 1.0},
                             {"params": [c], "lr_mult": 0.5}], lr=123.0)
    s = OptimizerParamScheduler(opt, max_lr=MAX, min_lr=MIN, lr_warmup_steps=W, lr_decay_steps=D,
                                lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=D,
                                wd_incr_style="linear", init_lr=0.0)
    assert opt.param_groups[0]["lr"] == 0.0  # construction applies step 0
    gbs = 16
    for _ in range(20):
        s.step(increment=gbs)
    n = 20 * gbs
    assert s.num_steps == n
    lr = MIN + (MAX - MIN) * 0.5 * (1 + math.cos(math.pi * ratio(n)))
    wd = 0.1 * n / D
    assert opt.param_groups[0]["lr"] == pytest.approx(lr) and opt.param_groups[0]["weight_decay"] == pytest.approx(wd)
    assert opt.param_groups[1]["lr"] == pytest.approx(lr) and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[2]["lr"] == pytest.approx(0.5 * lr) and opt.param_groups[2]["weight_decay"] == \
        pytest.approx(wd)
    assert s.lr == pytest.approx(lr) and s.weight_decay == pytest.approx(wd)


def test_group_max_min_lr_override():
    s = sched("linear", warmup=0)
    assert s.get_lr(D, param_group={"min_lr": 0.0}) == 0.0
    assert s.get_lr(0, param_group={"max_lr": 2e-3}) == pytest.approx(2e-3)


def test_state_dict_round_trip():
    p = torch.nn.Parameter(torch.zeros(1))
    kw = dict(max_lr=MAX, min_lr=MIN, lr_warmup_steps=W, lr_decay_steps=D, lr_decay_style="cosine", start_wd=0.01,
              end_wd=0.1, wd_incr_steps=D, wd_incr_style="cosine", init_lr=INIT)
    s = OptimizerParamScheduler(torch.optim.SGD([p], lr=1.0), **kw)
    for _ in range(7):
        s.step(increment=48)
    sd = s.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s2 = OptimizerParamScheduler(opt2, **kw)
    s2.load_state_dict(sd)
    assert s2.num_steps == 7 * 48 and s2.state_dict() == sd
    assert opt2.param_groups[0]["lr"] == pytest.approx(s.get_lr())
    assert opt2.param_groups[0]["weight_decay"] == pytest.approx(s.get_wd())
    s.step(48), s2.step(48)
    assert s2.get_lr() == s.get_lr()


def test_state_dict_mismatch_rules():
    kw = dict(min_lr=MIN, lr_warmup_steps=W, lr_decay_steps=D, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
              wd_incr_steps=D, wd_incr_style="constant")
    saved = OptimizerParamScheduler(None, max_lr=MAX, **kw)
    saved.step(300)
    with pytest.raises(ConfigError, match="--override-opt_param-scheduler"):
        OptimizerParamScheduler(None, max_lr=2 * MAX, **kw).load_state_dict(saved.state_dict())
    keep = OptimizerParamScheduler(None, max_lr=2 * MAX, override_opt_param_scheduler=True, **kw)
    keep.load_state_dict(saved.state_dict())
    assert keep.max_lr == 2 * MAX and keep.num_steps == 300
    take = OptimizerParamScheduler(None, max_lr=2 * MAX, use_checkpoint_opt_param_scheduler=True, **kw)
    take.load_state_dict(saved.state_dict())
    assert take.max_lr == MAX and take.get_lr() == saved.get_lr()


@pytest.mark.parametrize("kw, flag", [
    (dict(lr_warmup_steps=D), "--lr-warmup"),
    (dict(min_lr=2 * MAX), "--min-lr"),
    (dict(init_lr=2 * MAX), "--lr-warmup-init"),
    (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
    (dict(lr_decay_style="bogus"), "--lr-decay-style"),
    (dict(start_wd=0.2, end_wd=0.1, wd_incr_style="linear"), "--end-weight-decay"),
])
def test_constructor_rejects(kw, flag):
    base = dict(max_lr=MAX, min_lr=MIN, lr_warmup_steps=W, lr_decay_steps=D, lr_decay_style="linear",
                start_wd=0.1, end_wd=0.1, wd_incr_steps=D, wd_incr_style="constant")
    base.update(kw)
    with pytest.raises(ConfigError, match=flag):
        OptimizerParamScheduler(None, **base)


def _ns(**kw):
    base = dict(train_iters=None, train_samples=None, global_batch_size=32, lr_decay_iters=None,
                lr_decay_samples=None, lr_warmup_fraction=None, lr_warmup_iters=0, lr_warmup_samples=0,
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_steps_from_iters():
    assert scheduler_steps_from_args(_ns(train_iters=100, lr_warmup_iters=10)) == (320, 3200, None, 3200)
    assert scheduler_steps_from_args(_ns(train_iters=100, lr_decay_iters=80, lr_warmup_fraction=0.1,
                                         lr_wsd_decay_iters=20)) == (pytest.approx(256.0), 2560, 640, 3200)


def test_steps_from_samples():
    assert scheduler_steps_from_args(_ns(train_samples=5000, lr_warmup_samples=100)) == (100, 5000, None, 5000)
    assert scheduler_steps_from_args(_ns(train_samples=5000, lr_decay_samples=4000, lr_warmup_fraction=0.25,
                                         lr_wsd_decay_samples=500)) == (pytest.approx(1000.0), 4000, 500, 5000)
