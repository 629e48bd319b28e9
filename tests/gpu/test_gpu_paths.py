"""The CUDA-only paths against their reference, on a GPU (marker ``gpu``; skipped with the reason elsewhere).

- the Triton kernels *compiled* (not interpreted) against the PyTorch ops, forward and backward;
- SDPA's flash and cuDNN/efficient kernels (``--attention-backend flash|fused``) against SDPA's math path;
- ``torch._grouped_mm`` in bf16 (``--moe-grouped-gemm``) against the per-expert loop;
- the emulated FP8's GEMM (``torch._scaled_mm`` where the shape allows) against the dequantized product;
- context-parallel attention's block kernels (efficient attention with the merged log-sum-exp) against full
  attention, with and without document masks;
- the page-locked async-save staging buffers and the side-stream deferred copies.

``scripts/device_check.sh`` runs them (``pytest -m gpu tests/gpu``) with ``MEGATRONISH_DEVICE=cuda``.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatronish import device

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _close(a, b, tol, what):
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item() + 1e-6
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} x max |ref| {scale:.3g}"


# ---- Triton kernels, compiled --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_kernels():
    pytest.importorskip("triton", reason="triton is not installed (the kernels extra)")
    from megatronish import kernels
    from megatronish.kernels import _triton

    if _triton.INTERPRETED:
        pytest.skip("megatronish.kernels was loaded interpreted (TRITON_INTERPRET=1 in this process)")
    assert kernels.kernels_backend("cuda") == "compiled"
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norms_compiled_match_torch(compiled_kernels, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1000, device=CUDA, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(1000, device=CUDA, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(1000, device=CUDA, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(300, 1000, device=CUDA, generator=g).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, fused, ref, leaves in (
            ("rms_norm", lambda: compiled_kernels.rms_norm(x, w, 1e-5),
             lambda: F.rms_norm(x.float(), (1000,), w.float(), 1e-5), (x, w)),
            ("layer_norm", lambda: compiled_kernels.layer_norm(x, w, b, 1e-5),
             lambda: F.layer_norm(x.float(), (1000,), w.float(), b.float(), 1e-5), (x, w, b))):
        y = fused()
        assert y.dtype == dtype
        got = torch.autograd.grad(y, leaves, dy)
        y_ref = ref()
        want = torch.autograd.grad(y_ref, leaves, dy.float())
        _close(y, y_ref, tol, f"{name} forward {dtype}")
        for i, (a, r) in enumerate(zip(got, want)):
            _close(a, r, tol, f"{name} grad {i} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rope_swiglu_compiled_match_torch(compiled_kernels, dtype):
    from megatronish.model.rope import RotaryEmbedding, apply_rotary

    g = torch.Generator(device="cuda").manual_seed(1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    s, b, heads, d = 64, 2, 8, 128
    cos, sin = RotaryEmbedding(d, 1.0)(s, device=CUDA)
    x = torch.randn(s, b, heads, d, device=CUDA, generator=g).to(dtype)
    ref = apply_rotary(x.float(), cos, sin)
    got = compiled_kernels.apply_rotary_(x.clone(), cos, sin)
    _close(got, ref, tol, f"rope {dtype}")

    h = (2 * torch.randn(256, 2 * 704, device=CUDA, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(256, 704, device=CUDA, generator=g).to(dtype)
    y = compiled_kernels.swiglu(h)
    (dh,) = torch.autograd.grad(y, h, dy)
    gate, up = h.float().chunk(2, dim=-1)
    y_ref = F.silu(gate) * up
    (dh_ref,) = torch.autograd.grad(y_ref, h, dy.float())
    _close(y, y_ref, tol, f"swiglu forward {dtype}")
    _close(dh, dh_ref, tol, f"swiglu backward {dtype}")


def test_triton_cross_entropy_compiled_matches_torch(compiled_kernels):
    from megatronish.parallel.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (2 * torch.randn(128, 2, 5000, device=CUDA, generator=g)).requires_grad_()
    target = torch.randint(0, 5000, (128, 2), device=CUDA, generator=g)
    dl = torch.rand(128, 2, device=CUDA, generator=g)
    loss = compiled_kernels.vocab_parallel_cross_entropy(logits.clone(), target, 0.0, 5000)
    (grad,) = torch.autograd.grad(loss, logits, dl)
    ref = vocab_parallel_cross_entropy(logits.clone(), target, 0.0, 5000)
    (grad_ref,) = torch.autograd.grad(ref, logits, dl)
    _close(loss, ref, 1e-5, "cross entropy loss")
    _close(grad, grad_ref, 1e-5, "cross entropy grad")


# ---- attention backends --------------------------------------------------------------------------------------
def _qkv(b, heads, groups, s, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, heads, s, d, device=CUDA, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, groups, s, d, device=CUDA, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, groups, s, d, device=CUDA, generator=g).to(dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_sdpa_kernels_match_math(kernel):
    """Each CUDA kernel alone (no fallback), causal, bf16, forward and backward, against the math path in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(2, 8, 8, 256, 128, torch.bfloat16, 3)
    dout = torch.randn_like(q)
    try:
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    except RuntimeError as e:
        if kernel == "CUDNN_ATTENTION":  # cuDNN attention needs cuDNN >= 9 and an sm80+ GPU
            pytest.skip(f"SDPA's cuDNN kernel does not run here: {str(e).splitlines()[0]}")
        raise
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    want = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    _close(out, ref, 2e-2, f"{kernel} forward")
    for name, a, r in zip("qkv", grads, want):
        _close(a, r, 3e-2, f"{kernel} d{name}")


@pytest.mark.parametrize("backend", ["flash", "fused", "auto"])
def test_attention_backend_flag_matches_unfused(backend):
    """The model's ``--attention-backend`` choices on CUDA (GQA, bf16) give the unfused (math) layer's output."""
    from megatronish.config import llama
    from megatronish.model.attention import SelfAttention

    cfg = llama(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, vocab_size=128,
                seq_length=128, attention_backend="unfused")
    torch.manual_seed(0)
    ref_layer = SelfAttention(cfg, False, 0.02, torch.bfloat16, CUDA)
    for p in ref_layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer = SelfAttention(cfg, False, 0.02, torch.bfloat16, CUDA)
    layer.load_state_dict(ref_layer.state_dict())
    layer.attention_backend = backend
    x = torch.randn(128, 2, 512, device=CUDA, dtype=torch.bfloat16)
    from megatronish.model.rope import RotaryEmbedding

    rot = RotaryEmbedding(cfg.kv_channels, 1.0)(128, device=CUDA)
    out, _ = layer(x, rot)
    ref, _ = ref_layer(x, rot)
    _close(out, ref, 2e-2, f"--attention-backend {backend}")


# ---- grouped GEMM --------------------------------------------------------------------------------------------
def test_grouped_mm_bf16_matches_loop():
    from megatronish.model.moe.experts import _grouped_mm_ok, grouped_linear

    g = torch.Generator(device="cuda").manual_seed(4)
    counts = [37, 0, 91, 16]  # not multiples of 8: the groups are padded to 16-byte starts (group_align)
    x = torch.randn(sum(counts), 256, device=CUDA, generator=g).to(torch.bfloat16).requires_grad_()
    w = (0.05 * torch.randn(4, 512, 256, device=CUDA, generator=g)).to(torch.bfloat16).requires_grad_()
    if not _grouped_mm_ok(x, w):
        pytest.fail("torch._grouped_mm is not selected for bf16 on CUDA with aligned shapes")
    dy = torch.randn(sum(counts), 512, device=CUDA, generator=g).to(torch.bfloat16)
    out = grouped_linear(x, w, counts, "grouped")
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    ref = grouped_linear(x, w, counts, "sequential")
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, w), dy)
    _close(out, ref, 1e-2, "grouped_mm forward")
    _close(dx, dx_ref, 1e-2, "grouped_mm dx")
    _close(dw, dw_ref, 1e-2, "grouped_mm dw")
    assert dw[1].abs().max() == 0  # the expert with no tokens gets a zero gradient


# ---- emulated FP8's GEMM --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(64, 128, 96), (50, 40, 24)])
def test_fp8_matmul_on_cuda_matches_the_dequantized_product(m, k, n):
    """``--fp8-format`` with the local layers: cuBLAS's fp8 GEMM (``torch._scaled_mm``) where k and n are multiples
    of 16, the dequantize path otherwise (50 x 40 x 24); both the fp32 product of the dequantized operands."""
    from megatronish.precision.fp8 import E4M3, E5M2, _scaled_mm_works, dequantize, fp8_matmul, quantize

    if torch.cuda.get_device_capability() >= (8, 9):
        assert _scaled_mm_works(CUDA), "torch._scaled_mm does not run fp8 on this FP8-capable GPU"
    g = torch.Generator(device="cuda").manual_seed(5)
    for da, db in ((E4M3, E4M3), (E5M2, E4M3)):
        a, b = torch.randn(m, k, device=CUDA, generator=g), torch.randn(n, k, device=CUDA, generator=g)
        sa, sb = torch.tensor(2.0, device=CUDA), torch.tensor(0.5, device=CUDA)
        qa, qb = quantize(a, sa, da), quantize(b, sb, db)
        ref = dequantize(qa, sa) @ dequantize(qb, sb).t()
        _close(fp8_matmul(qa, sa, qb, sb), ref, 1e-5, f"fp8_matmul {da} x {db} at {m}x{k}x{n}")


# ---- context-parallel block kernels --------------------------------------------------------------------------
@pytest.mark.parametrize("s,docs", [(256, False), (200, False), (256, True)])
def test_cp_block_kernels_with_merged_lse_match_full_attention(s, docs):
    """``context_parallel_attention`` with one rank runs the block plan (two chunks, the efficient-attention block
    kernels and their log-sum-exps merged) on CUDA; against SDPA's math path over the whole sequence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatronish.parallel.context_parallel import context_parallel_attention

    q, k, v = _qkv(2, 8, 4, s, 64, torch.float32, 5)
    document_ids = None
    mask = None
    if docs:
        document_ids = torch.zeros(2, s, dtype=torch.long, device=CUDA)
        document_ids[0, s // 3:] = 1
        document_ids[1, s // 2 + 5:] = 1
        causal = torch.ones(s, s, dtype=torch.bool, device=CUDA).tril()
        mask = ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)
    scale = 1 / math.sqrt(64)
    dout = torch.randn_like(q)
    out = context_parallel_attention(q, k, v, group=None, scale=scale, document_ids=document_ids)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    _close(out, ref, 1e-4, "CP blocks forward")
    for name, a, r in zip("qkv", grads, want):
        _close(a, r, 1e-4, f"CP blocks d{name}")


# ---- async-save staging --------------------------------------------------------------------------------------
def test_pinned_staging_buffers_and_side_stream_copies():
    from megatronish.checkpoint.dcp_io import Piece, Sharded
    from megatronish.checkpoint.state import StagingBuffers

    ok, why = device.pinned_memory_works()
    assert ok, why
    src = torch.randn(1024, 1024, device=CUDA)
    later = torch.randn(256, device=CUDA)
    entries = {"w": Sharded((1024, 1024), [Piece(src, (0,))]), "m": Sharded((256,), [Piece(later, (0,))])}
    staging = StagingBuffers()
    deferred = staging.stage(entries, defer=lambda key: key == "m")
    buf = entries["w"].pieces[0].tensor
    assert buf.device.type == "cpu" and buf.is_pinned()
    assert torch.equal(buf, src.cpu())
    assert len(deferred) == 1
    expected = later.cpu()
    deferred.run()  # the side-stream copy of the deferred piece
    mbuf = entries["m"].pieces[0].tensor
    assert mbuf.is_pinned() and torch.equal(mbuf, expected)
    # a second save reuses the buffers
    entries2 = {"w": Sharded((1024, 1024), [Piece(src * 2, (0,))])}
    staging.stage(entries2)
    assert staging.allocations == 2 and entries2["w"].pieces[0].tensor.data_ptr() == buf.data_ptr()
    assert torch.equal(entries2["w"].pieces[0].tensor, (src * 2).cpu())
