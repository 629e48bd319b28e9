"""The metrics sinks: JSON lines, TensorBoard event files and W&B (offline) receive the same scalars."""
import json
import os

import pytest

from megatronish.config import gpt2, llama
from megatronish.training.flops import num_floating_point_operations
from megatronish.training.metrics import MetricsWriter, train_log_line


def test_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(True, metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    w.write({"iteration": 1, "lm_loss": 3.5, "lr": 1e-3}, 1)
    w.write({"iteration": 2, "lm_loss": 3.0, "lr": 9e-4}, 2)
    w.write({"split": "valid", "iteration": 2, "lm_loss": 2.9, "ppl": 18.17}, 2)
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["lm_loss"] for r in lines] == [3.5, 3.0, 2.9]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/lm_loss")] == [(1, 3.5), (2, 3.0)]
    assert acc.Scalars("valid/ppl")[0].value == pytest.approx(18.17)


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    w = MetricsWriter(True, wandb_project="p", wandb_exp_name="run", wandb_save_dir=str(tmp_path))
    assert w._wandb.settings.mode == "offline"
    w.write({"iteration": 1, "lm_loss": 3.5}, 1)
    w.close()
    assert any(d.startswith("offline-run") for d in os.listdir(tmp_path / "wandb"))


def test_silent_ranks_write_nothing(tmp_path):
    w = MetricsWriter(False, metrics_file=str(tmp_path / "m.jsonl"))
    w.write({"iteration": 1, "lm_loss": 1.0}, 1)
    w.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_flops_formula():
    """Megatron's formula: for MHA with ffn = 4h it reduces to 72 B s L h^2 (1 + s/(6h) + V/(12 L h))."""
    c = gpt2(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50257, seq_length=2048)
    B, s, L, h, V = 8, 2048, 24, 1024, c.padded_vocab_size(1)
    megatron_formula = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert num_floating_point_operations(c, B) == pytest.approx(megatron_formula)
    # GQA and SwiGLU: the attention term shrinks with fewer key/value groups, the MLP term grows by 3/2
    q = llama(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
              vocab_size=1000, seq_length=128)
    expected = 12 * 1 * 128 * 2 * 512 ** 2 * ((1 + 2 / 8 + 128 / 512) + (1024 / 512) * 1.5
                                              + q.padded_vocab_size(1) / (2 * 2 * 512))
    assert num_floating_point_operations(q, 1) == pytest.approx(expected)


def test_log_line_has_megatron_fields():
    line = train_log_line(iteration=5, train_iters=10, consumed_samples=40, elapsed_ms=12.5, tflops=1.5,
                          tokens_per_sec=100.0, lr=1e-3, global_batch_size=8, loss=2.5, grad_norm=0.5,
                          loss_scale=1.0, skipped=0, nan=0)
    for field in ("iteration        5/      10", "consumed samples:", "elapsed time per iteration (ms): 12.5",
                  "learning rate: 1.000000E-03", "global batch size:     8", "lm loss: 2.500000E+00",
                  "loss scale: 1.0", "grad norm: 0.500", "number of skipped iterations:   0",
                  "number of nan iterations:   0"):
        assert field in line, field
