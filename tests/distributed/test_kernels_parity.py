"""With the fused Triton kernels on (norms, RoPE, SwiGLU, vocab-parallel cross entropy; run through Triton's
interpreter on CPU), a 2-layer Llama at TP 2 (with and without sequence parallelism, with full and selective
activation recompute, label smoothing and partial rotary) gives the per-token losses and every parameter
gradient of the one-process model with the kernels off, built from the same seed, no weights copied (fp32,
rtol 1e-5); the ranks count the fused calls, so a silent fall-back to PyTorch fails. The fused cross entropy
alone at TP 2 matches torch's cross entropy on the gathered logits, including a rank whose vocabulary slice is
all padding."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish.testing import run_distributed
from support.kernel_support import import_interpreted, not_interpreted_mark

kernels, _triton, _mods = import_interpreted("fused_cross_entropy", "fused_norms", "fused_rope", "fused_swiglu")
fused_cross_entropy = _mods[0]

from megatronish.config import llama  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.model import GPTModel  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.parallel import groups  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.parallel.context_parallel import (  # noqa: E402 - after the interpreted kernels are loaded
    gather_from_context_parallel,
    split_for_context_parallel,
)
from megatronish.parallel.dims import ParallelDims  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.parallel.init import gather_to_global  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.parallel.layers import allreduce_sequence_parallel_grads  # noqa: E402 - after the interpreted kernels are loaded
from megatronish.parallel.random import set_random_seed  # noqa: E402 - after the interpreted kernels are loaded

pytestmark = not_interpreted_mark(_triton)

SEED, B, S, V = 1234, 2, 8, 150  # V=150 pads to 256 at TP 2: rank 1's slice holds 22 true entries
# name -> (model config overrides, label smoothing, sequence parallel)
VARIANTS = {
    "plain": (dict(), 0.0, False),
    "sp+full recompute": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                          0.0, True),
    "sp+selective+smoothing+rotary50": (dict(rotary_percent=0.5, recompute_granularity="selective"), 0.1, True),
}
# fused calls per rank over the three variants: 2 layers x 2 norms + the final norm, q and k per layer, one
# SwiGLU per layer, one loss; full recompute runs the layers' forward twice
EXPECTED_CALLS = {"rms_norm": 5 + 9 + 5, "apply_rotary_": 4 + 8 + 4, "swiglu": 2 + 4 + 2,
                  "vocab_parallel_cross_entropy": 3}


def _config(overrides, fused):
    return llama(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
                 vocab_size=V, seq_length=S, attention_dropout=0.0, hidden_dropout=0.0,
                 use_triton_kernels=fused, cross_entropy_loss_fusion=fused, cross_entropy_fusion_impl="te",
                 **overrides)


def _batch():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _run(model):
    ids, labels = _batch()
    model.train()
    loss = model(ids, labels=labels)  # [b, s]
    loss.mean().backward()
    tp_group = model.parallel.tp_group
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {n: gather_to_global(p.grad, p.desc, tp_group) for n, p in model.named_global_parameters()}
    return loss.detach(), grads


def _reference(name):
    overrides, smoothing, _ = VARIANTS[name]
    set_random_seed(SEED)
    model = GPTModel(_config(overrides, fused=False), label_smoothing=smoothing)
    model.init_parameters(SEED)
    return _run(model)


def _check_model(name, ref):
    overrides, smoothing, sp = VARIANTS[name]
    set_random_seed(SEED, tp_rank=groups.get_tensor_model_parallel_rank())
    model = GPTModel(_config(overrides, fused=True), sequence_parallel=sp, label_smoothing=smoothing,
                     parallel=groups.get_context())
    model.init_parameters(SEED)
    loss, grads = _run(model)
    r_loss, r_grads = ref
    torch.testing.assert_close(loss, r_loss, rtol=1e-5, atol=0, msg=lambda m: f"{name} loss: {m}")
    assert grads.keys() == r_grads.keys()
    for n, g in grads.items():
        r = r_grads[n]
        if g.shape != r.shape:  # vocabulary padded further at TP 2: the extra rows get no gradient
            assert torch.all(g[r.shape[0]:] == 0), f"{name} {n}: padding rows got gradient"
            g = g[: r.shape[0]]
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item(),
                                   msg=lambda m: f"{name} grad {n}: {m}")


def _check_cross_entropy(rank):
    """Fused at TP 2 vs torch's cross entropy on the global logits' true entries (Megatron's label smoothing is
    torch's with alpha * V / (V - 1)); vocab 100 of 256 leaves rank 1's slice all padding."""
    g = torch.Generator().manual_seed(7)
    for vocab, smoothing, dtype in ((100, 0.0, torch.float32), (200, 0.1, torch.float32), (200, 0.0, torch.bfloat16)):
        logits = (torch.randn(3, 2, 256, generator=g) * 3).to(dtype)
        target = torch.randint(0, vocab, (3, 2), generator=g)
        dloss = torch.rand(3, 2, generator=g)
        full = logits.float().clone().requires_grad_()
        ref = F.cross_entropy(full[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none",
                              label_smoothing=smoothing * vocab / (vocab - 1)).view(3, 2)
        ref.backward(dloss)
        mine = logits[..., rank * 128:(rank + 1) * 128].clone().requires_grad_()
        loss = fused_cross_entropy.vocab_parallel_cross_entropy(mine * 1, target, smoothing, vocab,
                                                                groups.get_tensor_model_parallel_group(), block_v=32)
        loss.backward(dloss)
        what = f"CE TP=2 vocab={vocab} smoothing={smoothing} {dtype}"
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0, msg=lambda m: f"{what} loss: {m}")
        expected = full.grad[..., rank * 128:(rank + 1) * 128]
        if dtype == torch.float32:
            torch.testing.assert_close(mine.grad, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")
        else:  # the exact gradient rounded to bf16
            torch.testing.assert_close(mine.grad.float(), expected.bfloat16().float(), rtol=2 ** -8, atol=1e-7,
                                       msg=lambda m: f"{what}: {m}")


def _count_fused_calls(calls):
    """Wrap the fused ops the model calls (this forked rank only), so the test knows they ran."""
    for name in EXPECTED_CALLS:
        fn = getattr(kernels, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)
        setattr(kernels, name, counted)


def _worker(rank, world, refs):
    _triton.POISON_OUTPUTS = True
    calls = {}
    _count_fused_calls(calls)
    groups.initialize_model_parallel(ParallelDims(world_size=world, tp=2))
    _check_cross_entropy(groups.get_tensor_model_parallel_rank())
    for name, ref in refs.items():
        _check_model(name, ref)
    assert calls == EXPECTED_CALLS, calls
    return True


def test_llama_tp2_kernels_on_equals_one_process_kernels_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the model's availability check, in the forked ranks too
    refs = {name: _reference(name) for name in VARIANTS}
    assert all(run_distributed(_worker, 2, refs, timeout=300))


def _cp_worker(rank, world, ref):
    """Context parallelism 2 with the fused kernels on (RoPE at each token's global position): per-token losses
    and the gradients summed over the CP ranks equal the one-process model with the kernels off."""
    _triton.POISON_OUTPUTS = True
    calls = {}
    _count_fused_calls(calls)
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, cp=2))
    set_random_seed(SEED)
    model = GPTModel(_config({}, fused=True), parallel=ctx)
    model.init_parameters(SEED)
    model.train()
    ids, labels = (split_for_context_parallel(t, 1, 2, ctx.cp_rank) for t in _batch())
    loss = model(ids, labels=labels)  # [b, 2c]: this rank's tokens
    loss.sum().backward()
    r_loss, r_grads = ref
    torch.testing.assert_close(gather_from_context_parallel(loss.detach(), 1, ctx.cp_group), r_loss, rtol=1e-5,
                               atol=0)
    for n, p in model.named_global_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.cp_group)  # each CP rank holds its tokens' share
        torch.testing.assert_close(g, r_grads[n], rtol=1e-5, atol=1e-5 * r_grads[n].abs().max().item(),
                                   msg=lambda m: f"CP2 kernels grad {n}: {m}")
    assert calls["rms_norm"] == 5 and calls["apply_rotary_"] == 4 and calls["swiglu"] == 2, calls
    return True


def test_llama_cp2_kernels_on_equals_one_process_kernels_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    set_random_seed(SEED)
    model = GPTModel(_config({}, fused=False))
    model.init_parameters(SEED)
    model.train()
    ids, labels = _batch()
    loss = model(ids, labels=labels)
    loss.sum().backward()
    ref = (loss.detach(), {n: p.grad.clone() for n, p in model.named_global_parameters()})
    assert all(run_distributed(_cp_worker, 2, ref, timeout=300))
