"""Step time, throughput and MFU of a layout on an accelerator: the model of docs/planner.md.

Compute: the iteration's model FLOPs (``training/flops.py``, Megatron-LM's formula) split into GEMMs and the
attention core (the ``s/h`` term; causal, so half of it is computed), times ``4/3`` for the layers under full
recompute; each rank does ``1/world`` of it. GEMMs run at ``GEMM_EFFICIENCY`` of the dtype's dense peak (fp8 under
``--fp8-format``), the attention core at ``ATTENTION_EFFICIENCY``; memory-bound work (norms, activations,
residuals, rotary, dropout: ``MEMORY_BOUND_BYTES`` per token and hidden unit, and the optimizer's pass over its
state) at ``MEMORY_EFFICIENCY`` of the HBM bandwidth.

Communication, per rank and step, by algorithm (``n`` ranks in the group, ``B`` bytes): ring all-reduce moves
``2 (n-1)/n B`` in ``2 (n-1)`` steps, reduce-scatter and all-gather ``(n-1)/n B`` in ``n-1``, all-to-all
``(n-1)/n B`` in ``n-1``, p2p ``B`` in one; time = moved / bandwidth + steps x latency, over NVLink when the group
lies inside one node (ranks in the order tp-cp-ep-dp-pp: a group whose span, stride x size, fits
``gpus_per_node``) and over the network otherwise, at ``LINK_EFFICIENCY`` of the link's bandwidth.

Exposed vs overlapped: TP (and SP) collectives are on the critical path; CP's ring exchange hides behind the
attention core; EP all-to-alls are exposed; PP p2p costs its warm-up and cool-down transfers, ``2 (p-1)``; DP
gradient reduction is exposed, or under ``--overlap-grad-reduce`` hides behind the last microbatch's backward
(what does not fit is exposed); the distributed optimizer's parameter all-gather likewise behind the first forward
under ``--overlap-param-gather``; FSDP2's per-microbatch gathers and reduce-scatters behind the microbatch's
compute. The pipeline bubble is ``(p-1)/(v m)`` of the compute.
"""
from __future__ import annotations

from ..model.moe.layer import is_moe_layer
from ..training.flops import num_floating_point_operations

GEMM_EFFICIENCY = 0.70
ATTENTION_EFFICIENCY = 0.45
MEMORY_EFFICIENCY = 0.70
LINK_EFFICIENCY = 0.75
MEMORY_BOUND_BYTES = 60  # per token and hidden unit, forward + backward, one layer (16-bit)


def _moved(kind: str, n: int, nbytes: float) -> tuple[float, int]:
    """(bytes moved per rank, sequential steps) of one collective of ``nbytes`` over ``n`` ranks."""
    if n <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    if kind == "p2p":
        return nbytes, 1
    return (n - 1) / n * nbytes, n - 1  # reduce_scatter, all_gather, all_to_all


def _link(hw, stride: int, n: int) -> tuple[float, float]:
    """(bytes/s, latency) of a group of ``n`` ranks ``stride`` apart."""
    if stride * n <= hw.gpus_per_node:
        return hw.intra_node_gbps * 1e9 * LINK_EFFICIENCY, hw.intra_node_latency_s
    return hw.inter_node_gbps * 1e9 * LINK_EFFICIENCY, hw.inter_node_latency_s


class _Comms:
    """Collectives of one step: bytes per kind and time, per group."""

    def __init__(self, hw):
        self.hw, self.bytes, self.time = hw, {}, {}

    def add(self, group: str, kind: str, n: int, stride: int, nbytes: float, count: float = 1.0) -> float:
        if n <= 1 or count <= 0:
            return 0.0
        moved, steps = _moved(kind, n, nbytes)
        bw, lat = _link(self.hw, stride, n)
        t = count * (moved / bw + steps * lat)
        self.bytes[kind] = self.bytes.get(kind, 0.0) + count * nbytes
        self.time[group] = self.time.get(group, 0.0) + t
        return t


def _compute_dtype(cfg) -> str:
    if cfg.model.precision.fp8:
        return "fp8"
    o = cfg.optim
    return "bf16" if o.bf16 else "fp16" if o.fp16 else "tf32"


def step_time(cfg, hw, state) -> dict:
    """Predicted seconds of one iteration and its breakdown. ``state``: the fullest rank's
    :class:`~megatronish.planner.state.StateBytes` (its gradient and parameter buffers are what DP moves)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    M, p, v, world = cfg.num_microbatches, par.pp, par.vp, par.world_size
    e = 2 if _compute_dtype(cfg) != "tf32" else 4
    flops = num_floating_point_operations(m, t.global_batch_size)
    L = m.num_layers
    q = m.num_attention_heads * m.kv_channels
    attn = 12.0 * t.global_batch_size * s * h * h * L * (s / h) * (q / h)
    full = m.recompute.recompute_granularity == "full"
    layer_share = 1.0 - 6.0 * t.global_batch_size * s * h * m.padded_vocab_size(1) / flops
    recompute = 1.0 + (layer_share / 3 if full else 0.0)
    gemm_s = (flops - attn) * recompute / world / (hw.peak(_compute_dtype(cfg)) * GEMM_EFFICIENCY)
    attn_peak = hw.peak("bf16" if e == 2 else "tf32")
    attn_s = attn / 2 * (4 / 3 if full or m.recompute.recompute_granularity == "selective" else 1.0) / world / (
        attn_peak * ATTENTION_EFFICIENCY)
    tokens_rank = t.global_batch_size * s / (par.dp * par.cp)  # this rank's tokens per step (its DP x CP share)
    mem_bytes = tokens_rank * MEMORY_BOUND_BYTES * h * e / 2 * (L / p) / par.tp
    mem_bytes += 2 * state.total  # the optimizer step reads and writes its state
    mem_s = mem_bytes / (hw.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)
    compute = gemm_s + attn_s + mem_s
    per_mb = compute / M  # one microbatch through this rank's layers, forward + backward
    bubble = (p - 1) / (v * M) * compute if p > 1 else 0.0

    c = _Comms(hw)
    sp = cfg.sequence_parallel
    act = s // par.cp * b * h * e  # one microbatch's hidden states on a rank
    layers_here = L // p
    tp_kind = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    exposed = {}
    per_layer = 6 if full else 4  # forward 2 (SP: 2 all-gathers and 2 reduce-scatters), backward 2, recompute 2
    for kind in tp_kind:
        exposed["tp"] = exposed.get("tp", 0.0) + c.add("tp", kind, par.tp, 1, act, M * layers_here * per_layer)
    if par.cp > 1:
        kv = m.num_query_groups * m.kv_channels
        kv_bytes = 2 * s // par.cp * b * kv / par.tp * e
        ring = c.add("cp", "p2p", par.cp, par.tp, kv_bytes, M * layers_here * 3 * (par.cp - 1))
        exposed["cp"] = max(0.0, ring - attn_s)
    if m.moe.num_experts and par.ep > 1:
        n_moe = sum(is_moe_layer(m, i) for i in range(L)) / p
        a2a = s // par.cp * b * m.moe.moe_router_topk * h * e / par.tp
        exposed["ep"] = c.add("ep", "all_to_all", par.ep, par.expert_tp, a2a, M * n_moe * 4)
    if p > 1:
        p2p = act / (par.tp if sp else 1)
        c.add("pp", "p2p", p, par.tp * par.cp * par.dp, p2p, 2 * M * v)
        bw, lat = _link(hw, par.tp * par.cp * par.dp, p)
        exposed["pp"] = 2 * (p - 1) * (p2p / bw + lat)
    dp_n, dp_stride = par.dp * par.cp, par.tp
    o = cfg.optim
    if cfg.fsdp_active:
        gathered = state.params * e / 4  # 16-bit copies of this rank's full (TP) parameters, per gather
        gathers = 2 if cfg.parallel.pp == 1 or o.fsdp_reshard_after_forward == "always" else 1
        dp = c.add("dp", "all_gather", dp_n, dp_stride, gathered * dp_n, M * gathers)
        dp += c.add("dp", "reduce_scatter", dp_n, dp_stride, state.grads * dp_n, M)
        exposed["dp"] = max(0.0, dp - compute)
    elif dp_n > 1:
        if o.use_distributed_optimizer:
            grad = c.add("dp", "reduce_scatter", dp_n, dp_stride, state.grads)
            gather = c.add("dp", "all_gather", dp_n, dp_stride, state.params)
        else:
            grad, gather = c.add("dp", "all_reduce", dp_n, dp_stride, state.grads), 0.0
        window = per_mb * 2 / 3 if o.overlap_grad_reduce else 0.0  # the last microbatch's backward
        exposed["dp"] = max(0.0, grad - window) + max(0.0, gather - (per_mb / 3 if o.overlap_param_gather else 0))
    step = compute + bubble + sum(exposed.values())
    tokens = t.global_batch_size * s
    tflops = flops / step / world / 1e12
    return {"step_s": step, "tokens_per_s_per_gpu": tokens / step / world, "model_tflops_per_gpu": tflops,
            "mfu": tflops * 1e12 / hw.peak("bf16"), "flops_per_step": flops,
            "breakdown_s": {"gemm": gemm_s, "attention": attn_s, "memory_bound": mem_s, "bubble": bubble,
                            **{f"exposed_{k}": x for k, x in exposed.items()}},
            "comm_s": dict(c.time), "comm_bytes": dict(c.bytes)}


__all__ = ["step_time", "GEMM_EFFICIENCY", "ATTENTION_EFFICIENCY", "MEMORY_EFFICIENCY", "LINK_EFFICIENCY"]
