"""Step time, throughput and MFU of a layout on an accelerator: the model of docs/planner.md.

Compute: the iteration's model FLOPs (``training/flops.py``, Megatron-LM's formula) split into GEMMs and the
attention core (the ``s/h`` term; causal, so half of it is computed). Recompute: selective recompute runs the
attention core's forward again (``+1/3`` of its FLOPs); full recompute one more forward of the recomputed layers
(``+1/3`` of their FLOPs, and of their memory-bound work). Each rank does ``1/world`` of it. GEMMs run at
``GEMM_EFFICIENCY`` of the dtype's dense peak (fp8 under ``--fp8-format``, plus the casts' memory traffic), the
attention core at ``ATTENTION_EFFICIENCY``; memory-bound work (norms, activations, residuals, rotary, dropout:
``MEMORY_BOUND_BYTES`` per token and hidden unit, ``COMPILED_MEMORY_FACTOR`` of it under ``--torch-compile``, and
the optimizer's pass over its state) at ``MEMORY_EFFICIENCY`` of the HBM bandwidth.

Communication: the rank's exact collective list (``planner/comms.py``: every collective of one step, its group,
kind, bytes and count; FSDP2's and, in a search, the DDP buckets' estimated), each priced by algorithm (``n``
ranks, ``B`` bytes): ring all-reduce moves ``2 (n-1)/n B`` in ``2 (n-1)`` steps, reduce-scatter and all-gather
``(n-1)/n B`` in ``n-1``, all-to-all ``(n-1)/n B`` in ``n-1``, p2p and broadcast ``B`` in one; time = moved /
(link x ``LINK_EFFICIENCY``) + steps x latency (an all-reduce takes the faster of the ring and a tree's ``2 B`` in
``2 log2 n`` hops, as NCCL does for small messages). The link: NVLink when the group's ranks (rank order tp-cp-ep-dp-pp,
``comms.group_span``) lie in one node of ``gpus_per_node``, else the network.

Overlap (each collective's ``role``): TP/SP collectives are exposed (``tp_overlap``: asynchronous TP hides the
forward passes' share behind their GEMMs, :func:`tp_forward_share`); the CP ring hides behind the attention core; EP
dispatch is exposed; PP sends are exposed, each rank's own and the ``2 (p-1)`` of the warm-up and cool-down; DP
gradient reduction is exposed, or under ``--overlap-grad-reduce`` hides behind the last microbatch's backward but
for its last bucket; the distributed optimizer's parameter all-gather likewise behind the first microbatch's forward
under ``--overlap-param-gather``; FSDP2's gathers and reduce-scatters behind the compute but each microbatch's first
gather and last reduce-scatter (:func:`fsdp_exposed`); a hidden collective costs the compute ``OVERLAP_COST`` of its
time; everything else (loss, gradient norm, the tied embedding's and SP parameters' gradients, MoE statistics) is
exposed. The pipeline bubble is :func:`bubble_fraction` of the compute (1F1B, interleaved, and the zero-bubble
schedules' own action lists), and the slowest pipeline rank (uneven stages; the loss's logits and MTP depths) sets
the compute (:func:`stage_imbalance`). MLA's head sizes and the MTP depths count in the FLOPs
(``training/flops.py``'s terms).

The efficiencies are the module's constants unless the hardware entry carries its own (``hw.efficiencies``,
fitted per card on published runs: docs/planner.md, "Against published runs").

A measured machine (``cpu-this-machine``: ``hardware.probe_cpu``) carries its rates, not a peak to take a share of:
the GEMMs run at its matmul table's rates at this layout's own shapes (:func:`gemm_shapes`, a FLOP-weighted
harmonic mean), the attention core at its core table's rate (its matmuls, or the CPU flash kernel's) at this
layout's sequence and head size; an attention
core that writes out its score matrix (SDPA's math path, the explicit softmax: ``attention_core_kind``) computes
every score, masked or not, and passes over the matrix elementwise (:data:`SCORE_ACCESSES`); with no fused
kernels the layers' elementwise work is :data:`EAGER_ELEMENTS` (the ops one by one, and the gradients' accumulation
each microbatch) at the probed elementwise rate; dropout masks cost their draws at the probed rate
(``dropout_gelems``; 0 on GPUs: drawn inside the kernel's memory pass); each op the host dispatches costs the
probed framework time (:data:`OPS`; 0 on GPUs, whose launches run ahead of the kernels); gloo's links are probed.
"""
from __future__ import annotations

import functools
import itertools
import math

from ..training.flops import num_floating_point_operations
from .activations import attention_core_path
from .comms import GroupSizes, ddp_estimate, fsdp_estimate, group_span, step_collectives

# defaults for a card without its own efficiencies: one fit over both published stacks (torchtitan's Llama 3.1 8B
# FSDP 8 bf16 and 70B FSDP 32 x TP 8 runs and Megatron-LM's GPT-3 175B); the a-priori values were 0.70, 0.45, 0.70,
# 0.75. benchmarks/hardware/*.toml carry each published card's own, fitted on its own runs.
GEMM_EFFICIENCY = 0.52
ATTENTION_EFFICIENCY = 0.25
MEMORY_EFFICIENCY = 0.50
LINK_EFFICIENCY = 0.90
MEMORY_BOUND_BYTES = 60  # per token and hidden unit, forward + backward, one layer (16-bit)
COMPILED_MEMORY_FACTOR = 0.5  # torch.compile fuses the elementwise chains: about half the traffic is left
FP8_CAST_BYTES = 5  # per element cast to fp8: read 16 bits twice (amax, cast), write 8 bits
EFFICIENCIES = ("GEMM_EFFICIENCY", "ATTENTION_EFFICIENCY", "MEMORY_EFFICIENCY", "LINK_EFFICIENCY")
# Eager (unfused) elementwise work, the CPU path's (no fused kernels): elements read and written per token, forward
# + backward, one GPT layer, counted from its ops. Split by TP: the queries', keys' and values' layout copies and
# scalings, their gradients' assembly, the QKV and projection biases' gradients (34 h), and the MLP's GeLU
# forward and backward and its first bias's gradient (6 ffn; SwiGLU's gate and product: 12 ffn). Split by TP only
# under SP: the two norms, the two dropouts' products and the two residual additions, forward and backward, and
# the second bias's gradient (32 h). Each microbatch also adds every weight's gradient into its accumulator (read
# both, write: 3 per parameter).
EAGER_ELEMENTS = {"tp_h": 34, "tp_ffn": 6, "tp_ffn_swiglu": 12, "sp_h": 32, "grad_accumulation": 3}
# Ops dispatched where the host runs the kernels (``hw.op_overhead_s``): a GPT layer's forward and backward of one
# microbatch, and one step's outside the layers (embedding, loss, optimizer, gradient norm); torch.profiler's count
# of the aten ops of a CPU step (benchmarks/bench_planner.py's base model at 4 and 2 layers: 9,709 and 5,893)
OPS = {"layer": 477, "step": 2077}
# An attention core that writes out its score matrix (``model.attention.attention_core_kind`` "math" or "local":
# torch's SDPA math path, the explicit softmax) reads and writes it elementwise; elements accessed per score, from
# the path's ops. Forward: the mask added (read, write), the softmax (read, write), its fully-masked-row guard
# (test, select: 3); backward: the softmax's (read the output and its gradient, write: 3) and the guard's select
# (2). With attention dropout, forward: the mask drawn (write), scaled (read, write) and applied (read two,
# write), backward applied again (3).
SCORE_ACCESSES = {"forward": 7, "backward": 5, "dropout_forward": 6, "dropout_backward": 3}
# A collective hidden behind compute still costs the compute this share of its time: NCCL's kernels occupy SMs
# (one per channel, 16 to 32 channels on H100) and HBM bandwidth the GEMMs then lack; stated, not fitted.
OVERLAP_COST = 0.2


def ring_moved(kind: str, n: int, nbytes: float) -> tuple[float, int]:
    """(bytes moved per rank, sequential steps) of one collective of ``nbytes`` over ``n`` ranks."""
    if n <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    if kind in ("p2p", "broadcast"):
        return nbytes, 1
    return (n - 1) / n * nbytes, n - 1  # reduce_scatter, all_gather, all_to_all


def link(hw, par, rank: int, group: str, eff: float | None = None, kind: str | None = None) -> tuple[float, float]:
    """(bytes/s, latency) of ``rank``'s group ``group``: NVLink inside one node (``kind``'s own rates where the
    hardware measured them, ``hw.collective_links``), else the network."""
    lo, hi, _ = group_span(par, rank, group)
    eff = LINK_EFFICIENCY if eff is None else eff
    if lo // hw.gpus_per_node == hi // hw.gpus_per_node:
        if kind in hw.collective_links:
            gbps, latency = hw.collective_links[kind]
            return gbps * 1e9 * eff, latency
        return hw.intra_node_gbps * 1e9 * eff, hw.intra_node_latency_s
    return hw.inter_node_gbps * 1e9 * eff, hw.inter_node_latency_s


def price(c, hw, par, rank: int, eff: float | None = None) -> float:
    """Seconds of the ``count`` collectives ``c`` (a ``comms.Collective``) of ``rank``."""
    if c.n <= 1 or not c.count:
        return 0.0
    moved, steps = ring_moved(c.kind, c.n, c.nbytes)
    bw, lat = link(hw, par, rank, c.group, eff, c.kind)
    one = moved / bw + steps * lat
    if c.kind == "all_reduce":  # NCCL's tree for small messages: 2 B over 2 log2(n) hops
        one = min(one, 2 * c.nbytes / bw + 2 * math.ceil(math.log2(c.n)) * lat)
    return c.count * one


def _compute_dtype(cfg) -> str:
    if cfg.model.precision.fp8:
        return "fp8"
    o = cfg.optim
    return "bf16" if o.bf16 else "fp16" if o.fp16 else "tf32"


def collectives(cfg, state, rank: int, expert_params: int = 0) -> list:
    """``rank``'s collectives without its built model (a search): ``comms.step_collectives`` over the layout's
    group sizes, with the DDP buckets (or FSDP2's traffic) estimated from ``state``."""
    colls = step_collectives(cfg, rank, None, GroupSizes(cfg.parallel, rank))
    if cfg.fsdp_active:
        return colls + fsdp_estimate(cfg, state)
    return colls + ddp_estimate(cfg, state, expert_params)


def _recomputed_share(cfg) -> float:
    """The share of a stage's layers that full recompute runs forward twice."""
    rec, par = cfg.model.recompute, cfg.parallel
    if rec.recompute_granularity != "full":
        return 0.0
    if rec.recompute_method == "block":
        per_chunk = cfg.model.num_layers // (par.pp * par.vp)
        return min(1.0, (rec.recompute_num_layers or 1) / per_chunk)
    return 1.0


def attention_core_flops(m, batch_size: int) -> float:
    """Forward + backward FLOPs of the attention core (scores and their product with the values) over every
    layer and MTP depth, unmasked: ``6 B s^2 a (d_qk + d_v)`` a layer (MLA: ``d_qk = d_nope + d_rope``)."""
    a, s = m.num_attention_heads, m.seq_length
    at = m.attention
    head = (at.qk_head_dim + at.qk_pos_emb_head_dim + at.v_head_dim) if at.multi_latent_attention \
        else 2 * m.kv_channels
    return 6.0 * batch_size * s * s * a * head * (m.num_layers + (m.mtp_num_layers or 0))


def bubble_fraction(p: int, v: int, m: int, schedule: str | None) -> float:
    """The pipeline's idle time over its compute: 1F1B ``(p-1)/m``, interleaved ``(p-1)/(v m)``; the zero-bubble
    schedules' from replaying their own action lists with equal forward, backward-input and backward-weight steps
    (``parallel/pipeline/zero_bubble.simulate``: ``(p-1)/(3m)`` for ``zb-h1`` and ``(p-1)/(6m)`` for ``zbv`` when
    ``p`` divides ``m``, the zero-bubble paper's figures, more otherwise), those closed forms beyond 20,000
    chunk-microbatch steps."""
    if p == 1:
        return 0.0
    if schedule in ("zb-h1", "zbv"):
        if m * p * (2 if schedule == "zbv" else 1) <= 20000:
            return _zero_bubble_fraction(schedule, p, m)
        return (p - 1) / m / (3 if schedule == "zb-h1" else 6)
    return (p - 1) / m / v


@functools.lru_cache(maxsize=64)
def _zero_bubble_fraction(schedule: str, p: int, m: int) -> float:
    from ..parallel.pipeline.zero_bubble import num_chunks, schedule_actions, simulate, stage_of

    lists = schedule_actions(schedule, p, m)
    return simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * num_chunks(schedule),
                    {"F": 1, "B": 1, "W": 1})["bubble"]


def stage_imbalance(cfg, output_share: float) -> float:
    """The slowest pipeline rank's compute over the mean rank's: each rank's layers (``ParallelDims`` gives the
    uneven first and last ranks' own numbers) plus, on the rank holding the loss, the output layers (``output_share``
    of the FLOPs), and the MTP depths' layers (counted as layers) on that rank or on a standalone MTP stage's."""
    par, m = cfg.parallel, cfg.model
    if par.pp == 1:
        return 1.0
    L, D = m.num_layers, m.mtp_num_layers or 0
    layers = [par.rank_num_layers(L, r) for r in range(par.pp)]
    per_layer = (1.0 - output_share) / (L + D)
    work = [(n + (D if r == par.mtp_pp_rank else 0)) * per_layer + (output_share if r == par.loss_pp_rank else 0.0)
            for r, n in enumerate(layers)]
    return max(work) * par.pp / sum(work)


def tp_forward_share(cfg) -> float:
    """The share of a step's TP collectives issued by forward passes (the backward issues as many as the forward,
    full recompute's second forward runs inside the backward): asynchronous TP micro-pipelines only these."""
    return 1.0 / (2.0 + _recomputed_share(cfg))


def fsdp_exposed(cfg, fsdp_s: float, compute: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of FSDP2's ``fsdp_s`` of gathers and reduce-scatters: each microbatch's first
    unit's gather (nothing runs before it) and last unit's reduce-scatter (the backward waits for it) are exposed,
    one unit's share each (a stage's units: its layers, the embedding and the output layer); the rest hides behind
    the compute, and what exceeds it is exposed."""
    if not fsdp_s:
        return 0.0, 0.0
    m, p = cfg.model, cfg.parallel.pp
    units = (m.num_layers + (m.mtp_num_layers or 0)) / p + 2
    edge = 2 * fsdp_s / units if cfg.num_microbatches else 0.0
    edge = min(edge, fsdp_s)
    hidden = min(fsdp_s - edge, compute)
    return fsdp_s - hidden, hidden


def table_tflops(table: dict, *sizes: int) -> float:
    """TFLOP/s at ``sizes`` from a measured ``{"a,b,...": TFLOP/s}`` table over a grid (its keys' values, a tuple
    of points a size: ``hardware.GEMM_GRID`` for each of a matmul's ``m, k, n``, ``hardware.CORE_GRID``): the log
    of the rate interpolated linearly in each size's log between the grid points around it (clamped to the grid's
    ends)."""
    keys = [tuple(int(x) for x in k.split(",")) for k in table]
    grid = [sorted({k[i] for k in keys}) for i in range(len(sizes))]
    corners = []
    for x, points in zip(sizes, grid):
        logs = [math.log(g) for g in points]
        lx = min(max(math.log(max(x, 1)), logs[0]), logs[-1])
        i = max(j for j in range(len(logs) - 1) if logs[j] <= lx) if lx < logs[-1] else len(logs) - 2
        w = (lx - logs[i]) / (logs[i + 1] - logs[i])
        corners.append(((points[i], 1.0 - w), (points[i + 1], w)))
    out = 0.0
    for corner in itertools.product(*corners):
        weight = math.prod(w for _, w in corner)
        if weight:
            out += weight * math.log(table[",".join(str(g) for g, _ in corner)])
    return math.exp(out)


def gemm_shapes(cfg) -> list:
    """The layers' and output layer's GEMMs of one microbatch on one rank: ``(m, k, n, weight)`` of each forward
    matmul and of its two backward ones (``dX = dY W^T``: ``m, n, k``; ``dW = X^T dY``: ``k, m, n``), ``weight``
    its count per layer (-1: once, the output layer). The linears: QKV, projection, the MLP's two (a routed
    expert's at its tokens: the top-k share of them), each split by TP."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * m.seq_length // par.cp
    h, tp, d = m.hidden_size, par.tp, m.kv_channels or 1
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    ffn, mtok = m.ffn_hidden_size, tokens
    if m.moe.num_experts:
        ffn = m.moe.moe_ffn_hidden_size or ffn
        mtok = max(1, tokens * m.moe.moe_router_topk // m.moe.num_experts)
    up = ffn * (2 if m.swiglu else 1)
    fwd = [(tokens, h, (heads + 2 * groups) * d // tp, 1), (tokens, heads * d // tp, h, 1),
           (mtok, h, up // tp, 1), (mtok, ffn // tp, h, 1), (tokens, h, m.padded_vocab_size(tp) // tp, -1)]
    return [x for a, b, c, w in fwd for x in ((a, b, c, w), (a, c, b, w), (b, a, c, w))]


def measured_tflops(hw, dtype: str, shapes: list, layers: float) -> float | None:
    """The FLOP-weighted (harmonic) mean TFLOP/s of ``shapes`` (:func:`gemm_shapes`' ``(m, k, n, weight)``, a
    weight of -1 once, the others ``layers`` times) from ``hw.gemm_tflops``; None without a table."""
    table = hw.measured("", dtype)
    if not table:
        return None
    flops = seconds = 0.0
    for a, b, c, w in shapes:
        f = 2.0 * a * b * c * (1.0 if w < 0 else w * layers)
        flops += f
        seconds += f / table_tflops(table, a, b, c)
    return flops / seconds


def core_tflops(hw, dtype: str, cfg, kind: str) -> float | None:
    """The attention core's TFLOP/s from ``hw.gemm_tflops``' ``core_<dtype>`` table (its matmuls; the ``flash_``
    table for a flash ``kind``) at this layout's sequence (its CP share) and head size (MLA: the query/key
    head's); None without a table."""
    table = hw.measured("flash_" if kind == "flash" else "core_", dtype)
    if not table:
        return None
    m = cfg.model
    at = m.attention
    d = at.qk_head_dim + at.qk_pos_emb_head_dim if at.multi_latent_attention else (m.kv_channels or 1)
    return table_tflops(table, m.seq_length // cfg.parallel.cp, d)


def _eager_bytes(cfg, tokens: float, e: int) -> float:
    """One layer's eager elementwise bytes on one rank for ``tokens`` of its tokens (:data:`EAGER_ELEMENTS`)."""
    m, tp = cfg.model, cfg.parallel.tp
    a = EAGER_ELEMENTS
    ffn = a["tp_ffn_swiglu" if m.swiglu else "tp_ffn"] * m.ffn_hidden_size
    per_token = (a["tp_h"] * m.hidden_size + ffn) / tp + a["sp_h"] * m.hidden_size / (tp if cfg.sequence_parallel
                                                                                        else 1)
    return tokens * per_token * e


def _scores_and_draws(cfg, scores: bool, tokens_rank: float, again: float, attn_again: float,
                      e: int) -> tuple[float, float]:
    """(bytes, dropout-mask elements) of one step on one rank beyond the layers' ``MEMORY_BOUND_BYTES``: the score
    matrix's elementwise passes where the core writes it out (:data:`SCORE_ACCESSES` of ``e`` bytes each, the
    forward's again under recompute), and the dropout masks drawn (the scores' under attention dropout, two of
    ``h`` per token and layer under hidden dropout, SP's share of them, and the embedding's)."""
    m, par = cfg.model, cfg.parallel
    layers = (m.num_layers + (m.mtp_num_layers or 0)) / par.pp
    n_scores = tokens_rank * m.seq_length / par.cp * m.num_attention_heads / par.tp * layers if scores else 0.0
    p_attn = m.attention.attention_dropout if scores else 0.0
    a = SCORE_ACCESSES
    fwd = a["forward"] + (a["dropout_forward"] if p_attn else 0)
    bwd = a["backward"] + (a["dropout_backward"] if p_attn else 0)
    redo = 3 * attn_again  # the core's forward again: selective recompute, full recompute's share
    score_bytes = n_scores * (fwd * (1 + redo) + bwd) * e
    draws = n_scores * (1 + redo) if p_attn else 0.0
    if m.hidden_dropout:
        sp = par.tp if cfg.sequence_parallel else 1
        draws += tokens_rank * m.hidden_size / sp * (2 * layers * (1 + again) + (1 if par.pp == 1 else 0))
    return score_bytes, draws


def step_time(cfg, hw, state, colls=None, rank: int | None = None, *, tp_overlap: bool = False,
              efficiencies: dict | None = None) -> dict:
    """Predicted seconds of one iteration and its breakdown. ``state``: the fullest rank's
    :class:`~megatronish.planner.state.StateBytes`; ``colls``: that rank's collectives (``comms.step_collectives``
    over its built model), else estimated (:func:`collectives`); ``rank``: that rank (default: the first rank of
    the last stage). The efficiencies: the module's constants, then the hardware entry's own
    (``hw.efficiencies``), then ``efficiencies`` by name (a fit). ``tp_overlap``: asynchronous TP, which hides the
    forward passes' TP collectives behind their GEMMs (:func:`tp_forward_share`)."""
    eff = {k: globals()[k] for k in EFFICIENCIES}
    eff.update(getattr(hw, "efficiencies", None) or {})
    eff.update(efficiencies or {})
    m, par, t = cfg.model, cfg.parallel, cfg.train
    s, h = m.seq_length, m.hidden_size
    M, p, v, world = cfg.num_microbatches, par.pp, par.vp, par.world_size
    rank = par.rank_of(pp=p - 1) if rank is None else rank
    if colls is None:
        colls = collectives(cfg, state, rank)
    dtype = _compute_dtype(cfg)
    e = 2 if dtype != "tf32" else 4
    gbs, D = t.global_batch_size, m.mtp_num_layers or 0
    flops = num_floating_point_operations(m, gbs)  # MLA's and the MTP depths' terms included
    L = m.num_layers
    attn = attention_core_flops(m, gbs)  # the core's full (unmasked) forward + backward
    again = _recomputed_share(cfg)
    logits = 6.0 * gbs * s * h * m.padded_vocab_size(1) * (1 + D)
    layer_share = 1.0 - logits / flops
    gemm_rate = measured_tflops(hw, dtype, gemm_shapes(cfg), (L + D) / p)
    gemm_rate = gemm_rate * 1e12 if gemm_rate else hw.peak(dtype) * eff["GEMM_EFFICIENCY"]
    gemm_s = (flops - attn) * (1.0 + layer_share * again / 3) / world / gemm_rate
    attn_again = 1 / 3 if again or m.recompute.recompute_granularity == "selective" else 0.0
    attn_dtype = "bf16" if e == 2 else "tf32"
    kind = attention_core_path(cfg, cpu=hw.device == "cpu")
    core_rate = core_tflops(hw, attn_dtype, cfg, kind)
    core_rate = core_rate * 1e12 if core_rate else hw.peak(attn_dtype) * eff["ATTENTION_EFFICIENCY"]
    scores = kind != "flash"  # the score matrix written out: every score computed, the masked ones too
    attn_s = attn * (1.0 if scores else 0.5) * (1 + attn_again) / world / core_rate
    slowest = stage_imbalance(cfg, logits / flops)
    tokens_rank = t.global_batch_size * s / (par.dp * par.cp)  # this rank's tokens per step (its DP x CP share)
    per_token = MEMORY_BOUND_BYTES * e / 2 * (1 + again / 3)
    if cfg.train.torch_compile:
        per_token *= COMPILED_MEMORY_FACTOR
    if dtype == "fp8":  # each GEMM's input and output gradient cast: ~3 (h + h + h + ffn) elements a token, twice
        per_token += FP8_CAST_BYTES * 2 * (3 + m.ffn_hidden_size / h) * (1 + again / 3)
    layer_bytes = tokens_rank * per_token * h * ((L + D) / p) / par.tp
    accumulate = 0.0
    if hw.device == "cpu":  # no fused kernels: the layers' elementwise ops one by one
        layer_bytes = _eager_bytes(cfg, tokens_rank, e) * (1 + again / 3) * ((L + D) / p)
        accumulate = EAGER_ELEMENTS["grad_accumulation"] * 4 * state.num_params * M  # fp32 accumulators
    score_bytes, draws = _scores_and_draws(cfg, scores, tokens_rank, again, attn_again, e)
    mem_s = (layer_bytes * slowest + score_bytes * slowest + 2 * state.total + accumulate) / \
        (hw.hbm_tbps * 1e12 * eff["MEMORY_EFFICIENCY"])
    dropout_s = draws * slowest / (hw.dropout_gelems * 1e9) if hw.dropout_gelems else 0.0
    gemm_s, attn_s = gemm_s * slowest, attn_s * slowest  # (the optimizer step reads and writes its state)
    overhead_s = hw.op_overhead_s * (OPS["layer"] * (L + D) / p * M + OPS["step"])
    compute = gemm_s + attn_s + mem_s + dropout_s + overhead_s
    per_mb = compute / M  # one microbatch through this rank's layers, forward + backward
    bubble = bubble_fraction(p, v, M, par.pipeline_schedule) * compute
    share = hw.rank_share
    if share < 1.0:  # ranks share cores: the critical path at a whole core each, or the cores' total work
        bubble = max(0.0, (compute + bubble) * share - compute)

    by_role: dict[str, float] = {}
    count: dict[str, float] = {}
    comm_s: dict[str, float] = {}
    comm_bytes: dict[str, float] = {}
    for c in colls:
        x = price(c, hw, par, rank, eff["LINK_EFFICIENCY"])
        by_role[c.role] = by_role.get(c.role, 0.0) + x
        count[c.role] = count.get(c.role, 0.0) + c.count
        comm_s[c.group] = comm_s.get(c.group, 0.0) + x
        if c.n > 1:
            comm_bytes[c.kind] = comm_bytes.get(c.kind, 0.0) + c.nbytes * c.count
    o = cfg.optim
    exposed = {}
    tp = by_role.get("tp", 0.0)
    hidden = {"tp": min(tp * tp_forward_share(cfg), gemm_s) if tp_overlap else 0.0}
    exposed["tp"] = tp - hidden["tp"]
    exposed["cp"] = max(0.0, by_role.get("cp_ring", 0.0) - attn_s)
    exposed["ep"] = by_role.get("ep", 0.0)
    if p > 1:
        pp = [c for c in colls if c.role == "pp_p2p"]
        one = price(pp[0], hw, par, rank, eff["LINK_EFFICIENCY"]) / pp[0].count if pp else 0.0
        exposed["pp"] = by_role.get("pp_p2p", 0.0) + 2 * (p - 1) * one
    grad, gather = by_role.get("grad_reduce", 0.0), by_role.get("param_gather", 0.0)
    last_bucket = grad / count["grad_reduce"] if grad else 0.0
    first_bucket = gather / count["param_gather"] if gather else 0.0
    exposed["dp"] = (max(grad - per_mb * 2 / 3, last_bucket) if o.overlap_grad_reduce else grad) + \
        (max(gather - per_mb / 3, first_bucket) if o.overlap_param_gather else gather)
    hidden["dp"] = grad + gather - exposed["dp"]
    fsdp, hidden["fsdp"] = fsdp_exposed(cfg, by_role.get("fsdp", 0.0), compute)
    exposed["dp"] += fsdp
    hidden["cp"] = by_role.get("cp_ring", 0.0) - exposed["cp"]
    exposed["other"] = by_role.get("exposed", 0.0)
    exposed["overlap"] = OVERLAP_COST * sum(hidden.values())  # what hidden collectives cost the compute
    exposed = {k: x for k, x in exposed.items() if x}
    step = compute + bubble + sum(exposed.values())
    tokens = t.global_batch_size * s
    tflops = flops / step / world / 1e12
    return {"step_s": step, "tokens_per_s_per_gpu": tokens / step / world, "model_tflops_per_gpu": tflops,
            "mfu": tflops * 1e12 / hw.peak("bf16"), "flops_per_step": flops,
            "breakdown_s": {"gemm": gemm_s, "attention": attn_s, "memory_bound": mem_s,
                            **({"dropout_draws": dropout_s} if dropout_s else {}),
                            **({"op_overhead": overhead_s} if overhead_s else {}), "bubble": bubble,
                            **{f"exposed_{k}": x for k, x in exposed.items()}},
            "comm_s": comm_s, "comm_by_role_s": by_role, "comm_bytes": comm_bytes}


__all__ = ["step_time", "collectives", "price", "link", "ring_moved", "attention_core_flops", "bubble_fraction",
           "stage_imbalance", "tp_forward_share", "fsdp_exposed", "OVERLAP_COST", "GEMM_EFFICIENCY",
           "ATTENTION_EFFICIENCY", "MEMORY_EFFICIENCY", "LINK_EFFICIENCY", "EFFICIENCIES"]
