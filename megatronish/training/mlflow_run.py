"""MLflow tracking (``--mlflow-experiment-name``): the scalars of every metrics record under TensorBoard's names
(``train/lm_loss``, ``valid/ppl``, ...) at the same steps (the iteration), and the run's configuration as parameters.
Only the logging rank (the one that writes the metrics file, TensorBoard and W&B) has a run; ``mlflow`` is imported
here, on that rank, and only with the flag (validation checks that it is installed, before any process group starts).

- Where: ``--mlflow-tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the local file store ``<--save>/mlruns``
  (``./mlruns`` without ``--save``). MLflow 3 keeps its file store only on request: for a local store
  ``MLFLOW_ALLOW_FILE_STORE`` is set to ``true`` in this process unless the environment already sets it.
- Parameters: every config field under its name, which is its flag's argparse dest (``num_layers``, ``lr``, ...;
  the parallel degrees under their flags' dests, ``tensor_model_parallel_size``, ...). A value longer than MLflow's
  limit is cut, with its length noted; the full values are the run's artifact ``params/iter_<iteration>.json``.
- Resuming: when the run starts, the MLflow run id is written to ``<--save>/mlflow_run.json``. A run that resumed
  from a checkpoint (``--load``, iteration > 0; not ``--finetune``) reads that file from the ``--load`` directory
  and continues the run it names, if the tracking store still holds it in the same experiment; else it starts a
  new run. Metrics continue at the resumed iterations (steps the first run logged after its last checkpoint are
  logged again, as a second value at the same step). Parameters are immutable in MLflow: the ones that changed
  are logged as ``resumed_iter_<iteration>/<name>``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from urllib.parse import urlparse

from ..parallel.dims import ParallelDims

__all__ = ["MlflowRun", "RUN_FILE", "run_params", "tracking_uri"]

RUN_FILE = "mlflow_run.json"  # in --save: the MLflow run that training into this directory logs to
# ParallelDims' degrees under their flags' argparse dests
_DEGREE_DESTS = {"world_size": "world_size", "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                 "vp": "num_virtual_stages_per_pipeline_rank", "cp": "context_parallel_size",
                 "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
_BATCH = 100  # parameters per log_batch call (MLflow's limit)


def tracking_uri(mlflow_tracking_uri: str | None, save: str | None) -> str:
    """``--mlflow-tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``file:<--save, else .>/mlruns``."""
    if mlflow_tracking_uri:
        return mlflow_tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return pathlib.Path(os.path.abspath(os.path.join(save or ".", "mlruns"))).as_uri()


def run_params(cfg) -> dict[str, str]:
    """The run's configuration as MLflow parameters: each config field (nested groups included) under its name,
    the flag's argparse dest; the parallel degrees under their flags' dests."""
    out: dict = {}

    def leaves(obj) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, ParallelDims):
                out.update({dest: getattr(value, name) for name, dest in _DEGREE_DESTS.items()})
                out["data_parallel_size"] = value.dp
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                leaves(value)
            else:
                out.setdefault("sequence_parallel" if f.name == "sequence_parallel_flag" else f.name, value)

    leaves(cfg)
    return {name: str(value) for name, value in out.items()}


def _fit(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    tail = f"...[{len(value)} chars]"
    return value[:limit - len(tail)] + tail


def _recorded_run(load: str | None) -> dict | None:
    """The run file of the ``--load`` directory (or of the directory above, when ``--load`` names an iteration)."""
    if not load:
        return None
    for where in (load, os.path.dirname(os.path.normpath(load))):
        path = os.path.join(where, RUN_FILE)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    return json.load(f)
            except (OSError, ValueError):
                return None
    return None


def _write_run_file(save: str, record: dict) -> None:
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, RUN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class MlflowRun:
    """The logging rank's MLflow run: :meth:`start` makes or continues it, :meth:`log` takes one record's scalars,
    :meth:`finish` ends it."""

    def __init__(self, client, run_id: str, metric_cls):
        self.client, self.run_id, self._metric = client, run_id, metric_cls

    @classmethod
    def start(cls, cfg, iteration: int) -> MlflowRun:
        """Start the run (or, after a checkpoint was loaded at ``iteration`` > 0, continue the recorded one) and log
        the configuration."""
        lg, ck = cfg.logging, cfg.checkpoint
        uri = tracking_uri(lg.mlflow_tracking_uri, ck.save)
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the local file store on request
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        name = lg.mlflow_experiment_name
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run_id = cls._resumable(client, experiment_id, ck.load) if iteration > 0 else None
        resumed = run_id is not None
        if resumed:
            client.update_run(run_id, status="RUNNING")
            print(f"> MLflow: continuing run {run_id} (experiment {name!r}, {uri}) at iteration {iteration}",
                  flush=True)
        else:
            run_id = client.create_run(experiment_id, run_name=lg.mlflow_run_name or None).info.run_id
            print(f"> MLflow: run {run_id} (experiment {name!r}, {uri})", flush=True)
        if ck.save:
            _write_run_file(ck.save, {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": uri})
        run = cls(client, run_id, Metric)
        run.log_params(run_params(cfg), iteration, resumed)
        return run

    @staticmethod
    def _resumable(client, experiment_id: str, load: str | None) -> str | None:
        """The run recorded beside the loaded checkpoint, if the store holds it in this experiment."""
        recorded = _recorded_run(load)
        if not recorded or not recorded.get("run_id"):
            return None
        try:
            info = client.get_run(recorded["run_id"]).info
        except Exception:  # not in this store (another tracking URI, deleted): a new run
            return None
        if info.experiment_id != experiment_id or info.lifecycle_stage != "active":
            return None
        return info.run_id

    def log_params(self, params: dict[str, str], iteration: int, resumed: bool) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self.client.log_dict(self.run_id, params, f"params/iter_{iteration:07d}.json")  # the full values
        fitted = {k: _fit(v, MAX_PARAM_VAL_LENGTH) for k, v in params.items()}
        if resumed:  # logged parameters cannot change: a changed value goes under this resumption's name
            logged = self.client.get_run(self.run_id).data.params
            fitted = {(k if k not in logged else f"resumed_iter_{iteration}/{k}"): v for k, v in fitted.items()
                      if logged.get(k) != v}
            fitted = {k: v for k, v in fitted.items() if k not in logged}
        items = [Param(k, v) for k, v in fitted.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _BATCH])

    def log(self, scalars: dict, step: int) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), stamp, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
