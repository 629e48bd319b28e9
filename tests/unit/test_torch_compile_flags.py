"""``--torch-compile`` next to our own fused kernels: the compiled loss replaces ``--cross-entropy-loss-fusion``'s
and the run says so in one warning (training/compile.py). ``torch.compile`` is lazy, so wrapping the layers and the
loss compiles nothing here."""
import pytest

from megatronish.config import gpt2
from megatronish.model import GPTModel
from megatronish.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronish.training import compile as compile_mod

STEP_ASIDE = ("WARNING: --torch-compile: the Triton kernels (--use-triton-kernels, --cross-entropy-loss-fusion) "
              "step aside")


def _apply(monkeypatch, **kw):
    monkeypatch.setattr(compile_mod, "compiler_problem", lambda device_type: None)  # no C++ compiler needed
    model = GPTModel(gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, **kw))
    printed = []
    c = compile_mod.Compiler("cpu", print_fn=printed.append)
    c.apply([model])
    return model, c, printed


@pytest.mark.parametrize("fusion", [False, True], ids=["plain-loss", "cross-entropy-loss-fusion"])
def test_compiled_loss_replaces_the_fused_loss_with_one_warning(monkeypatch, fusion):
    model, c, printed = _apply(monkeypatch, cross_entropy_loss_fusion=fusion)
    assert c.compiled == 2 and c.loss and model.loss_function is not None
    assert (model.loss_fn is vocab_parallel_cross_entropy) is not fusion  # the fused loss is what gets replaced
    warnings = [p for p in printed if p.startswith(STEP_ASIDE)]
    assert len(warnings) == (1 if fusion else 0), printed
