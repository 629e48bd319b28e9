"""Multi-latent attention, YaRN and DeepSeek-V3's MoE layer against transformers' DeepseekV3 modules (random
weights copied into ours by name in the test: a reference check of the math, fp32, rtol 1e-5), YaRN's tables
against transformers' ``_compute_yarn_parameters``, the router against transformers' DeepseekV3TopkRouter, the
flags, and the FLOPs formula's MLA terms."""
import math
import re

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import llama
from megatronish.errors import ConfigError
from megatronish.model.mla import MLASelfAttention
from megatronish.model.moe.layer import is_moe_layer
from megatronish.model.moe.router import topk_routing
from megatronish.model.rope import RotaryEmbedding, YarnScaling, rotary_embedding
from megatronish.model.transformer import TransformerLayer
from megatronish.parallel.context import ParallelContext
from megatronish.training.flops import num_floating_point_operations

hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
S, B, H, HEADS, EPS = 12, 2, 48, 4, 1e-6
YARN = dict(rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=0.8)


def _ours(q_lora_rank, yarn, **kw):
    return llama(num_layers=2, hidden_size=H, num_attention_heads=HEADS, vocab_size=64, seq_length=S,
                 ffn_hidden_size=40, multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=20,
                 qk_head_dim=12, qk_pos_emb_head_dim=16, v_head_dim=10, qk_layernorm=True, norm_epsilon=EPS,
                 rope_type="yarn" if yarn else "rope", attention_dropout=0.0, hidden_dropout=0.0,
                 **(YARN if yarn else {}), **kw)


def _hf_config(q_lora_rank, yarn, **kw):
    rope = dict(rope_type="default", rope_theta=10000.0)
    if yarn:
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=YARN["rotary_scaling_factor"],
                    original_max_position_embeddings=YARN["yarn_original_max_position_embeddings"], beta_fast=32.0,
                    beta_slow=1.0, mscale=YARN["mscale"], mscale_all_dim=YARN["mscale_all_dim"])
    cfg = hf.DeepseekV3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              q_lora_rank=q_lora_rank, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=16,
                              v_head_dim=10, rms_norm_eps=EPS, intermediate_size=40, max_position_embeddings=1024,
                              rope_parameters=rope, attention_bias=False, vocab_size=64, num_hidden_layers=2, **kw)
    cfg._attn_implementation = "eager"
    return cfg


ATTN_NAMES = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
              "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
              "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(module.named_parameters()) + sorted(module.named_buffers()):
            if t.dtype.is_floating_point and t.dim() <= 3 and "inv_freq" not in _:
                t.copy_(torch.randn(t.shape, generator=g) * (0.3 if t.dim() > 1 else 0.1) + (t.dim() == 1))


def _copy_attention(src, dst):
    state = {}
    for name, t in src.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        state[f"{ATTN_NAMES[module]}.{leaf}"] = t
    missing = dst.load_state_dict(state, strict=True)
    assert not missing.missing_keys


def _inputs(cfg, yarn):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, S, H, generator=g)
    pos = torch.arange(S).expand(B, S)
    rope = hf.DeepseekV3RotaryEmbedding(cfg)
    cos, sin = rope(x, pos)
    mask = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    return x, (cos, sin), mask


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["full-rank-q", "q-lora"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_attention_matches_transformers(q_lora_rank, yarn):
    cfg = _hf_config(q_lora_rank, yarn)
    ref = hf.DeepseekV3Attention(cfg, layer_idx=0).eval()
    _randomize(ref, 1)
    ours_cfg = _ours(q_lora_rank, yarn)
    ours = MLASelfAttention(ours_cfg, False, 0.02).eval()
    _copy_attention(ref, ours)
    x, pe, mask = _inputs(cfg, yarn)
    expected = ref(x, pe, mask)[0]
    rotary = rotary_embedding(ours_cfg)(S)
    out, bias = ours(x.transpose(0, 1), rotary)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-5, atol=1e-5)  # |out| ~ 1
    if yarn:  # the softmax scale carries mscale(factor, mscale_all_dim)^2
        m = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["rotary_scaling_factor"]) + 1
        assert ours.softmax_scale == pytest.approx(m * m / math.sqrt(12 + 16)) and ref.scaling == pytest.approx(
            ours.softmax_scale)


def _copy_layer(src, dst, moe: bool):
    state = {}
    for name, t in src.state_dict().items():
        parts = name.split(".")
        if parts[0] == "self_attn":
            state[f"self_attention.{ATTN_NAMES[parts[1]]}.{parts[2]}"] = t
        elif parts[0] == "input_layernorm":
            state[name] = t
        elif parts[0] == "post_attention_layernorm":
            state["pre_mlp_layernorm.weight"] = t
    mlp = src.mlp
    dense = mlp.shared_experts if moe else mlp
    prefix = "mlp.shared_experts." if moe else "mlp."
    state[prefix + "linear_fc1.weight"] = torch.cat([dense.gate_proj.weight, dense.up_proj.weight])
    state[prefix + "linear_fc2.weight"] = dense.down_proj.weight
    if moe:
        state["mlp.router.weight"] = mlp.gate.weight
        state["mlp.router.expert_bias"] = mlp.gate.e_score_correction_bias
        state["mlp.experts.linear_fc1.weight"] = mlp.experts.gate_up_proj
        state["mlp.experts.linear_fc2.weight"] = mlp.experts.down_proj
    result = dst.load_state_dict(state, strict=True)
    assert not result.missing_keys


MOE = dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
           moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True)


@pytest.mark.parametrize("layer", [0, 1], ids=["dense-first-layer", "moe-layer"])
def test_decoder_layer_matches_transformers(layer):
    """DeepSeek-V3's decoder layer (first layer dense with its own FFN size, then MoE with sigmoid scores, the
    selection-only expert bias, group-limited top-k, the routed scaling factor and shared experts) with YaRN MLA."""
    cfg = _hf_config(24, True, **MOE)
    ref = hf.DeepseekV3DecoderLayer(cfg, layer_idx=layer).eval()
    _randomize(ref, 2 + layer)
    ours_cfg = _ours(24, True, num_experts=8, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16, moe_router_topk=4,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                     moe_shared_expert_intermediate_size=32, moe_router_load_balancing_type="none",
                     moe_grouped_gemm=False)
    ours = TransformerLayer(ours_cfg, layer, False, parallel=ParallelContext.single()).eval()
    _copy_layer(ref, ours, moe=layer == 1)
    x, pe, mask = _inputs(cfg, True)
    expected = ref(x, attention_mask=mask, position_embeddings=pe)
    out = ours(x.transpose(0, 1), rotary_embedding(ours_cfg)(S)).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_router_matches_transformers():
    """Sigmoid scores, the expert bias for the choice only (unbiased weights combine), group-limited routing
    (a group's score: its two best experts'; here top-k / group-top-k = 2, where megatron-core's rule agrees),
    normalisation and the routed scaling factor."""
    cfg = _hf_config(None, False, **MOE)
    ref = hf.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(8, H, generator=g))
        ref.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(64, H, generator=g)
    logits, weights, idx = ref(x)
    probs, rmap = topk_routing(logits, 4, score_function="sigmoid", num_groups=4, group_topk=2,
                               scaling_factor=2.5, expert_bias=ref.e_score_correction_bias)
    expected = torch.zeros(64, 8).scatter(1, idx, weights)
    assert torch.equal(rmap, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mscale,mscale_all_dim,percent", [(1.0, 0.0, 1.0), (1.0, 1.0, 1.0), (0.9, 0.7, 0.5)])
def test_yarn_tables_match_transformers(mscale, mscale_all_dim, percent):
    """GQA YaRN (``--position-embedding-type yarn``): inverse frequencies and the cos/sin attention factor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=512,
                beta_fast=24.0, beta_slow=2.0, mscale=mscale, mscale_all_dim=mscale_all_dim,
                partial_rotary_factor=percent)
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = llama(num_layers=1, hidden_size=256, num_attention_heads=4, vocab_size=8, seq_length=64,
                position_embedding_type="yarn", rotary_base=500000, rotary_percent=percent, rotary_scaling_factor=8.0,
                yarn_original_max_position_embeddings=512, yarn_beta_fast=24.0, yarn_beta_slow=2.0, mscale=mscale,
                mscale_all_dim=mscale_all_dim)
    ours = rotary_embedding(cfg)
    torch.testing.assert_close(ours.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)
    cos, sin = ours(64)
    plain_cos, _ = RotaryEmbedding(64, percent, 500000)(64)  # YaRN changes the tables
    assert cos.shape == (64, 1, 1, int(64 * percent)) and not torch.allclose(cos, plain_cos)
    angle = torch.outer(torch.arange(64.0), inv_freq)
    torch.testing.assert_close(sin[:, 0, 0, : angle.size(1)], angle.sin() * factor, rtol=1e-5, atol=1e-6)


def test_yarn_with_factor_one_is_plain_rope():
    plain = RotaryEmbedding(16, 1.0, 10000)
    yarn = RotaryEmbedding(16, 1.0, 10000, YarnScaling(1.0))
    torch.testing.assert_close(yarn.inv_freq, plain.inv_freq, rtol=1e-7, atol=0)
    assert yarn.attention_factor == 1.0


# ================================================================================================ flags
def _args(*extra):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--vocab-size", "100",
            "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "1",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--lr", "1e-4"]
    return configs_from_args(parse_args(base + list(extra)), world_size=1)


def test_flags_reach_the_config():
    cfg = _args("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
                "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "40", "--mscale",
                "0.5", "--mscale-all-dim", "0.5", "--yarn-original-max-position-embeddings", "8",
                "--qk-layernorm", "--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)",
                "--moe-ffn-hidden-size", "12", "--ffn-hidden-size", "40")
    a = cfg.model.attention
    assert (a.multi_latent_attention, a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
            a.v_head_dim, a.rotary_scaling_factor, a.mscale, a.yarn_original_max_position_embeddings) == \
        (True, 24, 16, 8, 4, 6, 40.0, 0.5, 8)
    assert a.yarn and a.rope_type is None  # Megatron: MLA takes YaRN by default
    assert cfg.model.moe.moe_layer_freq == [0, 1, 1, 1]
    assert [is_moe_layer(cfg.model, i) for i in range(4)] == [False, True, True, True]
    assert (cfg.model.ffn_hidden_size, cfg.model.moe.moe_ffn_hidden_size) == (40, 12)
    assert not _args("--multi-latent-attention", "--rope-type", "rope").model.attention.yarn
    assert _args("--position-embedding-type", "yarn").model.attention.yarn


@pytest.mark.parametrize("flags,message", [
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"], "--group-query-attention"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5 must be even"),
    (["--multi-latent-attention", "--kv-lora-rank", "0"], "--kv-lora-rank must be >= 1"),
    (["--rope-type", "yarn"], "--rope-type yarn applies to --multi-latent-attention"),
    (["--cache-mla-latents"], "--cache-mla-latents applies to --multi-latent-attention"),
])
def test_flag_problems(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _args(*flags)


# ================================================================================================ FLOPs
def test_flops_count_mla_terms():
    """Megatron-LM's ``num_floating_point_operations`` MLA branch, term by term: per layer and token, forward
    2x the GEMMs (q down/up or full-rank q, kv down/up, core attention causal halves, output projection), then x3
    for backward."""
    def model(q_lora):
        return llama(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32,
                     ffn_hidden_size=96, multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=16,
                     qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, make_vocab_size_divisible_by=1)
    h, n, s, L, B_ = 64, 4, 32, 2, 3
    for q_lora in (None, 24):
        cfg = model(q_lora)
        q_term = h * n * 12 if q_lora is None else q_lora * (h + n * 12 + 1)
        attn = (q_term + 16 * (h + n * (8 + 6) + 1) + h * 4 + n * 6 * h + n * (12 + 6) * s / 2) * 2  # fwd MACs x2
        mlp = 2 * h * 96 * 1.5 * 2  # SwiGLU: fc1 (2 x 96 out) + fc2, x2 for MACs
        logits = 2 * h * 100
        expected = 3 * B_ * s * (L * (attn + mlp) + logits)
        assert num_floating_point_operations(cfg, B_) == pytest.approx(expected, rel=1e-12)


def test_generation_cache_equals_full_forward():
    """The generation cache (the latents; tests/unit/test_mla_generation.py has more) gives the full forward's
    logits."""
    from megatronish.inference.kv_cache import InferenceParams
    from megatronish.model import GPTModel

    model = GPTModel(_ours(24, True)).eval()
    model.init_parameters(3)
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)
        cache = InferenceParams.for_model(model, max_batch=B, max_sequence=S)
        steps = [model(ids[:, :5], inference_params=cache)]
        cache.advance(5)
        for t in range(5, S):
            steps.append(model(ids[:, t:t + 1], inference_params=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
