"""``--report-plan``: the layout planner's prediction for this very run next to what the run measures.

The entry point (``pretrain_gpt.py``) makes the report and hands it to ``pretrain``, which calls it after set-up
and after each iteration (the training loop does not import the planner, a floor above it). Before that,
:meth:`PlanReport.check` resolves the hardware (``--report-plan-gpu``; by default the detected GPU's
row of the planner's table, or ``cpu-this-machine`` without CUDA), so a wrong kind is one error line before any
process group starts. After set-up, rank 0 plans the run (``megatronish-plan``'s model: exact state bytes from the
meta model, activations, step time) and prints one block: memory per pipeline stage (the fullest rank of each),
rank 0's own prediction (its state, activations and FSDP2's buffers in flight, the plan's peak terms), step time,
tokens/s and MFU. After the first ``--log-interval`` window it prints the
measured step time (the log line's elapsed time per iteration) and rank 0's measured peak memory beside the
prediction, with ratios: on CUDA the allocator's peak (``max_memory_allocated``); on CPU the bytes the memory
report measures, the first iteration's peak of saved activations (``saved_tensors_hooks``) plus the distinct
storages of parameters, gradients and optimizer state (``measured_state_bytes``).
"""
from __future__ import annotations

import torch.distributed as dist

from .. import device
from ..errors import ConfigError
from ..training.memory import measured_state_bytes
from .activations import stage_activations
from .hardware import CPU_KIND, KINDS, load_hardware
from .plan import make_plan
from .state import build_rank, fsdp_in_flight_bytes, fsdp_unit_numels, rank_state_bytes

MIB = 2 ** 20
PREFIX = "[report-plan]"


def resolve_kind(requested: str | None) -> str:
    """The planner's hardware kind for ``--report-plan-gpu`` (None: this machine's)."""
    if requested is not None:
        if requested not in KINDS:
            raise ConfigError(f"--report-plan-gpu {requested}: choose one of {', '.join(KINDS)}")
        return requested
    if device.device_type() != "cuda":
        return CPU_KIND
    name = (device.device_name() or "").upper()
    matches = [k for k in KINDS if k.split("-")[0].upper() in name]
    if not matches:
        raise ConfigError(f"--report-plan: the planner's table has no row for this GPU ({name}); name the closest "
                          f"with --report-plan-gpu ({', '.join(KINDS)})")
    return max(matches, key=len)  # "GB200" before "B200"


class PlanReport:
    """One run's prediction (rank 0) and its comparison with the first log window."""

    def __init__(self, cfg, kind: str):
        self.cfg, self.kind = cfg, kind
        self.plan: dict | None = None
        self.rank0: dict | None = None
        self.run = None
        self.done = False

    @classmethod
    def check(cls, cfg) -> PlanReport | None:
        """Before set-up: None without ``--report-plan``; raises :class:`ConfigError` for an unknown kind."""
        lg = cfg.logging
        if not lg.report_plan:
            return None
        return cls(cfg, resolve_kind(lg.report_plan_gpu))

    def predict(self, run, print_fn=print) -> None:
        """After set-up (``run``: its live objects), rank 0 only: plan this run and print the block."""
        self.run = run
        if dist.is_initialized() and dist.get_rank() != 0:
            self.done = True
            return
        cfg = self.cfg
        hw = load_hardware(self.kind)
        self.plan = make_plan(cfg, hw)
        self.rank0 = rank0_prediction(cfg, cpu=self.kind == CPU_KIND)
        print_fn(format_prediction(self.plan, self.rank0))

    def after_step(self, state, record: dict | None, print_fn=print) -> None:
        """After an iteration: once the first log window's record exists, print measured against predicted."""
        if self.done or record is None or record.get("iteration") != state.iteration:
            return
        self.done = True
        print_fn(format_measured(self.plan, self.rank0, record, self._measured_peak()))

    def _measured_peak(self) -> tuple[float, str]:
        if device.device_type() == "cuda":
            return float(device.max_memory_allocated()), "allocator peak, max_memory_allocated"
        run = self.run
        acts = run.memory.measured if run.memory is not None and run.memory.measured is not None else 0.0
        return (acts + measured_state_bytes(run.chunks, run.optimizer),
                "saved-activation peak of the first iteration + parameter, gradient and optimizer storages")


def rank0_prediction(cfg, *, cpu: bool) -> dict:
    """Rank 0's exact parameter, gradient and optimizer bytes, its activations and its peak: the state plus the
    activations plus FSDP2's buffers in flight (``state.fsdp_in_flight_bytes`` over rank 0's units), the peak the
    plan's memory table gives a stage's rank."""
    built = build_rank(cfg, 0)
    st = rank_state_bytes(cfg, 0, built)
    act = stage_activations(cfg, 0, cpu=cpu).total
    fsdp = fsdp_in_flight_bytes(cfg, fsdp_unit_numels(built.models))
    return {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "num_params": st.num_params,
            "activations": act, "fsdp_in_flight": fsdp, "peak": st.total + act + fsdp}


def _mib(x: float) -> str:
    return f"{x / MIB:10.3f}"


def format_prediction(plan: dict, rank0: dict) -> str:
    lay, hw, tm = plan["layout"], plan["hardware"], plan["time"]
    flags = " ".join(f"{k}={v}" for k, v in lay.items() if v not in (None, False))
    lines = [f"planned on {hw['name']} ({hw['source']}): {flags}",
             "memory per rank (MiB; the fullest rank of each pipeline stage):",
             "stage  rank     params      grads  optimizer activations       peak  in-flight"]
    for s in plan["stages"]:
        lines.append(f"{s['stage']:5d} {s['rank']:5d} {_mib(s['params'])} {_mib(s['grads'])} {_mib(s['optimizer'])} "
                     f"{_mib(s['activations'])} {_mib(s['total'])} {s['in_flight']:10d}")
    lines.append(f"rank 0: {rank0['num_params']} parameters, params {rank0['params']} B, grads {rank0['grads']} B, "
                 f"optimizer {rank0['optimizer']} B, activations {rank0['activations']:.0f} B, "
                 + (f"FSDP2 in flight {rank0['fsdp_in_flight']} B, " if rank0.get("fsdp_in_flight") else "")
                 + f"peak {rank0['peak']:.0f} B")
    lines.append(f"step time {tm['step_s'] * 1e3:.3f} ms: {tm['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                 f"{tm['model_tflops_per_gpu']:.3f} model TFLOP/s/GPU, MFU {tm['mfu'] * 100:.2f}%")
    lines.append("breakdown (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in tm["breakdown_s"].items()))
    return "\n".join(f"{PREFIX} {x}" for x in lines)


def format_measured(plan: dict, rank0: dict, record: dict, peak: tuple[float, str]) -> str:
    pred_ms = plan["time"]["step_s"] * 1e3
    meas_ms = record["elapsed_ms"]
    mem, how = peak
    return "\n".join(f"{PREFIX} {x}" for x in (
        f"measured over iterations up to {record['iteration']} (the first log window):",
        f"step time: measured {meas_ms:.1f} ms (elapsed time per iteration), predicted {pred_ms:.3f} ms, "
        f"predicted/measured {pred_ms / meas_ms:.2f}",
        f"rank 0 peak memory: measured {mem:.0f} B ({how}), predicted {rank0['peak']:.0f} B, "
        f"predicted/measured {rank0['peak'] / mem:.2f}" if mem else "rank 0 peak memory: not measured"))


__all__ = ["PlanReport", "resolve_kind", "rank0_prediction", "format_prediction", "format_measured"]
