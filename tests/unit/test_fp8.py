"""FP8 emulation: the delayed-scaling recipe step by step (hand-computed), quantization error per format,
an FP8 linear against fp32 within a stated error bound, and the Transformer Engine selection error."""
import numpy as np
import pytest
import torch

from megatronish.config import gpt2
from megatronish.parallel.dims import ConfigError
from megatronish.parallel.layers import ColumnParallelLinear
from megatronish.precision import fp8 as fp8_mod
from megatronish.precision.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    Fp8LinearState,
    Fp8Manager,
    Fp8Recipe,
    ScalingState,
    check_transformer_impl,
    dequantize,
    fp8_autocast,
    fp8_matmul,
    quantize,
    relative_precision,
)

INF = float("inf")


def _run_recipe(recipe, amaxes):
    """Scale in force during each step, and the history after each step's record."""
    s = ScalingState(recipe, E4M3)
    used, hist = [], []
    for a in amaxes:
        used.append(float(s.scale))
        s.observe(torch.tensor(a))
        s.record(s.pending)
        hist.append(s.amax_history.tolist())
    return used, hist


def test_delayed_most_recent_history_1():
    used, hist = _run_recipe(Fp8Recipe(fp8_format="e4m3"), [2.0, 4.0, 1.0, 0.0, INF, 8.0, 1.0])
    # step 0 uses the initial scale 1; then 448/amax of the step before; 0 and inf keep the previous scale
    assert used == [1.0, 224.0, 112.0, 448.0, 448.0, 448.0, 56.0]
    assert hist == [[2.0], [4.0], [1.0], [0.0], [INF], [8.0], [1.0]]


def test_delayed_max_history_3_margin_1():
    r = Fp8Recipe(fp8_format="e4m3", fp8_amax_history_len=3, fp8_amax_compute_algo="max", fp8_margin=1)
    used, hist = _run_recipe(r, [2.0, 4.0, 1.0, 0.0, INF, 8.0, 1.0, 1.0, 1.0])
    assert hist[:4] == [[2, 0, 0], [4, 2, 0], [1, 4, 2], [0, 1, 4]]
    # scale = 448 / max(history) / 2**1; an inf inside the window keeps the previous scale until it leaves
    assert used == [1.0, 112.0, 56.0, 56.0, 56.0, 56.0, 56.0, 56.0, 28.0]


def test_delayed_most_recent_history_3_ignores_older():
    r = Fp8Recipe(fp8_format="e4m3", fp8_amax_history_len=3, fp8_amax_compute_algo="most_recent")
    used, _ = _run_recipe(r, [8.0, 1.0, 2.0, 4.0])
    assert used == [1.0, 56.0, 448.0, 224.0]


def test_pending_amax_is_max_over_microbatches_and_nan_keeps_scale():
    s = ScalingState(Fp8Recipe(), E4M3)
    for a in (1.0, 7.0, 3.0):
        s.observe(torch.tensor(a))
    s.record(s.pending)
    assert float(s.scale) == 64.0
    s.observe(torch.tensor(float("nan")))
    s.record(s.pending)
    assert float(s.scale) == 64.0


def test_linear_uses_scale_from_before_the_step_and_manager_updates():
    torch.manual_seed(0)
    recipe = Fp8Recipe(fp8_format="hybrid", fp8_amax_history_len=2, fp8_amax_compute_algo="max")
    lin = ColumnParallelLinear(8, 4, bias=False)
    torch.nn.init.normal_(lin.weight)
    lin.fp8 = Fp8LinearState(recipe, "lin")
    mgr = Fp8Manager(recipe, {"lin": lin})
    st = lin.fp8.states
    w_amax = float(lin.weight.detach().abs().max())
    expected_in = 1.0
    for step, amp in enumerate([1.0, 4.0, 2.0]):
        x = torch.randn(3, 2, 8)
        x = x / x.abs().max() * amp  # input amax = amp
        x.requires_grad_()
        assert float(st["input"].scale) == pytest.approx(expected_in)  # delayed: from earlier steps only
        lin(x)[0].sum().backward()  # grad_output = ones: amax 1
        assert float(st["input"].scale) == pytest.approx(expected_in)  # unchanged during the step
        mgr.update()
        hist = [amp] + ([1.0, 4.0, 2.0][step - 1:step] if step else [0.0])
        assert st["input"].amax_history.tolist() == pytest.approx(hist)
        expected_in = 448.0 / max(hist)
        assert float(st["input"].scale) == pytest.approx(expected_in)
        assert float(st["weight"].scale) == pytest.approx(448.0 / w_amax)
        assert float(st["grad_output"].scale) == pytest.approx(57344.0)  # e5m2 under hybrid, amax 1
    state = mgr.state_dict()
    assert state["lin.input.amax_history"].tolist() == pytest.approx([2.0, 4.0])
    other = ColumnParallelLinear(8, 4, bias=False)
    other.fp8 = Fp8LinearState(recipe, "lin")
    Fp8Manager(recipe, {"lin": other}).load_state_dict(state)
    assert float(other.fp8.states["input"].scale) == float(st["input"].scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_round_trip_within_relative_precision(dtype):
    g = torch.Generator().manual_seed(1)
    amax = 3.7
    # magnitudes spanning 2^-5..1 of amax: normal numbers of both formats after scaling by fp8_max/amax
    x = torch.sign(torch.randn(4096, generator=g)) * amax * 2.0 ** (-5 * torch.rand(4096, generator=g))
    x[0] = amax
    scale = torch.tensor(FP8_MAX[dtype] / amax)
    err = (dequantize(quantize(x, scale, dtype), scale) - x).abs()
    rel = relative_precision(dtype)  # e4m3 2^-3/2, e5m2 2^-2/2
    assert rel == {E4M3: 2 ** -4, E5M2: 2 ** -3}[dtype]
    assert torch.all(err <= rel * x.abs() * (1 + 1e-6))
    assert err.max() > 0.25 * rel * x.abs()[err.argmax()]  # it really rounds at that precision
    # saturation: beyond the range clamps to +-fp8_max instead of becoming inf/nan
    big = quantize(torch.tensor([1e9, -1e9]), torch.tensor(1.0), dtype).float()
    assert big.tolist() == [FP8_MAX[dtype], -FP8_MAX[dtype]]


def _decode_fp8(t: torch.Tensor) -> np.ndarray:
    """The float64 value of each fp8 element from its bits alone (sign, exponent, mantissa; subnormals; e4m3fn
    has no infinities, e5m2 is IEEE-like), independent of torch's conversions."""
    exp_bits, man_bits = {E4M3: (4, 3), E5M2: (5, 2)}[t.dtype]
    bias = 2 ** (exp_bits - 1) - 1
    u = t.view(torch.uint8).numpy().astype(np.int64)
    sign = np.where(u >> 7, -1.0, 1.0)
    e = (u >> man_bits) & (2 ** exp_bits - 1)
    m = u & (2 ** man_bits - 1)
    normal = (1 + m / 2 ** man_bits) * np.power(2.0, e - bias)
    sub = (m / 2 ** man_bits) * 2.0 ** (1 - bias)
    value = sign * np.where(e == 0, sub, normal)
    top = e == 2 ** exp_bits - 1
    if t.dtype == E4M3:  # e4m3fn: only S.1111.111 is special (NaN); the rest of the top exponent is finite
        value = np.where(top & (m == 2 ** man_bits - 1), np.nan, value)
    else:  # e5m2: the top exponent is inf (mantissa 0) or NaN
        value = np.where(top, np.where(m == 0, sign * np.inf, np.nan), value)
    return value


def _nearest_fp8(x: np.ndarray, dtype) -> np.ndarray:
    """Round-to-nearest-even onto the fp8 grid, saturating, by search over every finite code (independent of
    torch's cast)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    values = _decode_fp8(codes)
    ok = np.isfinite(values) & ~((codes.view(torch.uint8).numpy() & 0x80).astype(bool) & (values == 0))
    grid, bits = values[ok], codes.view(torch.uint8).numpy()[ok]
    order = np.argsort(grid)
    grid, bits = grid[order], bits[order]
    x = np.clip(x, grid[0], grid[-1])
    out = np.empty(x.shape)
    for i, v in np.ndenumerate(x):
        d = np.abs(grid - v)
        best = np.flatnonzero(d == d.min())
        pick = best[0] if len(best) == 1 else next(b for b in best if bits[b] % 2 == 0)  # tie: even mantissa
        out[i] = grid[pick]
    return out


@pytest.mark.parametrize("fallback", [True, False])
@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)])
def test_fp8_matmul_against_bit_level_reference(monkeypatch, fallback, fa, fb):
    """quantize rounds to the nearest fp8 value (checked against a search over the decoded fp8 grid), and
    fp8_matmul (its CPU fallback, and whatever path the device takes) equals the float64 product of the operands
    decoded from their bits, divided by their scales."""
    if fallback:
        monkeypatch.setattr(fp8_mod, "_scaled_mm_works", lambda device: False)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(12, 40, generator=g) * 3, torch.randn(9, 40, generator=g) * 0.2
    a[0, 0], b[0, 0] = 1e-4, 50.0  # a subnormal and a saturated element
    sa, sb = torch.tensor(11.0), torch.tensor(300.0)
    qa, qb = quantize(a, sa, fa), quantize(b, sb, fb)
    for q, x, s_, f in ((qa, a, sa, fa), (qb, b, sb, fb)):
        np.testing.assert_array_equal(_decode_fp8(q), _nearest_fp8(x.double().numpy() * float(s_), f))
    ref = (_decode_fp8(qa) / float(sa)) @ (_decode_fp8(qb) / float(sb)).T
    out = fp8_matmul(qa, sa, qb, sb)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def _elem_bound(t, scale, dtype):
    """Per-element bound on |dequant(quant(t)) - t|: half an ulp relative (normals) plus half the subnormal
    spacing (e4m3: 2^-9, e5m2: 2^-16) divided by the scale."""
    sub = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}[dtype]
    return relative_precision(dtype) * t.abs() + sub / scale


def _product_bound(a, ea, b, eb):
    """|(a+da)(b+db)^T - a b^T| <= ea |b|^T + |a| eb^T + ea eb^T, plus fp32 accumulation slack."""
    return ea @ b.abs().t() + a.abs() @ eb.t() + ea @ eb.t() + 1e-5 * (a.abs() @ b.abs().t())


@pytest.mark.parametrize("fmt,recipe", [("hybrid", "delayed"), ("e4m3", "delayed"), ("hybrid", "tensorwise")])
def test_fp8_linear_output_and_grads_within_fp8_error(fmt, recipe):
    """Bound: each operand is off by at most u|t| + subnormal/scale (u = 2^-4 e4m3, 2^-3 e5m2), so every
    output/grad element is off by at most the product bound of its operands (checked elementwise); the
    relative Frobenius error is then ~u (checked <= 2u for the grads through e5m2, <= 2u_e4m3 for output)."""
    r = Fp8Recipe(fp8_format=fmt, fp8_recipe=recipe)
    g = torch.Generator().manual_seed(3)
    lin = ColumnParallelLinear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=g))
    lin.fp8 = Fp8LinearState(r, "lin")
    mgr = Fp8Manager(r, {"lin": lin})
    x = torch.randn(5, 4, 64, generator=g) * 3
    gy = torch.randn(5, 4, 48, generator=g) * 1e-3
    for _ in range(2):  # step 0 calibrates the delayed scales (same data), step 1 is checked
        xx = x.clone().requires_grad_()
        lin.weight.grad = lin.bias.grad = None
        scales = {k: s.scale.clone() for k, s in lin.fp8.states.items()}
        y, _ = lin(xx)
        y.backward(gy)
        mgr.update()
    xr = x.clone().requires_grad_()
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    yr = torch.nn.functional.linear(xr, w, b)
    yr.backward(gy)
    if recipe == "tensorwise":
        scales = {k: s.scale for k, s in lin.fp8.states.items()}  # current scaling: set during the step
        scales["input"] = torch.tensor(448.0) / x.abs().max()
        scales["weight"] = torch.tensor(448.0) / w.abs().max()
    dt = {k: r.dtype(k) for k in scales}
    x2, g2 = x.reshape(-1, 64), gy.reshape(-1, 48)
    wd = w.detach()
    ex = _elem_bound(x2, scales["input"], dt["input"])
    ew = _elem_bound(wd, scales["weight"], dt["weight"])
    eg = _elem_bound(g2, scales["grad_output"], dt["grad_output"])
    checks = {
        "output": (y.detach().reshape(-1, 48), yr.detach().reshape(-1, 48), _product_bound(x2, ex, wd, ew)),
        "dgrad": (xx.grad.reshape(-1, 64), xr.grad.reshape(-1, 64), _product_bound(g2, eg, wd.t(), ew.t())),
        "wgrad": (lin.weight.grad, w.grad, _product_bound(g2.t(), eg.t(), x2.t(), ex.t())),
    }
    u_fwd, u_bwd = relative_precision(dt["input"]), relative_precision(dt["grad_output"])
    for what, (got, ref, bound) in checks.items():
        err = (got - ref).abs()
        assert torch.all(err <= bound), f"{what}: {(err - bound).max()} over the bound"
        rel = (got - ref).norm() / ref.norm()
        limit = 2 * u_fwd if what == "output" else u_fwd + u_bwd
        assert 0 < rel <= limit, f"{what}: relative error {rel} vs {limit}"
    torch.testing.assert_close(lin.bias.grad, b.grad)  # bias grad from the fp32 grad_output
    with fp8_autocast(enabled=False):  # off: exactly the fp32 layer
        torch.testing.assert_close(lin(x)[0], yr.detach(), rtol=0, atol=0)


def test_recipe_validation_names_flags():
    with pytest.raises(ConfigError, match="--fp8-format"):
        Fp8Recipe(fp8_format="e5m2")
    with pytest.raises(ConfigError, match="--fp8-amax-compute-algo"):
        Fp8Recipe(fp8_amax_compute_algo="mean")
    off = gpt2(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10)
    assert Fp8Recipe.from_config(off.precision) is None
    cfg = gpt2(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10, fp8="hybrid", fp8_margin=2)
    assert Fp8Recipe.from_config(cfg.precision) == Fp8Recipe(fp8_format="hybrid", fp8_margin=2)


def test_transformer_engine_impl_is_one_clear_error():
    assert check_transformer_impl("local") == "local"
    with pytest.raises(ConfigError) as e:
        check_transformer_impl("transformer_engine")
    msg = str(e.value)
    assert "--transformer-impl transformer_engine needs Transformer Engine with CUDA" in msg
    assert "--transformer-impl local" in msg
    with pytest.raises(ConfigError, match="--transformer-impl"):
        check_transformer_impl("te")


def test_selective_recompute_config():
    kw = dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10)
    assert gpt2(recompute_granularity="selective", **kw).recompute.recompute_granularity == "selective"
    with pytest.raises(ConfigError, match="--recompute-method"):
        gpt2(recompute_granularity="selective", recompute_method="uniform", **kw)
    with pytest.raises(ConfigError, match="--recompute-granularity"):
        gpt2(recompute_granularity="partial", **kw)
