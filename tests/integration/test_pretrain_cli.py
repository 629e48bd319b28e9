"""End to end: torchrun pretrain_gpt.py on 4 CPU processes (TP 2 x DP 2) with mock data and a metrics file;
and a bad flag gives one line and exit code 2, before any process group starts."""
import json
import os
import subprocess
import sys

import pytest

from support.launch import cpu_env, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "30", "--lr", "3e-3",
         "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "3e-4", "--clip-grad", "1.0",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "5", "--eval-interval", "15",
         "--eval-iters", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
TRAIN_KEYS = {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale", "elapsed_ms",
              "tokens_per_sec", "tflops", "skipped_iterations"}


def test_torchrun_trains_and_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, "--metrics-file", str(metrics)]
    proc = run_job(cmd, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration       30/      30" in proc.stdout and "lm loss:" in proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    valid = [r for r in records if r.get("split") == "valid"]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20, 25, 30]
    for r in train:
        assert TRAIN_KEYS <= r.keys(), r
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.3, [r["lm_loss"] for r in train]
    assert train[-1]["consumed_samples"] == 30 * 8
    assert [r["iteration"] for r in valid] == [15, 30] and all({"lm_loss", "ppl"} <= r.keys() for r in valid)
    assert valid[-1]["ppl"] == pytest.approx(2.718281828 ** valid[-1]["lm_loss"], rel=1e-6)


def test_bad_flag_is_one_line_before_process_groups():
    single = FLAGS[:-3]  # one process: no TP
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *single, "--global-batch-size", "6",
           "--micro-batch-size", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "--global-batch-size" in err[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_torchrun_interleaved_pipeline_with_timeline(tmp_path):
    """PP 2 x DP 2 with the interleaved schedule, end to end; the timeline trace draws as a PNG."""
    metrics, trace, png = tmp_path / "m.jsonl", tmp_path / "trace.json", tmp_path / "trace.png"
    flags = FLAGS[:-3] + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", "10", "--eval-interval", "5",
                          "--metrics-file", str(metrics), "--pipeline-timeline", str(trace)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    proc = run_job(cmd, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [json.loads(line) for line in metrics.read_text().splitlines() if "split" not in line]
    assert [r["iteration"] for r in train] == [5, 10] and train[-1]["lm_loss"] < train[0]["lm_loss"]
    events = json.loads(trace.read_text())
    assert {e["pid"] for e in events["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_timeline.py"), str(trace), "-o", str(png)],
                          cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.stat().st_size > 1000 and "bubble" in plot.stdout


def test_torchrun_mixture_of_experts_logs_its_metrics(tmp_path):
    """EP 2 x TP 2 (sequence parallel) with the all-to-all dispatcher: the MoE losses (mean and per layer) in the
    log line and the metrics file, tokens per expert and dropped tokens every log interval."""
    metrics = tmp_path / "metrics.jsonl"
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--disable-bias-linear",
           "--swiglu", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--expert-model-parallel-size",
           "2", "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.5",
           "--moe-per-layer-logging", "--train-iters", "10", "--eval-iters", "0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *moe, "--metrics-file", str(metrics)]
    proc = run_job(cmd, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "iteration " in line and "lm loss:" in line]
    assert len(lines) == 2
    for needle in ("load_balancing_loss: ", "z_loss: ", "load_balancing_loss layer 1: ", "tokens per expert max: ",
                   "dropped tokens: "):
        assert needle in lines[-1], lines[-1]
    train = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in train:
        # a Switch loss of a near-uniform router is about 1 (its minimum), z-loss about log(E)^2
        assert 0.9 < r["moe/load_balancing_loss"] < 1.5, r
        assert r["moe/load_balancing_loss_layer_0"] > 0 and r["moe/z_loss_layer_1"] > 0
        assert r["moe/tokens_per_expert_min"] <= r["moe/tokens_per_expert_max"]
        assert 0 <= r["moe/dropped_token_fraction"] < 0.5 and r["moe/expert_imbalance"] >= 1
