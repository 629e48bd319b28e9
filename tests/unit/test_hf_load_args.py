"""``--load <Hugging Face directory>`` without processes: the flags its config.json gives (a contradicting flag is
one line naming both; the tokenizer from the directory's files), and the row runs of convert/hf_rows.py equal the
name map's tensors block for block (fused QKV with GQA, [gate; up], stacked experts, padded vocabulary, GPT-2's
transposed Conv1D)."""
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


@pytest.mark.parametrize("config", [QWEN3, MIXTRAL, GPT2], ids=["qwen3", "mixtral", "gpt2"])
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
