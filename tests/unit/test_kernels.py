"""The fused Triton kernels, run through Triton's interpreter on CPU, against PyTorch references.

fp32: equal to the PyTorch op (autograd for the gradients) within 1e-5 relative (to the largest element).
bf16: equal to the exact result (fp32 math on the same bf16 inputs) rounded to bf16, within one bf16 step.
Every buffer a kernel allocates is filled with NaN first, so an element a kernel leaves unwritten fails.
Shapes are tiny and include non-power-of-two hidden sizes and vocabulary slices (the interpreter is slow).
"""

import pytest
import torch
import torch.nn.functional as F

from megatronish.model.rope import RotaryEmbedding, apply_rotary  # loads no kernel module, so no triton
from megatronish.parallel.cross_entropy import vocab_parallel_cross_entropy
from support.kernel_support import import_interpreted, not_interpreted_mark

kernels, _triton, _mods = import_interpreted("fused_cross_entropy")
fused_ce = _mods[0].vocab_parallel_cross_entropy

pytestmark = not_interpreted_mark(_triton)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _poison_and_interpret(monkeypatch):
    monkeypatch.setattr(_triton, "POISON_OUTPUTS", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _check(actual, exact, dtype, what):
    """fp32: within 1e-5 of the exact value relative to its largest element; bf16: the exact value rounded to
    bf16, give or take one bf16 step (2**-8 relative)."""
    assert actual.dtype == dtype, what
    assert not torch.isnan(actual).any(), f"{what}: NaN left in the output"
    exact = exact.detach().float()
    scale = exact.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, exact, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual.float(), exact.to(dtype).float(), rtol=2 ** -8, atol=1e-6 * scale,
                                   msg=lambda m: f"{what}: {m}")


def _leaf(t, dtype):
    return t.to(dtype).requires_grad_()


def _exact(t):
    """An fp32 copy of a (possibly bf16) leaf: the reference runs on exactly the kernel's inputs."""
    return t.detach().float().requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms(kind, dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 2, 48), (7, 100), (2, 2, 64), (1, 1, 5)]:
        h = shape[-1]
        x = _leaf(torch.randn(shape, generator=g) * 2 + 0.5, dtype)
        w = _leaf(torch.randn(h, generator=g), dtype)
        b = _leaf(torch.randn(h, generator=g), dtype)
        dy = torch.randn(shape, generator=g).to(dtype)
        xr, wr, br = _exact(x), _exact(w), _exact(b)
        if kind == "RMSNorm":
            y = kernels.rms_norm(x, w, 1e-5)
            yr = F.rms_norm(xr, (h,), wr, 1e-5)
        else:
            y = kernels.layer_norm(x, w, b, 1e-5)
            yr = F.layer_norm(xr, (h,), wr, br, 1e-5)
        y.backward(dy)
        yr.backward(dy.float())
        what = f"{kind} {dtype} {shape}"
        _check(y, yr, dtype, f"{what} out")
        _check(x.grad, xr.grad, dtype, f"{what} grad x")
        _check(w.grad, wr.grad, dtype, f"{what} grad weight")
        if kind == "LayerNorm":
            _check(b.grad, br.grad, dtype, f"{what} grad bias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_qkv_views(dtype):
    """q and k as the attention module makes them (views of the fused QKV output, grouped-query layout),
    rotated in place; the gradient reaching the QKV output equals the unfused path's."""
    g = torch.Generator().manual_seed(1)
    for s, b, groups, per_group, d, percent in [(5, 2, 2, 2, 16, 1.0), (3, 1, 3, 1, 24, 0.5), (4, 2, 1, 3, 12, 1.0)]:
        cos, sin = RotaryEmbedding(d, percent)(s)
        base = _leaf(torch.randn(s, b, groups, per_group + 2, d, generator=g), dtype)
        base_r = _exact(base)
        dq = torch.randn(s, b, groups * per_group, d, generator=g).to(dtype)
        dk = torch.randn(s, b, groups, d, generator=g).to(dtype)
        outs = []
        for t, fused in ((base, True), (base_r, False)):
            qkv = t * 1  # a non-leaf, as the projection's output
            q = qkv[:, :, :, :per_group].reshape(s, b, -1, d)
            k = qkv[:, :, :, per_group]
            v = qkv[:, :, :, per_group + 1]
            if fused:
                q2, k2 = kernels.apply_rotary_(q, cos, sin), kernels.apply_rotary_(k, cos, sin)
                assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()  # in place
            else:
                q2, k2 = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            ((q2 * dq.to(q2.dtype)).sum() + (k2 * dk.to(k2.dtype)).sum() + (v * v).sum()).backward()
            outs.append((q2.detach(), k2.detach()))
        what = f"RoPE {dtype} s={s} b={b} groups={groups}x{per_group} d={d} percent={percent}"
        _check(outs[0][0], outs[1][0], dtype, f"{what} q")
        _check(outs[0][1], outs[1][1], dtype, f"{what} k")
        _check(base.grad, base_r.grad, dtype, f"{what} grad qkv")


def test_rope_through_apply_rotary_dispatch():
    """The model's hook: tables from a RotaryEmbedding with use_triton_kernels carry ``True``, and
    ``apply_rotary(x, *tables)`` then runs the kernel (in place)."""
    emb = RotaryEmbedding(8)
    emb.use_triton_kernels = True
    tables = emb(3)
    assert len(tables) == 3 and tables[2] is True
    x = torch.randn(3, 2, 2, 8)
    ref = apply_rotary(x.clone(), *tables[:2])
    out = apply_rotary(x, *tables)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    g = torch.Generator().manual_seed(2)
    for shape in [(3, 2, 2 * 24), (5, 2 * 100), (1, 1, 2 * 7)]:
        h = _leaf(torch.randn(shape, generator=g) * 3, dtype)
        hr = _exact(h)
        out = kernels.swiglu(h)
        gate, up = hr.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        dout = torch.randn(ref.shape, generator=g).to(dtype)
        out.backward(dout)
        ref.backward(dout.float())
        _check(out, ref, dtype, f"SwiGLU {dtype} {shape} out")
        _check(h.grad, hr.grad, dtype, f"SwiGLU {dtype} {shape} grad")


# (rows s x b, local vocabulary, true vocabulary, label smoothing, chunk): chunks smaller than the slice, the
# padded tail of the vocabulary masked (its logits are NaN here, so touching them would show)
CE_CASES = [((3, 2), 100, 100, 0.0, 32), ((2, 3), 77, 70, 0.1, 16), ((4, 1), 128, 128, 0.0, None),
            ((3, 2), 100, 90, 0.2, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_single_rank(dtype):
    g = torch.Generator().manual_seed(3)
    for (s, b), part, vocab, smoothing, block in CE_CASES:
        logits = (torch.randn(s, b, part, generator=g) * 3).to(dtype)
        logits[..., vocab:] = float("nan")
        target = torch.randint(0, vocab, (s, b), generator=g)
        dloss = torch.rand(s, b, generator=g)
        x = logits.clone().requires_grad_()
        xr = _exact(logits)
        loss = fused_ce(x * 1, target, smoothing, vocab, block_v=block)
        ref = vocab_parallel_cross_entropy(xr, target, smoothing, vocab)
        loss.backward(dloss)
        ref.backward(dloss)
        what = f"CE {dtype} rows={s}x{b} V={part} (true {vocab}) smoothing={smoothing} block={block}"
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0, msg=lambda m: f"{what} loss: {m}")
        _check(x.grad, xr.grad, dtype, f"{what} grad")
        assert torch.all(x.grad[..., vocab:] == 0), f"{what}: padded entries got gradient"


def test_cross_entropy_matches_torch_and_overwrites_logits():
    """Against torch's own cross entropy (label smoothing included: Megatron's target distribution, which is
    torch's with alpha' = alpha * V / (V - 1)), and: backward writes the gradient over the logits, whose
    version is bumped, so a second backward through the graph fails instead of reading gradients."""
    g = torch.Generator().manual_seed(4)
    n, vocab, alpha = 6, 37, 0.1
    logits = torch.randn(n, 1, vocab, generator=g, requires_grad=True)
    target = torch.randint(0, vocab, (n, 1), generator=g)
    inner = logits * 2
    loss = fused_ce(inner, target, alpha, vocab, block_v=16)
    ref = F.cross_entropy((logits.detach() * 2).view(n, vocab), target.view(n), reduction="none",
                          label_smoothing=alpha * vocab / (vocab - 1))
    torch.testing.assert_close(loss.view(n), ref, rtol=1e-5, atol=0)
    loss.sum().backward(retain_graph=True)
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


def test_kernels_need_cuda_or_the_interpreter(monkeypatch):
    """Interpreted kernels run on CPU tensors; the environment switch alone is not enough once the kernels were
    defined compiled, and that is said clearly."""
    monkeypatch.setattr(_triton, "INTERPRETED", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA tensors .* or TRITON_INTERPRET=1"):
        kernels.swiglu(torch.randn(2, 4))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="set it before the first fused op"):
        kernels.swiglu(torch.randn(2, 4))
