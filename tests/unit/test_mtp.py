"""Multi-token prediction (``--mtp-num-layers``): the training loss equals a dense reference written from
DeepSeek-V3's formula (fp32, rtol 1e-5), and so does every gradient; the flags reach the config; what is not
supported is one clear error."""
import re

import pytest
import torch
import torch.nn.functional as F

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import llama
from megatronish.errors import ConfigError
from megatronish.model import GPTModel
from megatronish.parallel.context import ParallelContext
from megatronish.training.step import make_forward_step

B, S, V, H, LAMBDA = 2, 12, 64, 32, 0.3


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model, ids, labels, mask, per_token: bool):
    """``L = L_main + lambda / D * sum_k L_k`` with ``L_k`` the masked mean over positions ``i`` (``i + k < s``) of
    ``CE(W_out h^k_i, t_{i+k+1})`` weighted by ``mask_{i+k}``, ``h^k_i = TRM_k(M_k [RMSNorm(E t_{i+k});
    RMSNorm(h^{k-1}_i)])`` then its norm, ``h^0`` the decoder's normed output (per token: the sums, each depth's
    rescaled to the main token count)."""
    cfg = model.config
    E = model.embedding.word_embeddings.weight
    W = model.output_layer.weight if model.output_layer.weight is not None else E
    rotary = model.rotary(S)
    h = model.decoder(E[ids].transpose(0, 1), rotary)  # [s, b, h]: the decoder (tested elsewhere), final norm
    ce = F.cross_entropy((h @ W.t())[..., :V].reshape(-1, V), labels.t().reshape(-1), reduction="none")
    ce = ce.view(S, B).t()
    tokens = mask.sum()
    total = (ce * mask).sum() / (1 if per_token else tokens)
    depths = model.mtp.layers
    for k, layer in enumerate(depths, start=1):
        eps = cfg.norm_epsilon
        e = E[ids[:, k:]].transpose(0, 1)  # tokens i + k, for i < s - k
        x = torch.cat((_rms(e, layer.enorm.weight, eps), _rms(h[: S - k], layer.hnorm.weight, eps)), -1)
        x = x @ layer.eh_proj.weight.t()
        x = F.pad(x, (0, 0, 0, 0, 0, k))  # the last k positions have no token k ahead: any input, masked below
        h = _rms(layer.mtp_model_layer(x, rotary), layer.final_layernorm.weight, eps)
        logits = (h[: S - k] @ W.t())[..., :V]
        ce_k = F.cross_entropy(logits.reshape(-1, V), labels[:, k:].t().reshape(-1), reduction="none")
        m = mask[:, k:]
        ce_k = (ce_k.view(S - k, B).t() * m).sum()
        term = ce_k * tokens / m.sum() if per_token else ce_k / m.sum()
        total = total + LAMBDA / len(depths) * term
    return total


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per-token"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_gradients_equal_the_formula(per_token, tied):
    cfg = llama(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=V, seq_length=S, ffn_hidden_size=48,
                mtp_num_layers=2, mtp_loss_scaling_factor=LAMBDA, attention_dropout=0.0, hidden_dropout=0.0,
                make_vocab_size_divisible_by=1, untie_embeddings_and_output_weights=not tied)
    model = GPTModel(cfg)
    model.init_parameters(3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.25).float()
    batch = {"tokens": ids, "labels": labels, "loss_mask": mask}
    output, loss_func = make_forward_step(False, ParallelContext.single(), per_token, LAMBDA)(iter([batch]), model)
    assert output.shape == (3, B, S)
    loss, report = loss_func(output)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = _reference(model, ids, labels, mask, per_token)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert any("mtp.layers.1." in n and ours[n].abs().sum() > 0 for n in ours)
    for k in (1, 2):  # each depth's [loss sum, tokens]: its tokens are the mask shifted k to the left
        assert report[f"mtp_{k} loss"][1] == mask[:, k:].sum()


def _args(*extra, world=1):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--vocab-size", "100",
            "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "1", "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--lr", "1e-4", "--attention-dropout", "0"]
    return configs_from_args(parse_args(base + list(extra)), world_size=world)


def test_flags():
    cfg = _args("--position-embedding-type", "rope", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.2")
    assert (cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor) == (2, 0.2)
    assert _args("--position-embedding-type", "rope").model.mtp_num_layers is None
    # the last stage looks tokens up: the embedding group spans the first and last stage even when untied
    cfg = _args("--position-embedding-type", "rope", "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
                "--untie-embeddings-and-output-weights", world=2)
    assert cfg.parallel.embedding_groups() == [[0, 1]]
    # with context parallelism (tests/distributed/test_mtp_parity.py: CP 2 equals one process)
    assert _args("--position-embedding-type", "rope", "--mtp-num-layers", "1", "--context-parallel-size", "2",
                 world=2).parallel.cp == 2


@pytest.mark.parametrize("flags,message", [
    (["--position-embedding-type", "rope", "--mtp-num-layers", "0"], "--mtp-num-layers must be >= 1"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers needs rotary positions"),
])
def test_flag_problems(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _args(*flags, world=2)


def _gemm_flops(tokens, s, h, a, g, kv, V, ffn, swiglu, pattern, depths, k=0, moe_ffn=0):
    """Megatron-LM's count GEMM by GEMM, per token: 3 (forward, two backward GEMMs) x 2 (multiply-add) x the
    weights each token meets: per layer (the decoder's ``pattern``, then each depth's, MoE when the last decoder
    layer is) QKV, projection, scores and values over ``s`` keys, the MLP; per depth ``eh_proj`` ``[h, 2h]`` and
    three norms of ``h``; the output layer once per depth and once for the decoder."""
    q = a * kv
    mats = 3 if swiglu else 2
    layers = list(pattern) + [pattern[-1]] * depths
    per_token = sum(h * (q + 2 * kv * g) + q * h + 2 * s * q + mats * h * (moe_ffn * k if moe else ffn)
                    for moe in layers)
    per_token += depths * (2 * h * h + 3 * h) + (1 + depths) * h * V
    return tokens * 3 * 2 * per_token


def test_flops_count_the_depths():
    from megatronish.config import gpt2
    from megatronish.training.flops import num_floating_point_operations

    # by hand: L = D = 1, h = 4, one head, s = 2, V = 8, GELU FFN 8, per token: each layer 4*12 (QKV) + 16
    # (projection) + 2*2*4 (scores, values) + 2*4*8 (MLP) = 144, twice; eh_proj 32 + norms 12; logits 2*32;
    # 396 x 6 = 2376 per token, 2 tokens
    tiny = gpt2(num_layers=1, hidden_size=4, num_attention_heads=1, seq_length=2, vocab_size=8, ffn_hidden_size=8,
                make_vocab_size_divisible_by=8, position_embedding_type="rope", mtp_num_layers=1)
    assert num_floating_point_operations(tiny, 1) == 4752
    assert _gemm_flops(2, 2, 4, 1, 1, 4, 8, 8, False, [0], 1) == 4752
    dense = llama(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=1000, seq_length=128, mtp_num_layers=2)
    assert num_floating_point_operations(dense, 3) == pytest.approx(
        _gemm_flops(3 * 128, 128, 64, 4, 2, 16, dense.padded_vocab_size(1), 96, True, [0, 0, 0], 2), rel=1e-12)
    for last in (0, 1):  # the depths' layers follow the decoder's last: dense, or MoE (top-2 of F = 24)
        moe = llama(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=1000,
                    seq_length=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                    moe_layer_freq=[1, last], mtp_num_layers=3)
        assert num_floating_point_operations(moe, 2) == pytest.approx(_gemm_flops(
            2 * 64, 64, 64, 4, 4, 16, moe.padded_vocab_size(1), 96, True, [1, last], 3, k=2, moe_ffn=24), rel=1e-12)


def test_activation_estimate_counts_the_depths():
    """Each depth on the last stage: its layer (Korthikanti's ``sbh(34 + 5as/h)``, multi-head attention and a 4h
    GELU MLP), ``10sbh`` of its own inputs and its logits and loss ``4sbh(1 + V/h)``."""
    from megatronish.config import gpt2
    from megatronish.training.memory import activation_bytes

    s, b, h, a, L = 256, 2, 64, 4, 8

    def cfg(depths):
        return gpt2(num_layers=L, hidden_size=h, num_attention_heads=a, vocab_size=1000, seq_length=s,
                    position_embedding_type="rope", mtp_num_layers=depths)
    V = cfg(None).padded_vocab_size(1)
    sbh = s * b * h
    layer, output = sbh * (34 + 5 * a * s / h), 4 * sbh * (1 + V / h)
    depth = layer + 10 * sbh + output
    base = activation_bytes(cfg(None), micro_batch_size=b)
    assert base == pytest.approx(L * layer + 8 * s * b + sbh + output)
    assert activation_bytes(cfg(3), micro_batch_size=b) == pytest.approx(base + 3 * depth)
    # PP 4 (1F1B, 8 microbatches): the first stage holds 4 microbatches of 2 layers; the last one microbatch of
    # its 2 layers, its output layer and the depths: fuller with 7 depths, not with 1
    first = activation_bytes(cfg(None), micro_batch_size=b, pp=4, num_microbatches=8)
    assert first == pytest.approx(4 * (2 * layer + 8 * s * b + sbh))
    assert activation_bytes(cfg(1), micro_batch_size=b, pp=4, num_microbatches=8) == pytest.approx(first)
    assert activation_bytes(cfg(7), micro_batch_size=b, pp=4, num_microbatches=8) == pytest.approx(
        2 * layer + output + 7 * depth)
    # interleaved (2 chunks of 1 layer): the last stage keeps (2 - 1) * 4 + 1 = 5 chunks in flight
    assert activation_bytes(cfg(7), micro_batch_size=b, pp=4, vp=2, num_microbatches=8) == pytest.approx(
        5 * layer + output + 7 * depth)


def test_memory_report_counts_the_depths_on_the_last_stage():
    """PP 2 x TP 2: the last stage's report counts its parameters as built, the depths among them matching their
    count by hand per TP rank: three norms, ``eh_proj`` ``2h x h / t`` and a layer (two norms, QKV ``3h^2/t``,
    projection ``h^2/t``, SwiGLU ``3hF/t``); the first stage holds none."""
    from megatronish.model.build import build_model_chunks
    from megatronish.training.memory import report_theoretical_memory

    cfg = _args("--position-embedding-type", "rope", "--mtp-num-layers", "2", "--pipeline-model-parallel-size",
                "2", "--tensor-model-parallel-size", "2", world=4)
    h, f, t = 64, cfg.model.ffn_hidden_size, 2
    depth = 3 * h + 2 * h * h // t + 2 * h + 3 * h * h // t + h * h // t + 3 * h * f // t
    for rank, mtp in ((0, 0), (3, 2 * depth)):
        chunks = build_model_chunks(cfg.model, ParallelContext.fake(cfg.parallel, rank), sequence_parallel=False)
        lines = []
        est = report_theoretical_memory(cfg, None, chunks, print_fn=lines.append)
        assert est["num_params"] == sum(p.numel() for c in chunks for p in c.parameters())
        assert est["num_mtp_params"] == mtp
        assert (f"{mtp} of them in the multi-token-prediction depths" in lines[0]) == bool(mtp), lines[0]
