"""transformers' DeepseekV3ForCausalLM conversion in one process: config.json maps to our config (multi-latent
attention with and without the query latent, YaRN and plain RoPE, first-k-dense, sigmoid routing with the expert
bias, group-limited top-k, the routed scaling factor, shared experts, tied embeddings) and back; the name map is our
model's parameter list; the converted model gives transformers' logits and loss (fp32, rtol 1e-5); both expert
layouts round trip bitwise; tools/checkpoint/convert.py's export is bitwise the import (sharded, with the
multi-token-prediction layers of published files dropped with one note) and loads in transformers; FP8
block-scaled weights are dequantized on import; what has no equivalent is one clear error."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatronish.convert as conv
from megatronish.convert import ConvertError, hf_config_from_model, model_config_from_hf
from megatronish.convert.hf_deepseek import dequantize_fp8
from megatronish.convert.hf_io import HFReader
from megatronish.convert.name_map import FUSED, PER_EXPERT, expected_global_shapes
from megatronish.convert.tiny import tiny_hf_model
from megatronish.model import GPTModel
from megatronish.testing import assert_parity
from megatronish.tools import convert_checkpoint

DS, V = "DeepseekV3ForCausalLM", 100
VARIANTS = {  # tiny_hf_model's DeepSeek-V3: q latent, YaRN, 1 dense layer, 8 experts top-4 of 2 of 4 groups, shared
    "q_lora_yarn_groups": {},
    "full_q_rope_top2_tied": dict(q_lora_rank=None, first_k_dense_replace=2, n_group=1, topk_group=1,
                                  num_experts_per_tok=2, n_shared_experts=1, tied=True,
                                  rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "dense_no_shared": dict(first_k_dense_replace=4),  # every layer dense: no experts at all
}
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "rotary_base",
          "norm_epsilon", "untie_embeddings_and_output_weights", "multi_latent_attention", "q_lora_rank",
          "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "rope_type",
          "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
          "yarn_beta_fast", "yarn_beta_slow", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
          "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
          "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size")


@pytest.fixture(scope="module")
def models():
    return {name: tiny_hf_model(DS, vocab=V, **over) for name, over in VARIANTS.items()}


def test_config_mapping(models):
    expect = {  # q latent, RoPE, MoE pattern, groups, top-k, shared expert size, tied
        "q_lora_yarn_groups": (24, "yarn", [0, 1, 1, 1], (4, 2), 4, 32, False),
        "full_q_rope_top2_tied": (None, "rope", [0, 0, 1, 1], (None, None), 2, 16, True),
        "dense_no_shared": (24, "yarn", 1, (None, None), 2, None, False),
    }
    for name, hf in models.items():
        cfg, arch = model_config_from_hf(hf.config.to_dict())
        a, m = cfg.attention, cfg.moe
        got = (a.q_lora_rank, a.rope_type, m.moe_layer_freq, (m.moe_router_num_groups, m.moe_router_group_topk),
               m.moe_router_topk, m.moe_shared_expert_intermediate_size, not cfg.untie_embeddings_and_output_weights)
        assert arch == DS and got == expect[name], (name, got)
        assert (a.multi_latent_attention, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim) == \
            (True, 20, 12, 8, 10)
        if name == "q_lora_yarn_groups":
            assert (a.rotary_scaling_factor, a.yarn_original_max_position_embeddings, a.mscale, a.mscale_all_dim) \
                == (4.0, 8, 1.0, 0.8)
            assert (m.num_experts, m.moe_router_score_function, m.moe_router_enable_expert_bias,
                    m.moe_router_topk_scaling_factor, m.moe_ffn_hidden_size) == (8, "sigmoid", True, 2.5, 16)
        if name == "dense_no_shared":
            assert m.num_experts is None
        model = GPTModel(cfg, device="meta")  # the name map is our model's parameter list
        assert expected_global_shapes(cfg) == {n: tuple(p.desc.global_shape)
                                               for n, p in model.named_global_parameters()}, name
        back, arch2 = model_config_from_hf(hf_config_from_model(cfg, base=hf.config.to_dict()))
        assert arch2 == DS
        assert {f: back.flat()[f] for f in FIELDS} == {f: cfg.flat()[f] for f in FIELDS}, name
        fresh = hf_config_from_model(cfg)  # with no source config.json, too
        assert {f: model_config_from_hf(fresh)[0].flat()[f] for f in FIELDS} == {f: cfg.flat()[f] for f in FIELDS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_loss_and_both_layouts_bitwise(name, models, tmp_path):
    hf = models[name]
    cfg, arch = model_config_from_hf(hf.config.to_dict())
    fused = hf.state_dict()
    ours = conv.hf_state_dict_to_ours(fused, cfg, arch)
    model = GPTModel(cfg).eval()
    conv.load_into_model(model, ours)
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids[:, :-1]).logits
        ref_loss = hf(input_ids=ids, labels=ids).loss
        logits = model(ids[:, :-1])[..., :V]
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    assert_parity(logits, ref, f"{name} logits", rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    tied_copy = {"lm_head.weight"} if not cfg.untie_embeddings_and_output_weights else set()
    back = conv.ours_to_hf_state_dict(ours, cfg, arch, experts=FUSED)  # transformers 5's in-memory layout
    assert back.keys() == fused.keys() - tied_copy
    assert all(torch.equal(back[k], fused[k]) for k in back), name
    hf.save_pretrained(str(tmp_path))  # per-expert files, as published checkpoints
    files = load_file(str(tmp_path / "model.safetensors"))
    ours2 = conv.hf_state_dict_to_ours(files, cfg, arch)
    assert ours2.keys() == ours.keys() and all(torch.equal(ours2[k], ours[k]) for k in ours)
    back = conv.ours_to_hf_state_dict(ours2, cfg, arch, experts=PER_EXPERT)
    assert back.keys() == files.keys() - tied_copy and all(torch.equal(back[k], files[k]) for k in back)


def _main(*argv):
    convert_checkpoint.main(["--model-type", "GPT", *argv])


def test_cli_round_trip_drops_mtp_and_loads_in_transformers(models, tmp_path, capsys):
    """Sharded files with one multi-token-prediction layer (``model.layers.4.*``, as published files carry):
    hf -> ours (TP 2 x PP 2) -> hf is bitwise the model's tensors, the MTP layer dropped with one note."""
    from transformers import AutoModelForCausalLM

    hf = models["q_lora_yarn_groups"]
    src, ours, back = (str(tmp_path / x) for x in ("hf", "ours", "back"))
    hf.save_pretrained(src, max_shard_size="100KB")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    mtp = {f"model.layers.4.{n}": torch.ones(64) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    save_file(mtp, os.path.join(src, "mtp.safetensors"))
    index["weight_map"].update({n: "mtp.safetensors" for n in mtp})
    json.dump(index, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    capsys.readouterr()
    _main("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", ours,
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert notes == ["note: 3 tensors of the multi-token-prediction layers (model.layers.4...) are not converted"]
    _main("--loader", "megatronish", "--saver", "hf", "--load-dir", ours, "--save-dir", back, "--max-shard-size",
          "100KB")
    a, b = HFReader(src), HFReader(back)
    assert sorted(b.names()) == sorted(set(a.names()) - set(mtp))
    for n in b.names():
        assert torch.equal(a.get(n), b.get(n)), n
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["architectures"] == [DS] and config["num_nextn_predict_layers"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


# ---- FP8 block-scaled weights ----------------------------------------------------------------------------------

def _quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout: e4m3 values and one inverse scale per ``block`` x ``block`` tile (max |w| -> 448)."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.size(0)):
        for j in range(scale.size(1)):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_dequantize_fp8_blocks():
    """300 x 260 in 128 x 128 blocks (ragged edges): each tile times its own scale, to within FP8's precision."""
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3.0, 260)
    q, scale = _quantize(w, 128)
    assert scale.shape == (3, 3)
    out = dequantize_fp8(q, scale, dtype=torch.float32)
    expected = q.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, w, rtol=0.07, atol=5e-5)  # e4m3: 3 mantissa bits (subnormals: atol)
    assert dequantize_fp8(q, scale).dtype == torch.bfloat16
    with pytest.raises(ConvertError, match=r"needs a \[3, 3\] block scale"):
        dequantize_fp8(q, scale[:2])


def test_fp8_checkpoint_is_dequantized_on_import(models, tmp_path):
    """A published-style FP8 file (every 2-D linear e4m3 with ``weight_scale_inv``, 16 x 16 blocks from
    ``quantization_config``) converts to bfloat16 tensors equal to the dequantized values."""
    hf = models["q_lora_yarn_groups"]
    src, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    hf.save_pretrained(src)
    files = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for n, t in files.items():
        if t.dim() == 2 and ("proj" in n or "experts" in n):
            q, s = _quantize(t, 16)
            quantized[n], quantized[n + "_scale_inv"] = q, s
            dequantized[n] = dequantize_fp8(q, s, (16, 16))
        else:
            quantized[n] = t
    save_file(quantized, os.path.join(src, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    _main("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", ours)
    _main("--loader", "megatronish", "--saver", "hf", "--load-dir", ours, "--save-dir", str(tmp_path / "back"))
    back = HFReader(str(tmp_path / "back"))
    assert sorted(back.names()) == sorted(files)
    for n, t in dequantized.items():
        assert back.dtype(n) == torch.bfloat16 and torch.equal(back.get(n), t), n
    kv = "model.layers.1.self_attn.kv_b_proj.weight"
    torch.testing.assert_close(back.get(kv).float(), files[kv], rtol=0.08, atol=1e-3)
    assert back.get("model.norm.weight").dtype == torch.float32  # unquantized tensors keep their dtype
    assert "quantization_config" not in json.load(open(os.path.join(str(tmp_path / "back"), "config.json")))


# ---- what has no equivalent: one clear error each -----------------------------------------------------------

def test_config_errors(models):
    hf = models["q_lora_yarn_groups"].config.to_dict()
    for change, match in [(dict(rope_interleave=False), "rope_interleave=false"),
                          (dict(attention_bias=True), "attention_bias=true"),
                          (dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok 4"),
                          (dict(topk_group=1), "topk_group 1"),
                          (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
                          (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=2.0)), "'llama3'")]:
        with pytest.raises(ConvertError, match=match):
            model_config_from_hf({**hf, **change})
    cfg, _ = model_config_from_hf(hf)
    for change, match in [(dict(moe_router_enable_expert_bias=False), "--moe-router-enable-expert-bias"),
                          (dict(moe_layer_freq=[1, 0, 1, 1]), "dense layers first"),
                          (dict(moe_shared_expert_gate=True), "ungated shared expert"),
                          (dict(moe_shared_expert_intermediate_size=40), "multiple of --moe-ffn-hidden-size"),
                          (dict(qk_layernorm=False), "--qk-layernorm")]:
        with pytest.raises(ConvertError, match=match):
            hf_config_from_model(cfg.replace(**change))
