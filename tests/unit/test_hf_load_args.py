"""``--load <Hugging Face directory>`` without processes: the flags its config.json gives (a contradicting flag is
one line naming both; the tokenizer from the directory's files), and the row runs of convert/hf_rows.py equal the
name map's tensors block for block (fused QKV with GQA, [gate; up], stacked experts, padded vocabulary, GPT-2's
transposed Conv1D, DeepSeek-V3's multi-latent attention and MoE); a DeepSeek-V3 config.json gives the MLA, YaRN
and MoE flags, and ``--mtp-num-layers`` asks for at most the layers it has."""
import json

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.convert.hf_config import model_config_from_hf
from megatronish.convert.hf_rows import read_block, row_map
from megatronish.convert.name_map import build_entries
from megatronish.errors import ConfigError

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": 32,
           "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 32}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 300, "n_embd": 32, "n_layer": 1,
        "n_head": 4, "n_positions": 32}


def _hf_dir(tmp_path, config, tokenizer=False):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # only its presence is read here
    if tokenizer:
        (tmp_path / "tokenizer_config.json").write_text("{}")
    return str(tmp_path)


def _cfg(argv):
    return configs_from_args(parse_args(argv + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                                                "--mock-data"]), 1)


def test_flags_from_config_json(tmp_path):
    cfg = _cfg(["--load", _hf_dir(tmp_path, QWEN3), "--seq-length", "16"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.kv_channels, m.vocab_size) == (2, 64, 2, 16, 300)
    assert m.swiglu and m.attention.qk_layernorm and m.untie_embeddings_and_output_weights and m.seq_length == 16
    assert cfg.checkpoint.load_hf and cfg.data.tokenizer_type == "NullTokenizer"


def test_contradicting_flag_is_one_line_naming_both(tmp_path):
    path = _hf_dir(tmp_path, QWEN3)
    with pytest.raises(ConfigError) as e:
        _cfg(["--load", path, "--num-layers", "3", "--hidden-size", "32"])
    lines = str(e.value).splitlines()
    assert lines == [f"--num-layers 3 contradicts --load {path}/config.json, which gives num_layers 2; drop "
                     "--num-layers (the model's architecture is its config's)",
                     f"--hidden-size 32 contradicts --load {path}/config.json, which gives hidden_size 64; drop "
                     "--hidden-size (the model's architecture is its config's)"]
    _cfg(["--load", path, "--num-layers", "2", "--swiglu"])  # agreeing flags are fine


def test_tokenizer_from_the_directory(tmp_path):
    from support.tokenizer_files import make_hf_tokenizer_json

    path = _hf_dir(tmp_path, dict(QWEN3, vocab_size=512), tokenizer=True)
    make_hf_tokenizer_json(path)
    cfg = _cfg(["--load", path])
    assert (cfg.data.tokenizer_type, cfg.data.tokenizer_model) == ("HuggingFaceTokenizer", path)
    assert cfg.model.vocab_size == 512 > cfg.data.tokenizer.vocab_size  # the model keeps its rows
    with pytest.raises(ConfigError, match="the tokenizer has 601 tokens, more than the vocabulary"):
        _cfg(["--load", path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "600"])


DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 300,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
            "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "routed_scaling_factor": 2.5, "moe_intermediate_size": 16, "n_shared_experts": 2,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 32,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}, "rope_theta": 10000}


def test_deepseek_flags_from_config_json(tmp_path):
    """Multi-latent attention, YaRN, the MoE layer pattern, grouped sigmoid routing with the expert bias and
    shared experts come from config.json; MTP stays off unless --mtp-num-layers asks for the file's layers."""
    path = _hf_dir(tmp_path, DEEPSEEK)
    m = _cfg(["--load", path]).model
    a, moe = m.attention, m.moe
    assert (a.multi_latent_attention, a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
            a.v_head_dim, a.qk_layernorm) == (True, 24, 20, 12, 8, 10, True)
    assert (a.rope_type, a.rotary_scaling_factor, a.yarn_original_max_position_embeddings, a.mscale,
            a.mscale_all_dim, a.yarn_correction_range_round_to_int) == ("yarn", 4.0, 8, 1.0, 0.8, True)
    assert (moe.num_experts, moe.moe_layer_freq, moe.moe_router_topk, moe.moe_router_num_groups,
            moe.moe_router_group_topk, moe.moe_router_score_function, moe.moe_router_enable_expert_bias,
            moe.moe_router_topk_scaling_factor, moe.moe_ffn_hidden_size, moe.moe_shared_expert_intermediate_size) \
        == (8, [0, 1, 1], 4, 4, 2, "sigmoid", True, 2.5, 16, 32)
    assert not m.mtp_num_layers and _cfg(["--load", path, "--mtp-num-layers", "1"]).model.mtp_num_layers == 1
    with pytest.raises(ConfigError) as e:
        _cfg(["--load", path, "--mtp-num-layers", "2"])
    assert str(e.value) == (f"--mtp-num-layers 2: --load {path}/config.json has num_nextn_predict_layers 1; give at "
                            "most 1 or drop --mtp-num-layers")
    with pytest.raises(ConfigError, match="only DeepseekV3ForCausalLM directories carry multi-token-prediction"):
        _cfg(["--load", _hf_dir(tmp_path / "q", QWEN3), "--mtp-num-layers", "1"])


@pytest.mark.parametrize("config", [QWEN3, MIXTRAL, GPT2, DEEPSEEK], ids=["qwen3", "mixtral", "gpt2", "deepseek"])
def test_row_runs_equal_the_name_map(config):
    cfg, arch = model_config_from_hf(config)
    padded = cfg.padded_vocab_size(2)
    torch.manual_seed(0)
    for e in build_entries(cfg, arch, padded):
        shapes = [_source_shape(e, cfg, arch, padded, i) for i in range(len(e.hf))]
        sources = {h: torch.randn(s) for h, s in zip(e.hf, shapes)}
        full = e.to_ours(*sources.values())
        rm = row_map(e, shapes, gpt2=arch == "GPT2LMHeadModel")
        for dim in range(full.dim()):  # a block split along each dimension, as TP/EP/FSDP cut them
            for rank in range(2):
                if full.shape[dim] % 2:
                    continue
                n = full.shape[dim] // 2
                offsets = tuple(rank * n if d == dim else 0 for d in range(full.dim()))
                want = full.narrow(dim, rank * n, n)
                got = read_block(rm, offsets, tuple(want.shape), lambda h, index: sources[h][index], full.dtype)
                assert torch.equal(got, want), (e.ours, dim, rank)


def _source_shape(e, cfg, arch, padded, i):
    from megatronish.convert.name_map import expected_global_shapes, hf_shapes

    return hf_shapes([e], expected_global_shapes(cfg, 2))[e.hf[i]][0]
