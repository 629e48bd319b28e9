"""The per-interval log: one record per ``--log-interval`` for the metrics sinks (JSON lines, TensorBoard, W&B,
MLflow) and Megatron's log line, both from that record; the validation and test records; the pipeline timeline."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from .. import device
from ..model.moe import stats as moe_stats
from ..optim.clip_grads import global_norm
from ..parallel.pipeline.timeline import gather_timeline, write_chrome_trace
from .evaluate import evaluate
from .flops import device_peak_tflops, num_floating_point_operations
from .metrics import MetricsWriter, print_rank_last, train_log_line
from .timers import straggler_lines

if TYPE_CHECKING:
    from ..parallel.context import ParallelContext
    from ..parallel.pipeline.timeline import PipelineTimeline
    from .state import StepResult, TrainContext, TrainState

__all__ = ["TrainLogger", "write_timeline"]


def _is_logging_rank(parallel: ParallelContext) -> bool:
    return parallel.holds_loss and parallel.tp_rank == 0 and parallel.dp_cp_rank == 0



class TrainLogger:
    """Per-interval averages, one record per log interval written to the metrics sinks and printed as
    Megatron's log line; validation records."""

    def __init__(self, run: TrainContext, train_iters: int, state: TrainState | None = None):
        """``state``: the loop's state after set-up (its iteration > 0: resumed from a checkpoint; MLflow continues
        the checkpoint's run)."""
        cfg, lg = run.cfg, run.cfg.logging
        self.run, self.cfg, self.train_iters = run, cfg, train_iters
        self.logging_rank = _is_logging_rank(run.parallel)
        mlflow = None
        if self.logging_rank and lg.mlflow_experiment_name:
            from .mlflow_run import MlflowRun  # imports mlflow: only with --mlflow-experiment-name

            mlflow = MlflowRun.start(cfg, state.iteration if state is not None else 0)
        self.writer = MetricsWriter(self.logging_rank, lg.metrics_file, lg.tensorboard_dir, lg.wandb_project or None,
                                    lg.wandb_entity or None, lg.wandb_exp_name or None, lg.wandb_save_dir or None,
                                    mlflow=mlflow)
        self.peak = device_peak_tflops(device.device_name())
        self.last_record: dict | None = None
        self.skipped = self.nan_iters = 0
        self.restart_window()

    def restart_window(self) -> None:
        self.window_steps: list[StepResult] = []
        self.window_batches, self.window_start = [], time.perf_counter()
        self.window_moe: list[dict] = []

    def after_step(self, state: TrainState, step: StepResult) -> None:
        """Record the iteration; at ``--log-interval`` write the window's record. The step's loss, norm and success
        are read then (under ``--enable-optimizer-post-validation`` an iteration's are known once it is
        validated: the loop validates before a logging iteration)."""
        self.window_steps.append(step)
        self.window_batches.append(step.global_batch_size or self.cfg.train.global_batch_size)
        if step.moe is not None:
            self.window_moe.append(step.moe)
        if state.iteration % self.cfg.logging.log_interval == 0 or state.iteration == self.train_iters:
            self._log(state, step.grad_norm)

    def _tally(self) -> list[float]:
        """The window's losses; counts its skipped and non-finite iterations."""
        for step in self.window_steps:
            if not step.update_successful:
                self.skipped += 1
                self.nan_iters += int(not math.isfinite(step.loss)
                                      or (step.grad_norm is not None and not math.isfinite(step.grad_norm)))
        return [step.loss for step in self.window_steps]

    def _log(self, state: TrainState, grad_norm: float | None) -> None:
        run, lg = self.run, self.cfg.logging
        losses = self._tally()
        window_mtp = [step.mtp for step in self.window_steps if step.mtp is not None]
        device.synchronize()
        elapsed = (time.perf_counter() - self.window_start) / len(losses)
        batch = sum(self.window_batches) / len(self.window_batches)  # mean samples per iteration of the window
        tflops = num_floating_point_operations(self.cfg.model, batch) / elapsed / run.parallel.world_size / 1e12
        params_norm = None
        if lg.log_params_norm:
            run.optimizer.finish_param_sync()
            params_norm = global_norm([p for m in run.models for p in m.parameters()], use_grad=False,
                                      parallel=run.parallel, experts=self.cfg.model.moe.num_experts is not None)
        record = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                  "lm_loss": sum(losses) / len(losses),
                  "lr": run.scheduler.lr, "grad_norm": grad_norm,
                  "loss_scale": run.optimizer.loss_scale, "elapsed_ms": elapsed * 1e3,
                  "tokens_per_sec": batch * self.cfg.model.seq_length / elapsed, "tflops": tflops,
                  "skipped_iterations": self.skipped, "nan_iterations": self.nan_iters}
        if params_norm is not None:
            record["params_norm"] = params_norm
        moe_line = self._moe_record(record)
        mtp_line = {name: sum(m[name] for m in window_mtp) / len(window_mtp)
                    for name in (window_mtp[0] if window_mtp else ())}  # each depth's, over the window
        record.update({name.replace(" ", "_"): value for name, value in mtp_line.items()})
        timing, straggler = self._gather_timers(len(losses))
        if straggler is not None:
            record["straggler"] = straggler[1]
        self.writer.write(record, state.iteration)
        self.last_record = r = record  # the window's record (--report-plan reads its elapsed time)
        print_rank_last(self.logging_rank, train_log_line(
            iteration=r["iteration"], train_iters=self.train_iters, consumed_samples=r["consumed_samples"],
            elapsed_ms=r["elapsed_ms"], tflops=r["tflops"] if lg.log_throughput else None,
            tokens_per_sec=r["tokens_per_sec"], lr=r["lr"],
            global_batch_size=self.window_batches[-1], loss=r["lm_loss"], grad_norm=r["grad_norm"],
            loss_scale=r["loss_scale"], skipped=r["skipped_iterations"], nan=r["nan_iterations"],
            params_norm=params_norm, mfu=(tflops / self.peak) if self.peak else None, extra={**mtp_line, **moe_line}))
        # Megatron prints the timers from the last rank; the straggler line with the log line
        if straggler is not None:
            print_rank_last(self.logging_rank, straggler[0])
        if timing:
            print_rank_last(dist.get_rank() == dist.get_world_size() - 1, timing)
        self.restart_window()
    def _moe_record(self, record: dict) -> dict:
        """The MoE metrics averaged over the log window, added to ``record`` (``moe/...`` keys); returns the
        losses for the log line (every layer's too with ``--moe-per-layer-logging``)."""
        if not self.window_moe:
            return {}
        n, line = len(self.window_moe), {}
        names = moe_stats.loss_names(self.cfg.model)
        for key in self.window_moe[0]:
            values = [m[key] for m in self.window_moe if key in m]
            if key.endswith("_layers"):
                if self.cfg.logging.moe_per_layer_logging:
                    for i, v in enumerate(values[0]):
                        if v is not None:
                            mean = sum(m[key][i] for m in self.window_moe) / n
                            record[f"moe/{key[:-len('_layers')]}_layer_{i}"] = mean
                            line[f"{key[:-len('_layers')]} layer {i}"] = mean
                continue
            record[f"moe/{key}"] = sum(values) / len(values)
            if key in names:
                line[key] = record[f"moe/{key}"]
        for key, shown in (("tokens_per_expert_min", "tokens per expert min"),
                           ("tokens_per_expert_max", "tokens per expert max"),
                           ("expert_imbalance", "expert imbalance (max/mean)"),
                           ("dropped_token_fraction", "dropped tokens")):
            if f"moe/{key}" in record:
                line[shown] = record[f"moe/{key}"]
        return line

    def _gather_timers(self, iterations: int):
        """The interval's timers over all ranks (collective when --timing-log-level or --log-straggler asks)."""
        timers, lg = self.run.timers, self.cfg.logging
        if timers is None:
            return None, None
        names = timers.names()
        if not names:
            return None, None
        times = timers.gather(names)
        timing = timers.min_max_string(times, names, normalizer=iterations)
        straggler = None
        if lg.log_straggler:
            compute = times[:, names.index("forward-backward")].tolist()
            straggler = straggler_lines(compute, lg.straggler_minmax_count, normalizer=iterations)
        return timing, straggler

    def evaluate(self, state: TrainState, test: bool = False) -> None:
        """Validation (or, ``test``, the test split's evaluation at the end, as Megatron's ``on test set``)."""
        details: dict = {}
        loss = evaluate(self.run, state, self.run.test_ds if test else None, details)
        ppl = math.exp(min(20.0, loss))
        mtp = details.get("mtp", {})  # --mtp-num-layers: each depth's loss, as the training line has them
        (state.test_history if test else state.valid_history).append((state.iteration, loss))
        self.writer.write({"split": "test" if test else "valid", "iteration": state.iteration, "lm_loss": loss,
                           "ppl": ppl, **{name.replace(" ", "_"): value for name, value in mtp.items()}},
                          state.iteration)
        bar = "-" * 100
        where = " on test set" if test else ""
        depths = "".join(f" {name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E} |"
                         for name, value in mtp.items())
        print_rank_last(self.logging_rank, f"{bar}\n validation loss at iteration {state.iteration}{where} | lm "
                                           f"loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |{depths}\n{bar}")

    def close(self) -> None:
        self.writer.close()


def write_timeline(run: TrainContext, timeline: PipelineTimeline) -> None:
    cfg = run.cfg
    events = gather_timeline(timeline)
    if dist.get_rank() == 0:
        write_chrome_trace(cfg.logging.pipeline_timeline, events,
                           metadata={"p": cfg.parallel.pp, "v": cfg.parallel.vp, "m": cfg.num_microbatches})

