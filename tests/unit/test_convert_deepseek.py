"""transformers' DeepseekV3ForCausalLM conversion in one process: config.json maps to our config (multi-latent
attention with and without the query latent, YaRN and plain RoPE, first-k-dense, sigmoid routing with the expert
bias, group-limited top-k, the routed scaling factor, shared experts, tied embeddings) and back; the name map is our
model's parameter list; the converted model gives transformers' logits and loss (fp32, rtol 1e-5); both expert
layouts round trip bitwise; tools/checkpoint/convert.py's export is bitwise the import (sharded, with the
multi-token-prediction layer of published files) and loads in transformers; FP8
block-scaled weights are dequantized on import, and block by block for ``--load`` (reading only the scale blocks a
slice needs); published multi-token-prediction layers convert both ways bitwise and predict as DeepSeek-V3 defines
them; what has no equivalent is one clear error."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatronish.convert as conv
from megatronish.convert import ConvertError, hf_config_from_model, model_config_from_hf
from megatronish.convert.hf_deepseek import dequantize_fp8, fp8_block_reader
from megatronish.convert.hf_io import HFReader
from megatronish.convert.name_map import FUSED, PER_EXPERT, expected_global_shapes
from megatronish.convert.tiny import add_mtp_layers, tiny_hf_model
from megatronish.model import GPTModel
from megatronish.testing import assert_parity
from megatronish.tools import convert_checkpoint
from support.hf_training import quantize_fp8

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


def test_cli_round_trip_keeps_mtp_and_loads_in_transformers(models, tmp_path, capsys):
    """Sharded files with one multi-token-prediction layer (``model.layers.4.*``, as published files carry it):
    hf -> ours (TP 2 x PP 2, one MTP depth) -> hf is bitwise every tensor, the MTP layer and its copies of the
    embedding and output layer included; transformers loads the result. A copy that differs is one error."""
    from transformers import AutoModelForCausalLM

    hf = models["q_lora_yarn_groups"]
    src, ours, back = (str(tmp_path / x) for x in ("hf", "ours", "back"))
    hf.save_pretrained(src, max_shard_size="100KB")
    mtp = add_mtp_layers(src)
    _main("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", ours,
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    _main("--loader", "megatronish", "--saver", "hf", "--load-dir", ours, "--save-dir", back, "--max-shard-size",
          "100KB")
    a, b = HFReader(src), HFReader(back)
    assert sorted(b.names()) == sorted(a.names()) and set(mtp) < set(b.names())
    for n in b.names():
        assert torch.equal(a.get(n), b.get(n)), n
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["architectures"] == [DS] and config["num_nextn_predict_layers"] == 1
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)
    save_file({"model.layers.4.embed_tokens.weight": mtp["model.layers.4.embed_tokens.weight"] + 1},
              os.path.join(src, "mtp.safetensors"))
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "mtp.safetensors"}
    index["weight_map"]["model.layers.4.embed_tokens.weight"] = "mtp.safetensors"
    json.dump(index, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _main("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", str(tmp_path / "x"))
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --load-dir {src}: model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight; the "
        "multi-token-prediction layers share the model's embedding and output layer here, so the copy must equal it")


def test_mtp_layer_predicts_as_deepseek_defines_it(models, tmp_path):
    """The converted MTP depth's per-token losses equal DeepSeek-V3's definition written with transformers' own
    pieces and the published names: ``h' = eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)]`` (``h``: the main
    model's final hidden state), then ``model.layers.4`` as a transformers decoder layer, ``shared_head.norm``
    and ``lm_head``, predicting ``t_{i+2}`` (fp32, rtol 1e-5)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf = models["q_lora_yarn_groups"]
    hf.save_pretrained(str(tmp_path))
    add_mtp_layers(str(tmp_path))
    r = HFReader(str(tmp_path))
    files = {n: r.get(n) for n in r.names()}
    cfg, arch = model_config_from_hf(r.config)
    cfg = cfg.replace(mtp_num_layers=1)
    model = GPTModel(cfg).eval()
    conv.load_into_model(model, conv.hf_state_dict_to_ours(files, cfg, arch))
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(4))
    p, E = "model.layers.4.", hf.config.n_routed_experts
    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=4).eval()
    state = {k[len(p):]: v for k, v in files.items() if k.startswith(p) and ".experts." not in k}
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([files[f"{p}mlp.experts.{e}.{x}_proj.weight"]
                                                                for x in ("gate", "up")]) for e in range(E)])
    state["mlp.experts.down_proj"] = torch.stack([files[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    layer.load_state_dict(state, strict=False)  # the MTP-only tensors (enorm, ...) are applied below

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * files[f"{p}{name}.weight"]

    with torch.no_grad():
        ours = model(ids[:, :-1], labels=ids[:, 1:])[1, :, :-1]  # depth 1 at i predicts t_{i+2}
        h = hf.model(input_ids=ids[:, :-1]).last_hidden_state[:, :-1]  # [b, s - 1, h]
        x = torch.cat((rms(hf.model.embed_tokens(ids[:, 1:-1]), "enorm"), rms(h, "hnorm")), -1)
        x = x @ files[f"{p}eh_proj.weight"].t()
        positions = torch.arange(x.size(1)).unsqueeze(0)
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, positions), position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        logits = rms(x, "shared_head.norm") @ files[f"{p}shared_head.head.weight"].t()
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 2:].reshape(-1), reduction="none")
    torch.testing.assert_close(ours, ref.view_as(ours), rtol=1e-5, atol=0)


# ---- FP8 block-scaled weights ----------------------------------------------------------------------------------

def test_dequantize_fp8_blocks():
    """300 x 260 in 128 x 128 blocks (ragged edges): each tile times its own scale, to within FP8's precision."""
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3.0, 260)
    q, scale = quantize_fp8(w, 128)
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
            q, s = quantize_fp8(t, 16)
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


def test_fp8_block_reader_reads_only_the_covering_scale_blocks():
    """A block of rows and columns starting inside a scale block (as a tensor-parallel slice of 24 x 24 blocks
    does) is bitwise the full dequantization's block, and reads its FP8 bytes plus only the scale blocks it
    touches."""
    w = torch.randn(100, 90, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_fp8(w, 24)
    full = dequantize_fp8(q, scale, (24, 24))
    tensors, reads = {"w": q, "w_scale_inv": scale}, []

    def read(name, index):
        reads.append((name, index))
        return tensors[name][index]

    reader = fp8_block_reader(read, lambda n: tuple(tensors[n].shape), tensors,
                              {"quantization_config": {"weight_block_size": [24, 24]}})
    for rows, cols in [(slice(30, 70), slice(0, 90)), (slice(50, 100), slice(45, 90)), (slice(0, 24), None)]:
        reads.clear()
        index = (rows,) if cols is None else (rows, cols)
        got = reader("w", index)
        assert got.dtype == torch.bfloat16 and torch.equal(got, full[index]), index
        r0, r1 = rows.start // 24, -(-rows.stop // 24)
        c0, c1 = (0, 4) if cols is None else (cols.start // 24, -(-cols.stop // 24))
        assert reads == [("w", index), ("w_scale_inv", (slice(r0, r1), slice(c0, c1)))]


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
