"""Context-parallel flags: Megatron's names map onto the config, and each bad combination is one line naming
the flags (before any process group starts)."""
import pytest

from megatronish.arguments import configs_from_args, parse_args, validate_args
from megatronish.errors import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "64",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
        "--attention-dropout", "0"]


def _errors(extra, world):
    with pytest.raises(ConfigError) as e:
        validate_args(parse_args(BASE + extra), world)
    return str(e.value).splitlines()


def test_flags_reach_the_config():
    cfg = configs_from_args(parse_args(BASE + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                               "--hierarchical-context-parallel-sizes", "2", "2"]), 8)
    assert (cfg.parallel.cp, cfg.parallel.dp) == (4, 2)
    assert cfg.model.attention.cp_comm_type == ["a2a+p2p"] and (cfg.parallel.cp_inner, cfg.parallel.cp_outer) == (2, 2)
    assert configs_from_args(parse_args(BASE + ["--context-parallel-size", "4"]), 8).parallel.cp_inner is None
    per_layer = configs_from_args(parse_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                                     "a2a", "allgather", "p2p"]), 2)
    assert per_layer.model.attention.cp_comm_type == ["p2p", "a2a", "allgather", "p2p"]


@pytest.mark.parametrize("extra, world, needles", [
    (["--context-parallel-size", "2", "--seq-length", "66"], 2, ["--seq-length 66", "2 x --context-parallel-size"]),
    (["--context-parallel-size", "2", "--seq-length", "68", "--tensor-model-parallel-size", "4", "--sequence-parallel"],
     8, ["--seq-length 68", "--sequence-parallel"]),
    (["--context-parallel-size", "3"], 4, ["--context-parallel-size 3", "world size 4"]),
    (["--context-parallel-size", "16", "--cp-comm-type", "a2a", "--seq-length", "64"], 16,
     ["--cp-comm-type a2a", "must divide by 16"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], 4, ["--hierarchical-context-parallel-sizes"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
      "4"], 4, ["INNER x OUTER = --context-parallel-size 4"]),
    (["--hierarchical-context-parallel-sizes", "2", "2"], 1, ["goes with --cp-comm-type a2a+p2p"]),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, ["--attention-dropout 0"]),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], 2, ["one type or one per layer"]),
    (["--reset-attention-mask"], 1, ["--reset-attention-mask needs document boundaries", "--mock-data"]),
])
def test_bad_context_parallel_input_is_one_line(extra, world, needles):
    lines = _errors(extra, world)
    assert any(all(n in line for n in needles) for line in lines), lines


def test_activation_estimate_divides_the_sequence_over_cp():
    from megatronish.config import gpt2
    from megatronish.training.memory import activation_bytes

    long, half = (gpt2(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100, seq_length=s)
                  for s in (512, 256))
    assert activation_bytes(long, micro_batch_size=2, cp=2) == activation_bytes(half, micro_batch_size=2)
    assert activation_bytes(long, micro_batch_size=2, cp=4, tp=2, sequence_parallel=True) == \
        activation_bytes(gpt2(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100, seq_length=128),
                         micro_batch_size=2, tp=2, sequence_parallel=True)
