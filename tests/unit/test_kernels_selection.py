"""Choosing the fused kernels: where they run (compiled on CUDA, interpreted with TRITON_INTERPRET=1), the one
configuration error where neither works, the flags' mapping into the model config, and the untouched PyTorch
path when they are off. Runs without triton (its presence is simulated)."""
import pytest

from megatronish import kernels
from megatronish.arguments import configs_from_args, exit_on_config_error, parse_args, validate_args
from megatronish.config import llama
from megatronish.model import GPTModel
from megatronish.model.mlp import MLP
from megatronish.model.norms import LayerNorm, RMSNorm
from megatronish.parallel.cross_entropy import fused_vocab_parallel_cross_entropy
from megatronish.parallel.dims import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]


@pytest.fixture
def where(monkeypatch):
    """``where(triton=..., interpret=..., device=...)`` simulates the machine."""

    def set_(triton: bool, interpret: bool, device: str = "cpu"):
        monkeypatch.setattr(kernels, "triton_importable", lambda: triton)
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setenv("MEGATRONISH_DEVICE", device)

    return set_


def test_backend_by_machine(where):
    where(triton=True, interpret=False, device="cuda")
    assert kernels.kernels_backend() == "compiled"
    where(triton=True, interpret=True, device="cpu")
    assert kernels.kernels_backend() == "interpreter"
    where(triton=True, interpret=False, device="cpu")
    assert kernels.kernels_backend() is None
    where(triton=False, interpret=True, device="cuda")
    assert kernels.kernels_backend() is None


def test_one_clear_error_where_kernels_cannot_run(where):
    where(triton=True, interpret=False)
    with pytest.raises(ConfigError) as e:
        kernels.check_kernels_available(["--use-triton-kernels"])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("--use-triton-kernels: ")
    assert "no CUDA device; set TRITON_INTERPRET=1" in msg and "drop the flag" in msg
    where(triton=False, interpret=True)
    with pytest.raises(ConfigError, match=r"--use-triton-kernels and --cross-entropy-loss-fusion: .*triton is "
                                          r"not installed \(install the kernels extra: pip install -e"):
        kernels.check_kernels_available(["--use-triton-kernels", "--cross-entropy-loss-fusion"])


TRITON_LOSS = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]


def test_flags_checked_at_argument_validation(where, capsys):
    where(triton=True, interpret=False)
    for flags in (["--use-triton-kernels"], TRITON_LOSS):
        args = parse_args(BASE + flags)
        with pytest.raises(SystemExit) as e:
            exit_on_config_error(lambda: validate_args(args, 1))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flags[0]}") and "the fused Triton kernels need" in err
        assert "Traceback" not in err
    # the native fused loss is PyTorch: valid anywhere, triton or not
    where(triton=False, interpret=False)
    validate_args(parse_args(BASE + ["--cross-entropy-loss-fusion"]), 1)
    validate_args(parse_args(BASE + ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]), 1)


def test_flags_reach_the_model_config(where):
    where(triton=True, interpret=True)
    cfg = configs_from_args(parse_args(BASE + ["--use-triton-kernels"]), 1)
    assert cfg.model.kernels.use_triton_kernels and not cfg.model.kernels.cross_entropy_loss_fusion
    cfg = configs_from_args(parse_args(BASE + TRITON_LOSS), 1)
    assert cfg.model.kernels.cross_entropy_loss_fusion and cfg.model.kernels.cross_entropy_fusion_impl == "te"
    assert not cfg.model.kernels.use_triton_kernels
    cfg = configs_from_args(parse_args(BASE), 1)
    assert not cfg.model.kernels.use_triton_kernels and not cfg.model.kernels.cross_entropy_loss_fusion
    assert cfg.model.kernels.cross_entropy_fusion_impl == "native"


def _hooks(model):
    return [m.use_triton_kernels for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm, MLP))] + \
        [model.rotary.use_triton_kernels, model.loss_fn is kernels.vocab_parallel_cross_entropy]


def test_model_hooks(where):
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99, seq_length=8)
    where(triton=False, interpret=False)
    off = GPTModel(llama(**kw))
    assert not any(_hooks(off))
    assert len(off.rotary(4)) == 2  # the unfused tables: (cos, sin)
    with pytest.raises(ConfigError, match="--use-triton-kernels: "):
        GPTModel(llama(**kw, use_triton_kernels=True))
    where(triton=True, interpret=True)
    on = GPTModel(llama(**kw, use_triton_kernels=True, cross_entropy_loss_fusion=True,
                        cross_entropy_fusion_impl="te"))
    assert all(_hooks(on))
    where(triton=False, interpret=False)
    native = GPTModel(llama(**kw, cross_entropy_loss_fusion=True))  # no triton needed
    assert native.loss_fn is fused_vocab_parallel_cross_entropy and not any(_hooks(native))
    assert len(on.rotary(4)) == 3
