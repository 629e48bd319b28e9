"""FP16 loss scaling: Megatron's DynamicGradScaler rule step by step, and the optimizer's use of it (an injected
inf skips the step and leaves parameters and states untouched; gradients are unscaled into fp32 main grads)."""
import pytest
import torch
from torch import nn

from megatronish.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from megatronish.optim.optimizer import MegatronOptimizer
from megatronish.parallel.ddp import DistributedDataParallel


def _rule(events, scale, min_scale, window, hysteresis):
    """The rule written out independently: returns (scale, growth, hysteresis) after each event."""
    growth, hyst, out = 0, hysteresis, []
    for inf in events:
        if inf:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale / 2, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2
        out.append((scale, growth, hyst))
    return out


def test_dynamic_scaler_follows_the_rule():
    s = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=2.0 ** 7, growth_interval=3, hysteresis=2)
    # one overflow: no backoff (hysteresis 2); second: backoff; a clean step does NOT restore the hysteresis,
    # so the next overflow backs off at once; three clean steps grow and restore it; overflows down to the floor
    events = [1, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    got = []
    for e in events:
        s.update(bool(e))
        got.append((s.scale, s.growth_tracker, s.hysteresis_tracker))
    assert got == _rule(events, 2.0 ** 10, 2.0 ** 7, 3, 2)
    # spot checks of the hand-computed values
    assert got[0] == (2.0 ** 10, 0, 1)  # first overflow: hysteresis absorbs it
    assert got[1] == (2.0 ** 9, 0, 0)  # second: backoff
    assert got[3] == (2.0 ** 8, 0, -1)  # overflow after a clean step: backoff again
    assert got[6] == (2.0 ** 9, 0, 2)  # 3 clean steps: growth, hysteresis restored
    assert min(g[0] for g in got) == 2.0 ** 7  # floored at --min-loss-scale


def test_scaler_state_round_trip_and_builders():
    s = DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=1)
    s.update(True)
    t = DynamicGradScaler(initial_scale=1024.0, growth_interval=2, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (4.0, 0, 0)
    assert build_grad_scaler(False) is None  # bf16 / fp32: no scaler
    assert isinstance(build_grad_scaler(True, loss_scale=128.0), ConstantGradScaler)
    d = build_grad_scaler(True)
    assert (d.scale, d.min_scale, d.growth_interval, d.hysteresis) == (2.0 ** 32, 1.0, 1000, 2)
    with pytest.raises(ValueError):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)


def _fp16_optimizer(scaler, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    ddp = DistributedDataParallel(model, grad_dtype=torch.float32)
    opt = MegatronOptimizer([ddp], optimizer="sgd", lr=0.5, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0,
                            grad_scaler=scaler, **kw)
    return model, ddp, opt


def test_injected_inf_skips_step_and_backs_off():
    scaler = DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0, growth_interval=2, hysteresis=2)
    model, ddp, opt = _fp16_optimizer(scaler)
    before = [p.detach().clone() for p in model.parameters()]
    mains = [s.main.detach().clone() for s in opt.slots]
    assert all(s.main.dtype == torch.float32 for s in opt.slots)
    for n_overflow in (1, 2):
        ddp.zero_grad_buffer()
        for p in model.parameters():
            p.main_grad.fill_(1.0)
        model[0].weight.main_grad[1, 2] = float("inf")
        ok, norm = opt.step()
        assert not ok and norm is None
        assert all(torch.equal(a, s.main.detach()) for a, s in zip(mains, opt.slots))
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        assert scaler.scale == (2.0 ** 8 if n_overflow == 1 else 2.0 ** 7)
    assert opt.scalar_state_dict()["grad_scaler"] == {"scale": 2.0 ** 7, "growth_tracker": 0,
                                                     "hysteresis_tracker": 0}
    # clean steps: the gradient is unscaled (grad = scale * g  ->  update -lr * g), and after the window the
    # scale grows
    g = {id(p): torch.randn(p.shape) for p in model.parameters()}
    for _ in range(2):
        ddp.zero_grad_buffer()
        start = [s.main.detach().clone() for s in opt.slots]
        scale = scaler.scale
        for p in model.parameters():
            p.main_grad.copy_(g[id(p)] * scale)
        ok, norm = opt.step()
        assert ok
        for s, a in zip(opt.slots, start):
            torch.testing.assert_close(s.main.detach(), a - 0.5 * g[id(s.model)], rtol=0, atol=1e-6)
            assert torch.equal(s.model.detach(), s.main.detach().half())  # copied back, rounded
        expected_norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g.values())).item()
        assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert scaler.scale == 2.0 ** 8 and scaler.hysteresis_tracker == 2


def test_scaled_loss_backward_gives_unscaled_update():
    """The loss is multiplied by the scale before backward; the step divides it out again."""
    scaler = ConstantGradScaler(2.0 ** 6)
    model, ddp, opt = _fp16_optimizer(scaler)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters()):
            r.copy_(p.double())
    x = torch.randn(5, 4)
    opt.scale_loss(model(x.half()).float().pow(2).mean()).backward()
    ok, _ = opt.step()
    assert ok
    ref(x.double()).pow(2).mean().backward()
    for s, r in zip(opt.slots, ref.parameters()):
        # fp16 forward/backward against a float64 reference: within fp16 rounding of the gradient
        torch.testing.assert_close(s.main.detach().double(), r.detach() - 0.5 * r.grad, rtol=0, atol=2e-3)
