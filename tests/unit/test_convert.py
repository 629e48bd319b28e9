"""Hugging Face conversion in one process: the name map matches our model's parameters, config.json maps to
our config and back, a converted tiny GPT-2 / Llama (GQA) / Mistral / Qwen2 (q/k/v biases) / Qwen3 (q/k norm,
head_dim) gives transformers' logits and loss, the state dict round trip is bitwise, and each mismatch is one
clear error from the converter (tools/checkpoint/convert.py)."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from megatronish.config import gpt2, llama
from megatronish.convert import (
    ConvertError,
    architecture_of,
    hf_config_from_model,
    hf_state_dict_to_ours,
    load_into_model,
    model_config_from_hf,
    ours_to_hf_state_dict,
)
from megatronish.convert.name_map import expected_global_shapes
from megatronish.convert.tiny import tiny_hf_model
from megatronish.model import GPTModel
from megatronish.testing import assert_parity
from megatronish.tools import convert_checkpoint

GPT2, LLAMA, MISTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM"
QWEN2, QWEN3 = "Qwen2ForCausalLM", "Qwen3ForCausalLM"
V = 100


@pytest.mark.parametrize("cfg", [
    gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V),
    gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, untie_embeddings_and_output_weights=True),
    llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, vocab_size=V),
    llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=V,
          add_bias_linear=True, untie_embeddings_and_output_weights=False),
    llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=V, add_qkv_bias=True,
          untie_embeddings_and_output_weights=False),
    llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=V,
          qk_layernorm=True),
], ids=["gpt2", "gpt2_untied", "llama_gqa", "llama_bias_tied_headdim", "qwen2_tied", "qwen3_headdim"])
def test_name_map_matches_model(cfg):
    model = GPTModel(cfg, device="meta")
    ours = {n: tuple(p.desc.global_shape) for n, p in model.named_global_parameters()}
    assert expected_global_shapes(cfg) == ours
    hf = hf_config_from_model(cfg)
    assert hf["architectures"] == [GPT2 if cfg.normalization == "LayerNorm" else
                                   QWEN3 if cfg.attention.qk_layernorm else
                                   QWEN2 if cfg.attention.add_qkv_bias else LLAMA]
    back, arch = model_config_from_hf(hf)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
              "vocab_size", "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization",
              "norm_epsilon", "swiglu", "openai_gelu", "untie_embeddings_and_output_weights", "add_bias_linear",
              "add_qkv_bias", "qk_layernorm")
    assert {f: back.flat()[f] for f in fields} == {f: cfg.flat()[f] for f in fields}, arch


@pytest.mark.parametrize("arch,over", [
    (GPT2, {}), (GPT2, {"activation_function": "gelu"}), (LLAMA, {}),
    (LLAMA, {"tie_word_embeddings": True, "rope_theta": 500000.0}), (MISTRAL, {}),
    (MISTRAL, {"sliding_window": 32}),  # a window covering max_position_embeddings (32) is full attention
    (QWEN2, {}), (QWEN2, {"tie_word_embeddings": True}), (QWEN3, {}), (QWEN3, {"tie_word_embeddings": True}),
], ids=["gpt2_gelu_new", "gpt2_gelu", "llama_gqa", "llama_tied_theta", "mistral", "mistral_window_covers_seq",
        "qwen2_qkv_bias", "qwen2_tied", "qwen3_qk_norm_head_dim", "qwen3_tied"])
def test_logits_and_round_trip(arch, over):
    hf = tiny_hf_model(arch, vocab=V, **over)
    cfg, a = model_config_from_hf(hf.config.to_dict())
    assert a == arch and architecture_of(cfg, base=hf.config.to_dict()) == arch
    assert (cfg.attention.add_qkv_bias, cfg.attention.qk_layernorm) == (arch == QWEN2, arch == QWEN3)
    assert cfg.kv_channels == (16 if arch == QWEN3 else 8)
    assert cfg.openai_gelu == (arch == GPT2 and over.get("activation_function", "gelu_new") == "gelu_new")
    sd = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    ours = hf_state_dict_to_ours(sd, cfg, a)
    assert ours["embedding.word_embeddings.weight"].shape[0] == 128  # padded; padding rows zero
    assert not ours["embedding.word_embeddings.weight"][V:].any()
    model = GPTModel(cfg).eval()
    load_into_model(model, ours)
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        logits = model(ids)[..., :V]
        loss = model(ids, labels=labels).mean()
    assert_parity(logits, ref, f"{arch} logits", rtol=1e-5)  # logits near zero: to 1e-5 of the largest
    torch.testing.assert_close(loss, F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1)), rtol=1e-5, atol=0)
    back = ours_to_hf_state_dict(ours, cfg, a)
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k


# ---- errors: one clear line each ----------------------------------------------------------------------------

def _save(model, d):
    model.save_pretrained(d)
    return d


def _convert_error(capsys, *argv):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        convert_checkpoint.main(["--model-type", "GPT", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_errors(tmp_path, capsys):
    src = _save(tiny_hf_model(LLAMA, vocab=V), str(tmp_path / "hf"))
    to_ours = ["--loader", "hf", "--saver", "megatronish"]
    # unknown architecture
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    save_file({"x": torch.zeros(1)}, str(bert / "model.safetensors"))
    msg = _convert_error(capsys, *to_ours, "--load-dir", str(bert), "--save-dir", str(tmp_path / "o1"))
    assert "unknown architecture" in msg and "BertForMaskedLM" in msg
    # missing tensor
    sd = load_file(os.path.join(src, "model.safetensors"))
    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    save_file({k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(broken / "model.safetensors"))
    msg = _convert_error(capsys, *to_ours, "--load-dir", str(broken), "--save-dir", str(tmp_path / "o2"))
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in msg and "linear_fc1" in msg
    # shape mismatch
    save_file({**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 64)}, str(broken / "model.safetensors"))
    msg = _convert_error(capsys, *to_ours, "--load-dir", str(broken), "--save-dir", str(tmp_path / "o3"))
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[8, 64]" in msg and "[32, 64]" in msg
    # vocabulary larger than the (padded) vocabulary, both directions
    msg = _convert_error(capsys, *to_ours, "--load-dir", src, "--save-dir", str(tmp_path / "o4"),
                         "--true-vocab-size", "101")
    assert "--true-vocab-size 101" in msg and "100" in msg
    ours = str(tmp_path / "ours")
    convert_checkpoint.main(["--model-type", "GPT", *to_ours, "--load-dir", src, "--save-dir", ours])
    capsys.readouterr()
    msg = _convert_error(capsys, "--loader", "megatronish", "--saver", "hf", "--load-dir", ours,
                         "--save-dir", str(tmp_path / "o5"), "--true-vocab-size", "129")
    assert "--true-vocab-size 129" in msg and "padded vocabulary" in msg and "128" in msg
    # a target layout the model does not split into
    msg = _convert_error(capsys, *to_ours, "--load-dir", src, "--save-dir", str(tmp_path / "o6"),
                         "--target-tensor-parallel-size", "8")
    assert "--target-tensor-parallel-size 8" in msg


def test_sliding_window_is_one_line(tmp_path, capsys):
    """Mistral-7B-v0.1's shape: a window (16) shorter than the sequence (max_position_embeddings 32)."""
    src = _save(tiny_hf_model(MISTRAL, vocab=V, sliding_window=16), str(tmp_path / "hf"))
    msg = _convert_error(capsys, "--loader", "hf", "--saver", "megatronish", "--load-dir", src,
                         "--save-dir", str(tmp_path / "o"))
    assert "sliding_window 16 is shorter than the sequence length 32" in msg, msg
    assert '"sliding_window": null' in msg and "max_position_embeddings <= 16" in msg, msg
    qwen2 = tiny_hf_model(QWEN2, vocab=V).config.to_dict()
    with pytest.raises(ConvertError, match="use_sliding_window=true with sliding_window 16 is shorter"):
        model_config_from_hf({**qwen2, "use_sliding_window": True, "sliding_window": 16})
    model_config_from_hf({**qwen2, "use_sliding_window": False, "sliding_window": 16})  # switched off: converts


def test_config_errors():
    base = tiny_hf_model(LLAMA, vocab=V).config.to_dict()
    with pytest.raises(ConvertError, match="hidden_act 'gelu'"):
        model_config_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ConvertError, match="attention_bias=True with mlp_bias=False"):
        model_config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ConvertError, match="RoPE scaling 'linear'"):
        model_config_from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ConvertError, match="attention_bias=true is not supported for Qwen3ForCausalLM"):
        model_config_from_hf({**tiny_hf_model(QWEN3, vocab=V).config.to_dict(), "attention_bias": True})
    qwen3 = llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, qk_layernorm=True)
    with pytest.raises(ConvertError, match="no dense Hugging Face equivalent"):
        hf_config_from_model(qwen3.replace(add_qkv_bias=True))
    cfg = llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V).replace(
        position_embedding_type="learned_absolute")
    with pytest.raises(ConvertError, match="unknown architecture"):
        hf_config_from_model(cfg)
