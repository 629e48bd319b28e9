"""One layout's plan: memory per pipeline stage (the fullest rank of each), step time and throughput, and its
report (text, JSON, a picture)."""
from __future__ import annotations

from .activations import stage_activations
from .comms import fsdp_estimate, step_collectives
from .hardware import CPU_KIND
from .perf import step_time
from .state import build_rank, fsdp_in_flight_bytes, fsdp_unit_numels, rank_state_bytes, stage_ranks

GIB = 2 ** 30


def make_plan(cfg, hw, **time_kw) -> dict:
    """The plan of the validated ``cfg`` on ``hw`` (see docs/planner.md). Activations use the CPU terms of
    ``training/memory.py`` on ``cpu-this-machine``, Korthikanti's elsewhere. ``time_kw``: ``perf.step_time``'s
    keywords (``tp_overlap``, ``async_tp_hidden``, ``efficiencies``)."""
    stages, state, colls, rank = plan_inputs(cfg, hw)
    return plan_from_inputs(cfg, hw, stages, state, colls, rank, **time_kw)


def plan_inputs(cfg, hw, *, unsharded_grads: bool = False, **act_kw) -> tuple[list, object, list, int]:
    """Memory per stage, and the fullest rank's state bytes, collectives (counted on its meta model) and rank:
    what :func:`plan_from_inputs` prices. The peak adds FSDP2's buffers in flight (``state.fsdp_in_flight_bytes``,
    ``unsharded_grads`` its keyword). ``act_kw``: ``activations.stage_activations``'s ``loss``,
    ``selective`` and ``pipelining_outputs`` (another stack's loss, checkpointing policy and pipeline runtime)."""
    cpu = hw.name == CPU_KIND
    stages, fullest_state, colls, fullest_rank = [], None, [], 0
    for stage, ranks in enumerate(stage_ranks(cfg.parallel)):
        built = {r: build_rank(cfg, r) for r in ranks}
        states = {r: rank_state_bytes(cfg, r, built[r]) for r in ranks}
        rank = max(states, key=lambda r: states[r].total)
        st = states[rank]
        act = stage_activations(cfg, stage, cpu=cpu, **act_kw)
        fsdp = fsdp_in_flight_bytes(cfg, fsdp_unit_numels(built[rank].models), unsharded_grads=unsharded_grads)
        total = st.total + act.total + fsdp
        stages.append({"stage": stage, "rank": rank, "num_params": st.num_params, "params": st.params,
                       "grads": st.grads, "optimizer": st.optimizer, "activations": act.total,
                       "activations_layers": act.layers, "activations_embedding": act.embedding,
                       "activations_output": max(act.output, act.recompute), "in_flight": act.in_flight,
                       "fsdp_in_flight": fsdp, "total": total, "fits": total <= hw.hbm_bytes})
        if fullest_state is None or st.total > fullest_state.total:
            fullest_state, fullest_rank = st, rank
            colls = step_collectives(cfg, rank, built[rank].chunks, built[rank].ctx)
            if cfg.fsdp_active:  # FSDP2's own collectives run inside torch: estimated
                colls += fsdp_estimate(cfg, st)
    return stages, fullest_state, colls, fullest_rank


def plan_from_inputs(cfg, hw, stages, state, colls, rank, **time_kw) -> dict:
    par = cfg.parallel
    peak = max(s["total"] for s in stages)
    time = step_time(cfg, hw, state, colls, rank, **time_kw)
    return {"layout": {"world_size": par.world_size, "tp": par.tp, "pp": par.pp, "vp": par.vp, "cp": par.cp,
                       "ep": par.ep, "etp": par.expert_tp, "dp": par.dp,
                       "sequence_parallel": cfg.sequence_parallel, "fsdp": cfg.fsdp_active,
                       "distributed_optimizer": cfg.optim.use_distributed_optimizer,
                       "micro_batch_size": cfg.train.micro_batch_size,
                       "global_batch_size": cfg.train.global_batch_size, "num_microbatches": cfg.num_microbatches,
                       "recompute": cfg.model.recompute.recompute_granularity},
            "hardware": {"name": hw.name, "hbm_gib": hw.hbm_gib, "peak_bf16_tflops": hw.peak("bf16") / 1e12,
                         "gpus_per_node": hw.gpus_per_node, "source": hw.source},
            "stages": stages, "peak_bytes": peak, "fits": peak <= hw.hbm_bytes,
            "time": time}


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: dict) -> str:
    lay, hw, tm = plan["layout"], plan["hardware"], plan["time"]
    flags = " ".join(f"{k}={v}" for k, v in lay.items() if v not in (None, False))
    lines = [f"layout: {flags}", f"hardware: {hw['name']} ({hw['hbm_gib']:.0f} GiB, {hw['peak_bf16_tflops']:.0f} "
             f"TFLOP/s bf16, {hw['gpus_per_node']} per node)", "",
             "memory per rank (GiB; the fullest rank of each pipeline stage; params/grads/optimizer exact; "
             "fsdp: FSDP2's buffers in flight):",
             "stage  rank      params     grads  optimizer  activations     fsdp    total  fits"]
    for s in plan["stages"]:
        lines.append(f"{s['stage']:5d} {s['rank']:5d}  {_gib(s['params'])}  {_gib(s['grads'])}   "
                     f"{_gib(s['optimizer'])}     {_gib(s['activations'])} {_gib(s['fsdp_in_flight'])} "
                     f"{_gib(s['total'])}  {'yes' if s['fits'] else 'NO'}")
    lines += ["", f"step time {tm['step_s'] * 1e3:.1f} ms: {tm['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
              f"{tm['model_tflops_per_gpu']:.1f} model TFLOP/s/GPU, MFU {tm['mfu'] * 100:.1f}%",
              "breakdown (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in tm["breakdown_s"].items()),
              "collectives per step (MB issued, per rank): "
              + (", ".join(f"{k} {v / 1e6:.1f}" for k, v in tm["comm_bytes"].items()) or "none")]
    return "\n".join(lines)


def plot_plan(plan: dict, path: str) -> bool:
    """A stacked bar per pipeline stage (parameters, gradients, optimizer, activations, FSDP2's buffers in
    flight) against the memory.
    False (nothing drawn) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    stages = plan["stages"]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(stages) + 2), 4))
    bottom = [0.0] * len(stages)
    x = [s["stage"] for s in stages]
    for key, color in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868"),
                       ("activations", "#c44e52"), ("fsdp_in_flight", "#8172b3")):
        vals = [s[key] / GIB for s in stages]
        ax.bar(x, vals, bottom=bottom, color=color, label=key.replace("_in_flight", " in flight"))
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.axhline(plan["hardware"]["hbm_gib"], color="black", linestyle="--", label="memory")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{plan['hardware']['name']}: step {plan['time']['step_s'] * 1e3:.0f} ms, "
                 f"MFU {plan['time']['mfu'] * 100:.0f}%")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["make_plan", "plan_inputs", "plan_from_inputs", "format_plan", "plot_plan"]
