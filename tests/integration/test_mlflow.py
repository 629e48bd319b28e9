"""MLflow tracking through ``pretrain_gpt.py``: the local file store holds exactly the metrics file's numbers (same
names as TensorBoard, same steps, written by one rank), the run's flags as parameters, and a run resumed with
``--load`` (on another layout) continues the same MLflow run; without the package the flag is one error line."""
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from test_pretrain_cli import FLAGS, ROOT

from megatronish.arguments import configs_from_args, parse_args
from megatronish.tools.pretrain_gpt import main
from support.launch import cpu_env, run_job

SINGLE = FLAGS[:-3]  # one process: no TP


def _store(monkeypatch, uri):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a local file store only on request
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def _history(client, run):
    """``{(metric, step): [values]}`` of every metric of ``run``."""
    out = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            out.setdefault((key, m.step), []).append(m.value)
    return out


def _expected(*metrics_files):
    """The metrics files' records as TensorBoard names them: ``{(split/key, iteration): [value]}``."""
    out = {}
    for path in metrics_files:
        for r in map(json.loads, path.read_text().splitlines()):
            split = r.get("split", "train")
            for k, v in r.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    out.setdefault((f"{split}/{k}", r["iteration"]), []).append(float(v))
    return out


def test_mlflow_run_holds_the_metrics_file_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    save, m1, m2 = tmp_path / "ck", tmp_path / "m1.jsonl", tmp_path / "m2.jsonl"
    env = cpu_env()
    env.pop("MLFLOW_TRACKING_URI", None)  # the default store: <--save>/mlruns
    common = ["--train-iters", "20", "--save", str(save), "--load", str(save), "--mlflow-experiment-name", "tiny",
              "--mlflow-run-name", "gpt-tiny"]
    first = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SINGLE, *common,
                            "--exit-interval", "10", "--metrics-file", str(m1)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # resumed from iteration 10 on two processes (TP 2, sequence parallel): only the logging rank writes
    second = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *common, "--metrics-file", str(m2)],
                     cwd=ROOT, env=env, timeout=120)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "MLflow: continuing run" in second.stdout

    client = _store(monkeypatch, (save / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "gpt-tiny" and run.info.status == "FINISHED"
    assert json.loads((save / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    expected = _expected(m1, m2)
    assert sorted(k for k in expected if k[0] == "train/lm_loss") == [("train/lm_loss", i) for i in (5, 10, 15, 20)]
    assert _history(client, run) == expected

    p = run.data.params
    assert (p["num_layers"], p["hidden_size"], p["seq_length"], p["lr"], p["train_iters"]) == ("2", "64", "32",
                                                                                              "0.003", "20")
    assert (p["mock_data"], p["mlflow_experiment_name"], p["tensor_model_parallel_size"]) == ("True", "tiny", "1")
    # parameters are immutable: the resumed run's changed values under its own names
    assert p["resumed_iter_10/tensor_model_parallel_size"] == "2" and p["resumed_iter_10/exit_interval"] == "None"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "params")]
    assert artifacts == ["params/iter_0000000.json", "params/iter_0000010.json"]


def test_long_parameter_values_are_cut_and_kept_whole_in_the_artifact(tmp_path, monkeypatch):
    client = _store(monkeypatch, (tmp_path / "mlruns").as_uri())
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from megatronish.training.mlflow_run import MlflowRun

    long = "d" * (MAX_PARAM_VAL_LENGTH + 100)
    cfg = configs_from_args(parse_args([*SINGLE, "--data-cache-path", long, "--mlflow-experiment-name", "e",
                                        "--mlflow-tracking-uri", (tmp_path / "mlruns").as_uri()]), 1)
    run = MlflowRun.start(cfg, 0)
    run.finish()
    value = client.get_run(run.run_id).data.params["data_cache_path"]
    assert len(value) == MAX_PARAM_VAL_LENGTH and value.endswith(f"...[{len(long)} chars]")
    full = client.download_artifacts(run.run_id, "params/iter_0000000.json", str(tmp_path))
    assert json.load(open(full))["data_cache_path"] == long


def test_missing_package_and_flags_without_experiment_are_one_line_before_process_groups(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    for flags, line in (
            (["--mlflow-experiment-name", "e"], "error: --mlflow-experiment-name needs the mlflow package: pip "
                                                "install mlflow-skinny (or pip install -e '.[mlflow]')"),
            (["--mlflow-run-name", "r"], "error: --mlflow-run-name needs --mlflow-experiment-name (MLflow logging is "
                                         "on with an experiment name)")):
        with pytest.raises(SystemExit) as e:
            main([*SINGLE, *flags])
        assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [line]
        assert not dist.is_initialized()
