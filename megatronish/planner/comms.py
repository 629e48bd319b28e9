"""Every collective one rank issues in one training step (after the first: the pipeline's one-time readiness
all-reduce is not counted), counted from the layout and the rank's model built on the meta device.

Bytes per collective, the convention of ``bytes_by_kind`` and of the step-time model: an all-reduce, broadcast,
reduce-scatter or all-to-all moves its whole input (``B``), an all-gather its whole output (``n x`` the piece), a
point-to-point exchange the bytes this rank sends. Kinds: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``, ``broadcast``, ``p2p``.

What one step issues (``M`` microbatches of ``b`` sequences of ``s / cp`` tokens, ``e`` bytes an activation):

- TP, per microbatch and layer: without SP 4 all-reduces of ``[s, b, h]`` (a MoE layer 2: its MLP is the
  experts'), with SP 2 all-gathers and 2 reduce-scatters (MoE layer: 1 and 1) forward and as many backward; full
  recompute repeats the forward's; the first stage adds the embedding's (and under SP with learned positions the
  position embedding's backward all-gather), the loss stage (the last; pipeline rank 0 under ``zbv`` and
  ``dualpipev``, whose V holds the first and the last stage there) the output layer's and the vocabulary-parallel cross
  entropy's two fp32 all-reduces (``s b`` and ``2 s b`` floats); under SP one all-reduce per model chunk of the
  gradients of the parameters every TP rank holds whole (norms, biases), in the gradient buffer's dtype.
- CP (the p2p ring), per microbatch and layer: ``cp - 1`` K/V exchanges forward and backward (again under
  recompute) and ``cp`` fp32 dK/dV exchanges backward (:func:`ring_kv_elements`: under multi-latent attention
  every head's key and value, padded to one head size); the loss stage adds one 4-byte all-reduce per
  microbatch.
- EP (the all-gather dispatcher over expert-TP x EP), per MoE layer and microbatch: the routing map (bytes), the
  probabilities and the hidden states all-gathered, the hidden states reduce-scattered (forward), the probabilities
  and hidden states reduce-scattered and the hidden states all-gathered (backward); once a step the MoE metrics'
  all-reduces. The all-to-all dispatcher: its four all-to-alls of the routed copies per layer (an estimate: the
  copies' split depends on the routing).
- PP: each activation or gradient sent between stages (1F1B: ``M`` forward sends from every stage but the last and
  ``M`` backward sends from every stage but the first; interleaved: per model chunk; in a V none between rank
  ``p-1``'s two chunks: :func:`pipeline_sends`), the loss broadcast, the tied
  embedding's gradient all-reduce between the first and last stages.
- DP: every gradient bucket the rank's DDP built (all-reduce, or reduce-scatter and the parameter all-gather
  under the distributed optimizer), over DP x CP or the expert-DP group; the loss all-reduce of the loss stage.
- The optimizer's gradient norm (model-parallel, or world under the distributed optimizer, FSDP2 and fp16) and
  fp16's overflow check; the rerun check's world all-reduce of four flags (``--rerun-mode`` other than
  ``disabled``), or else the NaN check's of two.

FSDP2's own gathers and reduce-scatters run inside torch (``fully_shard``): ``fsdp_collectives`` estimates them
from its sharding rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.moe.layer import is_moe_layer
from ..model.moe.stats import LOSS_NAMES, loss_names

KIND_OF = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
           "all_to_all_single": "all_to_all"}


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``kind`` on the group ``group`` (a parallel-context kind) of ``n`` ranks, each
    moving ``nbytes`` (module docstring's convention). ``role`` says what the step-time model may hide it behind
    (``ROLES``)."""

    group: str
    kind: str
    n: int
    nbytes: float
    count: float = 1.0
    role: str = "exposed"


# what each collective is, for the step-time model's overlap rules (planner/perf.py)
ROLES = ("tp", "cp_ring", "ep", "pp_p2p", "grad_reduce", "param_gather", "fsdp", "exposed")


def bytes_by_kind(colls) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in colls:
        if c.n > 1 and c.count:
            out[c.kind] = out.get(c.kind, 0.0) + c.nbytes * c.count
    return out


def _size(ctx, kind: str) -> int:
    return len(ctx.ranks(kind)) or 1


def _tp_layer_counts(cfg, moe: bool) -> tuple[int, int]:
    """(all-reduces without SP, all-gathers = reduce-scatters with SP) of one layer, one microbatch."""
    full = cfg.model.recompute.recompute_granularity == "full"
    base = 1 if moe else 2  # forward: attention (and the dense MLP)
    return base * (2 + full), base * (2 + full)


def step_collectives(cfg, rank: int, chunks, ctx) -> list[Collective]:
    """Every collective of ``rank`` in one step (module docstring). ``chunks``: the rank's model chunks wrapped by
    the run's DDP (``wrap_model_chunks`` over the meta model; None under FSDP2); ``ctx``: its fake context."""
    m, par, o = cfg.model, cfg.parallel, cfg.optim
    coords = par.coords(rank)
    p, v, M = par.pp, par.vp, cfg.num_microbatches
    # the first stage (embedding) is on pipeline rank 0; the loss stage on ``loss_pp_rank`` (rank 0 in a V)
    first, last = coords["pp"] == 0, coords["pp"] == par.loss_pp_rank
    s, b, h = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size
    e = 4 if o.params_dtype.itemsize == 4 else 2
    sp, tp = cfg.sequence_parallel, par.tp
    layers = [i for c in range(v) for i in par.layer_range(m.num_layers, coords["pp"], c)]
    # the MTP depths' layers sit on a standalone MTP stage's rank, else with the loss; their outputs' logits and
    # losses are always the loss stage's
    depths = (m.mtp_num_layers or 0) if coords["pp"] == par.mtp_pp_rank else 0
    outputs = (m.mtp_num_layers or 0) if last else 0
    n_moe = sum(is_moe_layer(m, i) for i in layers) if m.moe.num_experts else 0
    if depths and m.moe.num_experts and is_moe_layer(m, m.num_layers - 1):  # MTP's layers: MoE as the last one
        n_moe += depths
    n_dense = len(layers) + depths - n_moe
    full = m.recompute.recompute_granularity == "full"
    out: list[Collective] = []

    def add(group, kind, nbytes, count=1.0, n=None, role=None):
        n = _size(ctx, group) if n is None else n
        if n > 1 and count:
            role = role or {"tp": "tp", "ep": "ep", "tp_ep": "ep"}.get(group, "exposed")
            out.append(Collective(group, kind, n, float(nbytes), float(count), role))

    act = s * b * h * e
    if tp > 1:
        per_mb = sum(_tp_layer_counts(cfg, moe)[sp] * k for moe, k in ((False, n_dense), (True, n_moe)))
        # each MTP depth: its look-up of the shifted tokens (the vocabulary-parallel embedding's, as the first
        # stage's), eh_proj's [., 2h] input (column-parallel) and its output gathered over TP; each depth's output
        # layer and cross entropy (as the decoder's, on the loss stage)
        if sp:
            ag = rs = per_mb
            if first:
                rs += 1
                ag += 1 + (m.attention.position_embedding_type == "learned_absolute")
            if last:
                ag += 1 + outputs
                rs += 1 + outputs
            ag += 3 * depths  # the look-up's backward, eh_proj's output gathered, its scatter's backward
            rs += depths  # the look-up
            add("tp", "all_gather", act, M * ag)
            add("tp", "reduce_scatter", act, M * rs)
            add("tp", "all_gather", 2 * act, M * depths)  # eh_proj's input
            add("tp", "reduce_scatter", 2 * act, M * depths)  # and its gradient
        else:
            add("tp", "all_reduce", act, M * (per_mb + first + last + outputs + depths))
            add("tp", "all_reduce", 2 * act, M * depths)  # eh_proj's input gradient
            add("tp", "all_gather", act, M * depths)  # eh_proj's output
        if last:
            add("tp", "all_reduce", s * b * 4, M * (1 + outputs))
            add("tp", "all_reduce", 2 * s * b * 4, M * (1 + outputs))
    if par.cp > 1:
        n = par.cp
        kv = ring_kv_elements(cfg)
        again = full or m.recompute.recompute_granularity == "selective"
        add("cp", "p2p", kv * e, M * len(layers) * (n - 1) * (2 + again), role="cp_ring")
        add("cp", "p2p", kv * 4, M * len(layers) * n, role="cp_ring")
        if last:
            add("cp", "all_reduce", 4, M)
    if n_moe:
        _moe(cfg, ctx, add, s, b, h, e, M, n_moe, full, p, layers, depths)
    if p > 1:
        pipe = act // (tp if sp else 1)
        for blocks, sends in sorted(pipeline_send_blocks(par, coords["pp"]).items()):
            add("pp", "p2p", pipe * blocks, M * sends, role="pp_p2p")
        add("pp", "broadcast", 8, 1 + (m.mtp_num_layers or 0))  # the loss, and each MTP depth's
    if last and _size(ctx, "dp_cp") > 1:
        add("dp_cp", "all_reduce", 8 * (1 + depths))  # (each MTP depth's loss and token count)
    if chunks is not None:
        _ddp(cfg, ctx, chunks, add)
    _optimizer(cfg, ctx, add, n_moe_model=bool(m.moe.num_experts))
    if getattr(cfg.train, "rerun_mode", "disabled") != "disabled":  # the rerun check's four flags
        add("world", "all_reduce", 16, n=par.world_size)
    elif cfg.train.check_for_nan_in_loss_and_grad:
        add("world", "all_reduce", 8, n=par.world_size)
    return out


def ring_kv_elements(cfg) -> int:
    """Elements of the K/V block one CP ring step sends (``parallel/context_parallel.py``'s ``torch.stack([k,
    v])``, one microbatch and layer): ``2 b g s d`` with ``g`` the rank's key/value heads and ``d`` their size;
    under multi-latent attention every head has its own key and value, both padded to one head size,
    ``max(d_nope + d_rope, d_v)`` (``model/mla.py``)."""
    m, par = cfg.model, cfg.parallel
    s, b, at = m.seq_length // par.cp, cfg.train.micro_batch_size, m.attention
    if at.multi_latent_attention:
        heads, d = m.num_attention_heads, max(at.qk_head_dim + at.qk_pos_emb_head_dim, at.v_head_dim)
    else:
        heads, d = m.num_query_groups, m.kv_channels
    return 2 * b * (heads // par.tp) * s * d


def pipeline_sends(par, pp_rank: int) -> int:
    """Activations and gradients pipeline rank ``pp_rank`` sends per microbatch: each local chunk's forward output
    unless its stage is the last, and its input gradient unless its stage is the first, when the neighbouring
    stage is on another rank (in a V, rank ``p-1`` hands stage ``p-1``'s output to its own stage ``p``)."""
    return sum(pipeline_send_blocks(par, pp_rank).values())


def pipeline_send_blocks(par, pp_rank: int) -> dict:
    """:func:`pipeline_sends` by size: ``{[s, b, h] blocks a message carries: sends per microbatch}``. From a
    standalone MTP stage on the messages carry ``1 + D`` blocks along the sequence (``ParallelDims.
    stage_message_blocks``): a forward send its own stage's output, a gradient its input's (the stage before's
    output)."""
    n, out = par.pp * par.vp, {}
    for c in range(par.vp):
        st = par.stage_of(pp_rank, c)
        for to, blocks in ((st + 1, par.stage_message_blocks(st)), (st - 1, par.stage_message_blocks(st - 1))):
            if 0 <= to < n and par.place_stage(to)[0] != pp_rank:
                out[blocks] = out.get(blocks, 0) + 1
    return out


def rank_collectives(cfg, rank: int) -> list[Collective]:
    """:func:`step_collectives` of ``rank``, its model built on the meta device (``state.build_rank``)."""
    from .state import build_rank

    built = build_rank(cfg, rank)
    return step_collectives(cfg, rank, built.chunks, built.ctx)


# the axes each group kind varies along: the dense grid (tp, cp, dp, pp) or the expert grid (etp, ep, edp, pp)
_DENSE = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("cp", "dp"), "cp": ("cp",), "mp": ("tp", "pp"),
          "tp_dp": ("tp", "dp"), "tp_dp_cp": ("tp", "cp", "dp"), "tp_cp": ("tp", "cp")}
_EXPERT = {"ep": ("ep",), "expert_dp": ("edp",), "etp": ("etp",), "tp_ep": ("etp", "ep"),
           "expert_mp": ("etp", "ep", "pp")}


def group_span(par, rank: int, group: str) -> tuple[int, int, int]:
    """(lowest rank, highest rank, size) of ``rank``'s group ``group``, by rank arithmetic (order tp-cp-ep-dp-pp;
    the same groups as ``ParallelDims.group_of`` without listing every group of the world)."""
    if group == "world":
        return 0, par.world_size - 1, par.world_size
    c = par.coords(rank)
    stage = par.world_size // par.pp
    if group in ("embedding", "position_embedding"):
        first = rank - c["pp"] * stage
        ends = c["pp"] in (0, par.pp - 1) and group == "embedding" and par.tie_embeddings and par.pp > 1 \
            and not par.v_shape  # in a V both ends are on pipeline rank 0
        return (first, first + (par.pp - 1) * stage, 2) if ends else (rank, rank, 1)
    names, sizes = (("tp", "cp", "dp", "pp"), par._sizes) if group in _DENSE else \
        (("etp", "ep", "edp", "pp"), par._expert_sizes)
    axes = (_DENSE.get(group) or _EXPERT[group])
    stride, lo, width, n = 1, rank, 0, 1
    for name, size in zip(names, sizes):
        if name in axes:
            lo -= c[name] * stride
            width += (size - 1) * stride
            n *= size
        stride *= size
    return lo, lo + width, n


class GroupSizes:
    """What :func:`step_collectives` reads of a context (its groups' sizes) from rank arithmetic alone: a layout
    search prices thousands of layouts without building their contexts."""

    def __init__(self, par, rank: int):
        self.par, self.rank = par, rank

    def ranks(self, group: str) -> range:
        lo, hi, n = group_span(self.par, self.rank, group)
        return range(n)


def ddp_estimate(cfg, state, expert_params: int = 0) -> list[Collective]:
    """The DDP buckets' collectives of a rank whose state is ``state`` without building its DDP: the gradient
    buffer (all-reduce, or reduce-scatter and the parameter buffer's all-gather under the distributed optimizer)
    cut into buckets of ``--ddp-bucket-size`` (Megatron's default), experts' share over expert-DP."""
    from ..parallel.ddp import default_bucket_size

    o, par = cfg.optim, cfg.parallel
    n = max(state.num_params, 1)
    dp_cp = par.dp * par.cp
    out = []
    for group, world, share in (("dp_cp", dp_cp, n - expert_params), ("expert_dp", par.expert_dp, expert_params)):
        if world <= 1 or share <= 0:
            continue
        size = o.ddp_bucket_size or default_bucket_size(world, o.overlap_grad_reduce) or share
        buckets = max(1, -(-share // size))
        grad = state.grads * share / n / buckets
        kind = "reduce_scatter" if o.use_distributed_optimizer else "all_reduce"
        out.append(Collective(group, kind, world, grad, buckets, "grad_reduce"))
        if o.use_distributed_optimizer:
            out.append(Collective(group, "all_gather", world, state.params * share / n / buckets, buckets,
                                  "param_gather"))
    return out


def fsdp_estimate(cfg, state) -> list[Collective]:
    """FSDP2's gathers and reduce-scatters (they run inside torch): per microbatch the 16-bit (or fp32) copy of the
    rank's TP slice gathered for the forward and again for the backward (once under PP, where units stay gathered
    between them), and the fp32 gradients reduce-scattered."""
    par, o = cfg.parallel, cfg.optim
    n, M = par.dp * par.cp, cfg.num_microbatches
    e = o.params_dtype.itemsize
    gathers = 2 if par.pp == 1 or o.fsdp_reshard_after_forward == "always" else 1
    return [Collective("dp_cp", "all_gather", n, state.params * e / 4 * n, M * gathers, "fsdp"),
            Collective("dp_cp", "reduce_scatter", n, state.grads * n, M, "fsdp")]


def _moe(cfg, ctx, add, s, b, h, e, M, n_moe, full, p, layers, depths) -> None:
    m, par = cfg.model, cfg.parallel
    E = m.moe.num_experts
    T = s * b // (par.tp if cfg.sequence_parallel else 1)  # this rank's tokens entering the router
    n = _size(ctx, "tp_ep")  # expert-TP x EP
    reps = M * n_moe
    fwd = 2 if full else 1
    if m.moe.moe_token_dispatcher_type == "allgather":
        add("tp_ep", "all_gather", T * E * n, reps * fwd, n=n)  # the routing map, bytes
        add("tp_ep", "all_gather", T * E * e * n, reps * fwd, n=n)
        add("tp_ep", "all_gather", T * h * e * n, reps * (fwd + 1), n=n)
        add("tp_ep", "reduce_scatter", T * h * e * n, reps * (fwd + 1), n=n)
        add("tp_ep", "reduce_scatter", T * E * e * n, reps, n=n)
    else:
        k = m.moe.moe_router_topk
        add("ep", "all_to_all", T * k * h * e, reps * 2 * (fwd + 1))
    nl = m.num_layers
    if p > 1:
        for shape in (len(loss_names(m)) * nl, nl * E, nl * 2):
            add("pp", "all_reduce", 4 * shape)
    seq, every = _size(ctx, "tp_cp"), _size(ctx, "tp_dp_cp")
    for name in loss_names(m):
        if name == LOSS_NAMES["global_aux_loss"]:
            add("tp_dp_cp", "all_reduce", 4 * nl, n=every)
            continue
        add("tp_cp", "all_reduce", 4 * nl, n=seq)
        add("dp", "all_reduce", 4 * nl)
    add("tp_dp_cp", "all_reduce", 4 * nl * E, n=every)
    add("tp_dp_cp", "all_reduce", 4 * nl * 2, n=every)
    if m.moe.moe_router_enable_expert_bias:
        here = sum(is_moe_layer(m, i) for i in layers) + (depths if is_moe_layer(m, m.num_layers - 1) else 0)
        add("tp_dp_cp", "all_reduce", 4 * here * E, n=every)


def _ddp(cfg, ctx, chunks, add) -> None:
    dist_opt = cfg.optim.use_distributed_optimizer
    for chunk in chunks:
        module = chunk.module
        if cfg.sequence_parallel:
            n_sp = sum(q.numel() for q in module.parameters() if getattr(q, "sequence_parallel", False))
            if n_sp:
                add("tp", "all_reduce", n_sp * chunk.grad_buffer.element_size())
        for bucket in chunk.buckets:
            if bucket.world == 1:
                continue
            group = "dp_cp" if bucket.group is ctx.dp_cp_group else "expert_dp"
            nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
            add(group, "reduce_scatter" if dist_opt else "all_reduce", nbytes, n=bucket.world, role="grad_reduce")
            if dist_opt:
                pb = bucket.param_buffer
                add(group, "all_gather", pb.numel() * pb.element_size(), n=bucket.world, role="param_gather")
    m = cfg.model  # the tied output layer's, or MTP's look-up copy on the last stage or a standalone MTP stage
    if cfg.parallel.pp > 1 and (not m.untie_embeddings_and_output_weights or m.mtp_num_layers):
        for chunk in chunks:
            for q in chunk.module.parameters():
                if getattr(q, "shared_embedding", False):
                    add("embedding", "all_reduce", q.numel() * chunk.grad_buffer.element_size())


def _optimizer(cfg, ctx, add, n_moe_model: bool) -> None:
    o, par = cfg.optim, cfg.parallel
    world = par.world_size
    sharded = o.use_distributed_optimizer or cfg.fsdp_active
    if o.fp16:
        add("world" if sharded or n_moe_model else "mp", "all_reduce", 4,
            n=world if sharded or n_moe_model else None)
    if sharded:
        add("world", "all_reduce", 4, n=world)
        return
    add("mp", "all_reduce", 4)
    if n_moe_model:
        add("expert_mp", "all_reduce", 4)


__all__ = ["Collective", "ROLES", "step_collectives", "rank_collectives", "ring_kv_elements", "pipeline_sends",
           "pipeline_send_blocks",
           "bytes_by_kind", "KIND_OF", "group_span", "GroupSizes", "ddp_estimate", "fsdp_estimate"]
