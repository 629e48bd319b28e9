"""Hugging Face mixture-of-experts conversion in one process (Mixtral, Qwen2-MoE, Qwen3-MoE built by the installed
transformers): the name map equals our model's parameters, config.json maps to our config and back, the converted
model gives transformers' logits and loss (fp32; the routing semantics — Mixtral's renormalised top-k, Qwen's
``norm_topk_prob`` both ways, Qwen2's gated shared expert, Qwen3's q/k norm, dense layers among MoE ones), both
expert layouts (transformers 5's fused in-memory tensors, the per-expert files ``save_pretrained`` writes) round
trip bitwise, the CLI's export loads in transformers, generation with our KV cache matches transformers', and
what has no equivalent is one clear error."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatronish.convert import (
    ConvertError,
    hf_config_from_model,
    hf_state_dict_to_ours,
    load_into_model,
    model_config_from_hf,
    ours_to_hf_state_dict,
)
from megatronish.convert.hf_io import HFReader
from megatronish.convert.name_map import FUSED, PER_EXPERT, expected_global_shapes
from megatronish.convert.tiny import tiny_hf_model
from megatronish.inference import Generator, SamplingParams
from megatronish.model import GPTModel
from megatronish.testing import assert_parity
from megatronish.tools import convert_checkpoint

MIXTRAL, QWEN2, QWEN3 = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
V = 100
VARIANTS = {
    "mixtral": (MIXTRAL, {}),
    "qwen3_norm_topk_dense_layer": (QWEN3, {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_no_norm_topk_sparse_step2": (QWEN3, {"norm_topk_prob": False, "decoder_sparse_step": 2}),
    "qwen2_shared": (QWEN2, {"norm_topk_prob": False}),
    "qwen2_norm_topk_no_qkv_bias": (QWEN2, {"norm_topk_prob": True, "qkv_bias": False}),
}
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "vocab_size", "rotary_base", "norm_epsilon", "untie_embeddings_and_output_weights", "add_bias_linear",
          "add_qkv_bias", "qk_layernorm", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
          "moe_router_pre_softmax", "moe_aux_loss_coeff", "moe_shared_expert_intermediate_size",
          "moe_shared_expert_gate")


@pytest.fixture(scope="module")
def models():
    return {name: tiny_hf_model(arch, vocab=V, **over) for name, (arch, over) in VARIANTS.items()}


def test_config_mapping(models):
    expect = {  # (arch, pre-softmax, MoE layer pattern, qk norm, q/k/v bias, shared expert)
        "mixtral": (MIXTRAL, False, 1, False, False, None),
        "qwen3_norm_topk_dense_layer": (QWEN3, False, [1, 0, 1, 1], True, False, None),
        "qwen3_no_norm_topk_sparse_step2": (QWEN3, True, [0, 1, 0, 1], True, False, None),
        "qwen2_shared": (QWEN2, True, 1, False, True, 40),
        "qwen2_norm_topk_no_qkv_bias": (QWEN2, False, 1, False, False, 40),
    }
    for name, hf in models.items():
        cfg, arch = model_config_from_hf(hf.config.to_dict())
        got = (arch, cfg.moe.moe_router_pre_softmax, cfg.moe.moe_layer_freq, cfg.attention.qk_layernorm,
               cfg.attention.add_qkv_bias, cfg.moe.moe_shared_expert_intermediate_size)
        assert got == expect[name], name
        assert cfg.moe.num_experts == 4 and cfg.moe.moe_router_topk == 2 and not cfg.add_bias_linear
        assert cfg.moe.moe_aux_loss_coeff == hf.config.router_aux_loss_coef
        assert cfg.moe.moe_ffn_hidden_size == (48 if arch == MIXTRAL else 32)
        # the name map is our model's parameter list
        model = GPTModel(cfg, device="meta")
        assert expected_global_shapes(cfg) == {n: tuple(p.desc.global_shape)
                                               for n, p in model.named_global_parameters()}, name
        # config.json -> ours -> config.json -> ours is the identity on every mapped field
        back, arch2 = model_config_from_hf(hf_config_from_model(cfg, base=hf.config.to_dict()))
        assert arch2 == arch
        assert {f: back.flat()[f] for f in FIELDS} == {f: cfg.flat()[f] for f in FIELDS}, name


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_and_both_layouts_bitwise(name, models, tmp_path):
    hf = models[name]
    cfg, arch = model_config_from_hf(hf.config.to_dict())
    fused = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in fused)  # transformers 5's in-memory layout
    ours = hf_state_dict_to_ours(fused, cfg, arch)
    model = GPTModel(cfg).eval()
    load_into_model(model, ours)
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(input_ids=ids[:, :-1])
        ref_loss = hf(input_ids=ids, labels=ids).loss  # transformers' loss (it shifts the labels)
        logits = model(ids[:, :-1])[..., :V]
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    assert_parity(logits, out.logits, f"{name} logits", rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    # fused in-memory tensors: HF -> ours -> HF bitwise
    back = ours_to_hf_state_dict(ours, cfg, arch, experts=FUSED)
    assert back.keys() == fused.keys()
    for k in fused:
        assert torch.equal(back[k], fused[k]), (name, k)
    # per-expert files (what save_pretrained writes, and published checkpoints): bitwise, and the same tensors of ours
    hf.save_pretrained(str(tmp_path))
    files = load_file(str(tmp_path / "model.safetensors"))
    expert_names = [k for k in files if ".experts." in k]
    assert expert_names and all(".experts.gate_up_proj" not in k for k in expert_names)
    if arch == MIXTRAL:
        assert all(".block_sparse_moe." in k for k in expert_names)
    ours2 = hf_state_dict_to_ours(files, cfg, arch)
    assert ours2.keys() == ours.keys() and all(torch.equal(ours2[k], ours[k]) for k in ours)
    back = ours_to_hf_state_dict(ours2, cfg, arch, experts=PER_EXPERT)
    assert back.keys() == files.keys()
    for k in files:
        assert torch.equal(back[k], files[k]), (name, k)


def _main(*argv):
    convert_checkpoint.main(["--model-type", "GPT", *argv])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_norm_topk_dense_layer", "qwen2_shared"])
def test_cli_round_trip_loads_in_transformers(name, models, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = models[name]
    src, ours, back = (str(tmp_path / x) for x in ("hf", "ours", "back"))
    hf.save_pretrained(src)
    _main("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", ours,
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    _main("--loader", "megatronish", "--saver", "hf", "--load-dir", ours, "--save-dir", back)
    a, b = HFReader(src), HFReader(back)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), n
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["architectures"] == [type(hf).__name__]
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_generation_with_kv_cache_matches_transformers(models):
    """Qwen3-MoE (q/k norm before RoPE, a dense layer): greedy continuations with and without our KV cache equal
    transformers' (with its cache)."""
    hf = models["qwen3_norm_topk_dense_layer"]
    cfg, arch = model_config_from_hf(hf.config.to_dict())
    model = GPTModel(cfg).eval()
    load_into_model(model, hf_state_dict_to_ours(hf.state_dict(), cfg, arch))
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [42]]
    hf.generation_config.eos_token_id = None
    ref = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            ref.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                   pad_token_id=0)[0].tolist())
    gen = Generator(model, max_batch=4)
    for use_cache in (True, False):
        assert gen.generate(prompts, 8, SamplingParams(top_k=1), use_cache=use_cache).tokens == ref, use_cache


# ---- what has no equivalent: one clear error each -----------------------------------------------------------

def test_config_errors(models):
    mixtral = models["mixtral"].config.to_dict()
    qwen3 = models["qwen3_norm_topk_dense_layer"].config.to_dict()
    for hf, match in [({**mixtral, "sliding_window": 16}, "sliding_window 16 is shorter than the sequence length 32"),
                      ({**mixtral, "router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
                      ({**qwen3, "attention_bias": True}, "attention_bias=true"),
                      ({**qwen3, "use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
                      ({**qwen3, "mlp_only_layers": [0, 1, 2, 3]}, "no layer is a mixture of experts")]:
        with pytest.raises(ConvertError, match=match):
            model_config_from_hf(hf)
    cfg, _ = model_config_from_hf(mixtral)
    for change, match in [(dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax has no Mixtral"),
                          (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
                          (dict(moe_router_score_function="sigmoid"), "softmax"),
                          (dict(moe_layer_freq=2), "every layer"),
                          (dict(num_experts=None, qk_layernorm=True, add_qkv_bias=True),
                           "no dense Hugging Face equivalent")]:
        with pytest.raises(ConvertError, match=match):
            hf_config_from_model(cfg.replace(**change))


def test_missing_expert_tensor_is_one_line(models, tmp_path, capsys):
    src = tmp_path / "hf"
    models["mixtral"].save_pretrained(str(src))
    sd = load_file(str(src / "model.safetensors"))
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in sd.items() if k != gone}, str(src / "model.safetensors"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _main("--loader", "hf", "--saver", "megatronish", "--load-dir", str(src), "--save-dir", str(tmp_path / "o"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert f"missing tensor {gone!r}" in err[0] and "decoder.layers.1.mlp.experts.linear_fc1.weight" in err[0]
