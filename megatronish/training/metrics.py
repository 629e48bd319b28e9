"""Metrics: Megatron's console log line, JSON lines (``--metrics-file``), TensorBoard, W&B and MLflow.

Only the rank that holds the loss (last pipeline stage, first TP and DP rank) writes; others are silent.
"""
from __future__ import annotations

import json
import os
import sys
import time


class MetricsWriter:
    def __init__(self, enabled: bool, metrics_file: str | None = None, tensorboard_dir: str | None = None,
                 wandb_project: str | None = None, wandb_entity: str | None = None,
                 wandb_exp_name: str | None = None, wandb_save_dir: str | None = None, config: dict | None = None,
                 mlflow=None):
        """``mlflow``: the logging rank's started :class:`~megatronish.training.mlflow_run.MlflowRun`, or None."""
        self.enabled = enabled
        self._mlflow = mlflow
        self._file = self._tb = self._wandb = None
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is optional
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from e
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--wandb-project needs wandb: pip install -e '.[wandb]'") from e
            # Without credentials there is nowhere to send to: record offline (wandb sync uploads later).
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self._wandb = wandb.init(project=wandb_project, entity=wandb_entity, name=wandb_exp_name,
                                     dir=wandb_save_dir, config=config or {}, mode=mode)

    def write(self, record: dict, step: int) -> None:
        if not self.enabled:
            return
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        prefix = record.get("split", "train")
        scalars = {f"{prefix}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log(scalars, step=step)
        if self._mlflow:
            self._mlflow.log(scalars, step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        if self._mlflow:
            self._mlflow.finish()


def print_rank_last(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, flush=True, file=sys.stdout)


def train_log_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                   tflops: float | None, tokens_per_sec: float, lr: float, global_batch_size: int, loss: float,
                   grad_norm: float | None, loss_scale: float, skipped: int, nan: int,
                   params_norm: float | None = None, mfu: float | None = None,
                   extra: dict | None = None) -> str:
    """Megatron's training log line (same fields and number formats, plus tokens/s); the throughput per GPU only
    with ``tflops`` (``--log-throughput``, as Megatron)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}",
             f"consumed samples: {consumed_samples:12d}",
             f"elapsed time per iteration (ms): {elapsed_ms:.1f}"]
    if tflops is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.2f}" + (f" (MFU {mfu * 100:.1f}%)" if mfu else ""))
    parts += [f"tokens per second: {tokens_per_sec:.1f}",
              f"learning rate: {lr:.6E}",
              f"global batch size: {global_batch_size:5d}",
              f"lm loss: {loss:.6E}"]
    parts += [f"{name}: {value:.6E}" for name, value in (extra or {}).items()]  # MoE losses, as Megatron
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nan:3d}"]
    return " | ".join(parts) + " |"
