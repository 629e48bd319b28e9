"""--use-checkpoint-args fills the model-shape flags from the --load checkpoint's stored config."""

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint.offline import write_checkpoint
from megatronish.config import llama
from megatronish.parallel.dims import ConfigError

RUN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


@pytest.fixture
def ckpt(tmp_path):
    model = llama(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=97,
                  seq_length=16, ffn_hidden_size=96)
    cfg = {"model": model.flat(), "data": {"tokenizer_type": "NullTokenizer", "vocab_size_flag": 96}}
    write_checkpoint(str(tmp_path), 4, {"decoder.final_layernorm.weight": torch.ones(64)}, cfg)
    return str(tmp_path), model


def test_model_flags_come_from_the_checkpoint(ckpt):
    d, model = ckpt
    cfg = configs_from_args(parse_args(RUN + ["--load", d, "--use-checkpoint-args"]), 1)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size", "seq_length", "normalization", "position_embedding_type", "swiglu",
                  "untie_embeddings_and_output_weights", "add_bias_linear"):
        assert cfg.model.flat()[field] == model.flat()[field], field
    assert cfg.data.tokenizer_type == "NullTokenizer" and cfg.checkpoint.use_checkpoint_args


def test_command_line_keeps_what_megatron_keeps(ckpt):
    d, _ = ckpt
    cfg = configs_from_args(parse_args(RUN + ["--load", d, "--use-checkpoint-args", "--seq-length", "8",
                                              "--normalization", "LayerNorm"]), 1)
    assert cfg.model.seq_length == 8  # filled only when unset
    assert cfg.model.normalization == "RMSNorm"  # architecture switches always from the checkpoint


def test_missing_checkpoint_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="^--use-checkpoint-args: no checkpoint at"):
        configs_from_args(parse_args(RUN + ["--load", str(tmp_path), "--use-checkpoint-args"]), 1)


def test_mixture_of_experts_flags_come_from_the_checkpoint(tmp_path):
    model = llama(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=16,
                  num_experts=8, moe_layer_freq=[1, 0, 1, 1], moe_ffn_hidden_size=32, moe_router_topk=1,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
                  moe_token_dispatcher_type="alltoall")
    cfg = {"model": model.flat(), "data": {"tokenizer_type": "NullTokenizer", "vocab_size_flag": 96}}
    write_checkpoint(str(tmp_path), 4, {"decoder.final_layernorm.weight": torch.ones(64)}, cfg)
    got = configs_from_args(parse_args(RUN + ["--load", str(tmp_path), "--use-checkpoint-args"]), 1).model
    for field in ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
                  "moe_router_score_function", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                  "moe_shared_expert_gate"):
        assert got.flat()[field] == model.flat()[field], field
    # the dispatcher is the run's choice (it changes no weight): the command line's, as in Megatron
    assert got.moe.moe_token_dispatcher_type == "allgather"


def test_the_load_path_is_resolved_once_and_the_flags_stay_as_given(ckpt, monkeypatch):
    from megatronish.checkpoint import layout

    d, _ = ckpt
    args = parse_args(RUN + ["--load", d, "--use-checkpoint-args"])
    given = dict(vars(args))
    calls = []
    resolve = layout.resolve
    monkeypatch.setattr(layout, "resolve", lambda path: calls.append(path) or resolve(path))
    cfg = configs_from_args(args, 1)
    assert vars(args) == given  # the namespace is only read
    assert cfg.checkpoint.load_resolved == (layout.checkpoint_dir(d, 4), 4)
    assert calls.count(d) == 1  # the root's tracker is read once; the loader takes cfg.checkpoint.load_resolved
