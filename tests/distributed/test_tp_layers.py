"""Tensor-parallel layers and vocab-parallel cross entropy vs the dense torch ops, TP 2 and 4, +/- SP."""
import pytest
import torch
import torch.nn.functional as F

from megatronish.parallel import groups
from megatronish.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.init import gather_to_global, initialize_slice, local_indices
from megatronish.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatronish.parallel.mappings import gather_from_tensor_model_parallel_region
from megatronish.testing import run_distributed

S, B, H, OUT = 8, 3, 12, 16
RTOL, ATOL = 1e-5, 1e-6


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _init(module, seed=7):
    for name, p in module.named_parameters():
        # biases are zero by default; give them values so the test sees where they are added
        d = p.desc
        if d.init == "zeros":
            d = type(d)(**{**d.__dict__, "init": "normal", "std": 0.5})
        initialize_slice(p, d, seed, name, groups.get_tensor_model_parallel_rank(),
                         groups.get_tensor_model_parallel_world_size())


def _seq_chunk(x, sp):
    if not sp:
        return x
    t, r = groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()
    return x.chunk(t, dim=0)[r]


def _full(p):
    return gather_to_global(p, p.desc, groups.get_tensor_model_parallel_group())


def _check_layers(rank, world, tp):
    groups.initialize_model_parallel(ParallelDims(world_size=world, tp=tp))
    g = groups.get_tensor_model_parallel_group()
    t, r = tp, groups.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    x = torch.randn(S, B, H)  # same on every rank
    gy = torch.randn(S, B, OUT)
    for sp in (False, True):
        # ---- ColumnParallelLinear (stride 1 and 2) -------------------------------------------------
        for stride, gather in ((1, True), (1, False), (2, False)):
            if sp and gather:
                continue
            layer = ColumnParallelLinear(H, OUT, bias=True, gather_output=gather, sequence_parallel=sp,
                                         stride=stride, tp_group=g)
            _init(layer)
            W, b = _full(layer.weight).requires_grad_(), _full(layer.bias).requires_grad_()
            xin = _seq_chunk(x, sp).clone().requires_grad_()
            y, _ = layer(xin)
            xr = x.clone().requires_grad_()
            yr = F.linear(xr, W, b)
            cols = slice(None) if gather else local_indices(layer.weight.desc, r, t)
            _close(y, yr[..., cols] if cols != slice(None) else yr, f"column(stride={stride},sp={sp}) output")
            y.backward(gy[..., cols] if cols != slice(None) else gy)
            yr.backward(gy)
            gx = xr.grad if not sp else xr.grad.chunk(t, 0)[r]
            # without SP the column layer's dgrad is all-reduced: every rank holds the full input grad
            _close(xin.grad, gx, f"column(stride={stride},sp={sp}) input grad")
            _close(gather_to_global(layer.weight.grad, layer.weight.desc, g), W.grad, "column weight grad")
            _close(gather_to_global(layer.bias.grad, layer.bias.desc, g), b.grad, "column bias grad")

        # ---- RowParallelLinear ----------------------------------------------------------------------
        for parallel_in in ((True,) if sp else (True, False)):
            layer = RowParallelLinear(H, OUT, bias=True, input_is_parallel=parallel_in, sequence_parallel=sp,
                                      tp_group=g)
            _init(layer)
            W, b = _full(layer.weight).requires_grad_(), _full(layer.bias).requires_grad_()
            cols = torch.arange(r * H // t, (r + 1) * H // t)
            xin = (x[..., cols] if parallel_in else x).clone().requires_grad_()
            y, _ = layer(xin)
            xr = x.clone().requires_grad_()
            yr = F.linear(xr, W, b)
            _close(y, _seq_chunk(yr, sp), f"row(sp={sp}, input_is_parallel={parallel_in}) output")
            y.backward(_seq_chunk(gy, sp))
            yr.backward(gy)
            _close(xin.grad, xr.grad[..., cols] if parallel_in else xr.grad, "row input grad")
            _close(gather_to_global(layer.weight.grad, layer.weight.desc, g), W.grad, "row weight grad")
            bgrad = layer.bias.grad.clone()
            if sp:  # each rank saw its sequence chunk: the bias grad is partial until summed over TP
                torch.distributed.all_reduce(bgrad, group=g)
            _close(bgrad, b.grad, f"row(sp={sp}) bias grad")

        # ---- VocabParallelEmbedding -----------------------------------------------------------------
        V, VP = 50, 64
        emb = VocabParallelEmbedding(VP, H, vocab_size=V, sequence_parallel=sp, tp_group=g)
        _init(emb)
        E = _full(emb.weight).requires_grad_()
        assert torch.all(E[V:] == 0), "padding rows must start at zero"
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
        y = emb(ids)
        yr = F.embedding(ids.t(), E)
        _close(y, _seq_chunk(yr, sp), f"embedding(sp={sp}) output")
        ge = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
        y.backward(_seq_chunk(ge, sp))
        yr.backward(ge)
        _close(gather_to_global(emb.weight.grad, emb.weight.desc, g), E.grad, f"embedding(sp={sp}) weight grad")

    # ---- vocab-parallel cross entropy (true vocab < padded, with and without label smoothing) -----
    V, VP = 50, 64
    gen = torch.Generator().manual_seed(5)
    logits_full = torch.randn(S, B, VP, generator=gen) * 3
    target = torch.randint(0, V, (S, B), generator=gen)
    gl = torch.rand(S, B, generator=gen)
    for alpha in (0.0, 0.1):
        for vocab in (V, VP):
            local = logits_full.chunk(t, dim=-1)[r].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, label_smoothing=alpha, vocab_size=vocab, group=g)
            ref_logits = logits_full[..., :vocab].clone().requires_grad_()
            logp = torch.log_softmax(ref_logits, dim=-1)
            q = torch.full_like(logp, alpha / (vocab - 1))
            q.scatter_(-1, target.unsqueeze(-1), 1.0 - alpha)  # Megatron's smoothed target distribution
            ref = -(q * logp).sum(-1)
            _close(loss, ref, f"cross entropy(alpha={alpha}, vocab={vocab}) loss")
            loss.backward(gl)
            ref.backward(gl)
            full_grad = torch.zeros(S, B, VP)
            full_grad[..., :vocab] = ref_logits.grad
            _close(local.grad, full_grad.chunk(t, dim=-1)[r], f"cross entropy(alpha={alpha}) logits grad")
    # the dense op itself, no smoothing, no padding
    local = logits_full.chunk(t, dim=-1)[r]
    _close(vocab_parallel_cross_entropy(local, target, group=g),
           F.cross_entropy(logits_full.reshape(-1, VP), target.reshape(-1), reduction="none").view(S, B),
           "cross entropy vs F.cross_entropy")
    # gather_output round trip: the all-gather reassembles the full logits
    _close(gather_from_tensor_model_parallel_region(local, g), logits_full, "gather last dim")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_dense(tp):
    assert all(run_distributed(_check_layers, 4, tp))
