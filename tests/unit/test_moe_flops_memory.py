"""FLOPs and the theoretical memory report of mixture-of-experts models, against the formulas written out here."""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import gpt2, llama
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext
from megatronish.training.flops import num_floating_point_operations
from megatronish.training.memory import report_theoretical_memory, theoretical_memory


def _megatron_flops(B, s, h, a, g, kv, V, ffn, swiglu, pattern, k=0, moe_ffn=0, shared=0):
    """Megatron-LM's accounting, GEMM by GEMM, per token: 3 (forward, two backward GEMMs) x 2 (multiply-add)
    x the weight sizes; attention scores and values ``B s^2`` x 3 x 2 x 2q per layer (no causal halving)."""
    gemm = 3 * 2
    q = a * kv
    ffn_mats = 3 if swiglu else 2  # [gate; up] and down, or up and down
    n_moe = sum(pattern)
    n_dense = len(pattern) - n_moe
    mlp = h * ffn_mats * (ffn * n_dense + (moe_ffn * k + shared) * n_moe)
    attn = (h * (q + 2 * kv * g) + q * h) * len(pattern)
    logits = h * V
    return B * s * gemm * (mlp + attn + logits) + B * s * s * gemm * 2 * q * len(pattern)


@pytest.mark.parametrize("shared", [None, 48])
def test_moe_flops_formula(shared):
    pattern = [1, 0, 1, 1]
    c = llama(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
              vocab_size=1000, seq_length=256, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
              moe_layer_freq=pattern, moe_shared_expert_intermediate_size=shared)
    expected = _megatron_flops(3, 256, 64, 4, 2, 16, c.padded_vocab_size(1), 128, True, pattern, k=2, moe_ffn=32,
                               shared=shared or 0)
    assert num_floating_point_operations(c, 3) == pytest.approx(expected, rel=1e-12)
    # every second layer (freq 2: layers 0 and 2), GELU experts, top-1
    c = gpt2(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=128, num_experts=4,
             moe_router_topk=1, moe_ffn_hidden_size=96, moe_layer_freq=2, add_bias_linear=False)
    expected = _megatron_flops(2, 128, 64, 4, 4, 16, c.padded_vocab_size(1), 256, False, [1, 0, 1, 0], k=1,
                               moe_ffn=96)
    assert num_floating_point_operations(c, 2) == pytest.approx(expected, rel=1e-12)


def test_moe_flops_equal_dense_with_the_active_ffn():
    """An MoE layer counts the k experts a token runs: 8 experts top-2 of F = a dense layer of 2F."""
    moe = llama(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=64, num_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=48)
    dense = llama(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=64,
                  ffn_hidden_size=96)
    assert num_floating_point_operations(moe, 4) == pytest.approx(num_floating_point_operations(dense, 4))


FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--num-experts", "8", "--moe-ffn-hidden-size", "24",
         "--moe-layer-freq", "[1,1,0,1]", "--use-distributed-optimizer"]


@pytest.mark.parametrize("layout", [
    dict(world=4, tp=1, pp=1, ep=2, etp=1),  # dp 4, edp 4/2 = 2
    dict(world=8, tp=2, pp=2, ep=2, etp=1),  # dp 2, edp (2*2)/2 = 2 (EP spans the TP ranks)
    dict(world=8, tp=2, pp=1, ep=2, etp=2),  # dp 4, edp (2*4)/(2*2) = 2
    dict(world=8, tp=1, pp=1, ep=8, etp=1),  # dp 8, edp 1: the expert state is not sharded
])
def test_memory_report_counts_experts_per_rank(layout):
    """Each rank holds E/EP experts of its stage's MoE layers, split over expert-TP; under the distributed
    optimizer their Adam moments (8 bytes in fp32; weight and gradient 4 + 4 stay whole) are sharded over
    expert-DP = TP*DP/(ETP*EP), the rest over DP: ``(n - n_e) (8 + 8/DP) + n_e (8 + 8/EDP)`` bytes."""
    w, tp, pp, ep, etp = (layout[k] for k in ("world", "tp", "pp", "ep", "etp"))
    flags = FLAGS + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                     "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]
    if tp > 1:
        flags.append("--sequence-parallel")
    cfg = configs_from_args(parse_args(flags), w)
    dp = w // (tp * pp)
    edp = tp * dp // (etp * ep)
    for rank in (0, w - 1):  # first and last stage
        ctx = ParallelContext.fake(cfg.parallel, rank)
        chunks = build_model_chunks(cfg.model, ctx, sequence_parallel=cfg.sequence_parallel)
        stage = rank // (w // pp)
        layers = range(stage * 4 // pp, (stage + 1) * 4 // pp)
        moe_layers = sum([1, 1, 0, 1][i] for i in layers)
        # per MoE layer: E/EP experts x ([gate; up] 2F x h + down h x F) / ETP
        n_expert = moe_layers * (8 // ep) * (2 * 24 * 32 + 32 * 24) // etp
        lines = []
        est = report_theoretical_memory(cfg, None, chunks, print_fn=lines.append)
        n = sum(p.numel() for c in chunks for p in c.parameters())
        assert est["num_expert_params"] == n_expert
        assert est["weights_and_optimizer"] == pytest.approx((n - n_expert) * (8 + 8 / dp)
                                                             + n_expert * (8 + 8 / edp))
        assert f"{n_expert} of them expert params" in lines[0] and f"expert-DP {edp}" in lines[0]


def test_memory_without_experts_unchanged():
    cfg = configs_from_args(parse_args(FLAGS[:FLAGS.index("--num-experts")] + ["--use-distributed-optimizer"]), 2)
    est = theoretical_memory(cfg, 1000)
    assert est["weights_and_optimizer"] == pytest.approx(1000 * (8 + 8 / 2))
    assert cfg.optim.params_dtype == torch.float32
