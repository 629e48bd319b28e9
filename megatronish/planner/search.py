"""``megatronish-plan --search``: every valid layout of a model on a world size, GPU and global batch, those that
fit memory ranked by predicted tokens/s (docs/planner.md).

Enumerated: TP (dividing the heads, inside one node), PP (dividing the layers), VP (1, 2, 4), CP (1, 2, 4, 8),
EP and expert TP (MoE: EP dividing the experts, ETP 1 or TP), and what the modelled training stack (:class:`Stack`)
can run: its data-parallel state (Megatron: none, the distributed optimizer or FSDP2; torchtitan: FSDP2), its
recompute choices (none, selective, full; "selective" meaning the stack's own policy), its micro-batch sizes
(Megatron: 1, 2, 4, 8 with gradient accumulation; torchtitan: the DP rank's batch, under PP split in at least one
microbatch per stage);
DP is what is left. Memory is screened with the analytic per-rank count (:func:`analytic_state`: parameters from
every tensor's global description, split as the layout splits it, equal to the meta-device count; bytes per element
as ``state.py`` counts them, without the distributed optimizer's bucket padding and Adam's step counters, under
0.1%), the first and last pipeline stage's activations (the stack's loss, checkpointing policy and pipeline
runtime), FSDP2's buffers in flight (``state.fsdp_in_flight_bytes`` over :func:`analytic_fsdp_units`) and the
step-time model. Layouts are their parallel degrees and micro-batch size (:data:`LAYOUT_FIELDS`): each is ranked
by its best variant (data-parallel state and recompute) that the launch's own rules accept; :func:`place` finds a
given run's layout in that ranking and :func:`trade` says what the winner trades differently.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..model.moe.layer import is_moe_layer
from ..parallel.dims import DegreeError, layer_split_error
from ..parallel.pipeline.schedules import check_interleaving
from .activations import stage_activations
from .perf import collectives, step_time
from .state import StateBytes, build_meta_chunks, fsdp_in_flight_bytes

GIB = 2 ** 30


@dataclass(frozen=True)
class Stack:
    """What a training stack can run and how it keeps activations, for the search to stay inside it.
    ``sharding``: the data-parallel state choices (``"none"``, ``"dist-opt"``, ``"fsdp"``); ``recompute``: the
    recompute granularities; ``micro_batch_sizes``: the sizes tried with gradient accumulation, or None without
    it: the DP rank's batch is one microbatch, under PP split into at least one microbatch per stage (the pipeline
    runtime's default is one per stage; more is a setting); ``activations``: ``stage_activations``'s ``loss``
    and ``selective`` keywords; ``torch_pipelining``: under PP the loss stage keeps every microbatch's output and
    FSDP2 keeps its gradients unsharded until the last microbatch (``plan_inputs``' ``pipelining_outputs`` and
    ``unsharded_grads``)."""

    name: str
    sharding: tuple = ("none", "dist-opt", "fsdp")
    recompute: tuple = (None, "selective", "full")
    micro_batch_sizes: tuple | None = (1, 2, 4, 8)
    activations: tuple = ()
    torch_pipelining: bool = False

    def act_kw(self, pp: int) -> dict:
        return dict(self.activations, **({"pipelining_outputs": True} if self.torch_pipelining and pp > 1 else {}))


# ours (Megatron-LM's vocabulary)
MEGATRON = Stack("megatron")
# torchtitan (December 2024): FSDP2 over DP x CP, its per-op selective checkpointing, its loss, no gradient
# accumulation (PP: ``pipeline_parallel_microbatches``, by default the stages), torch.distributed.pipelining
# (docs/planner.md, "Another stack's activations")
TORCHTITAN = Stack("torchtitan", sharding=("fsdp",), micro_batch_sizes=None,
                   activations=(("loss", "torchtitan"), ("selective", "per-op")), torch_pipelining=True)
STACKS = {st.name: st for st in (MEGATRON, TORCHTITAN)}
# a layout: its parallel degrees and micro-batch size (the data-parallel state and recompute are its variants)
LAYOUT_FIELDS = ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "mbs")


# The search tries even splits: a run's layout string, first/last or account-for split names its own degrees.
_EVEN_SPLIT = dict(decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                   pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False)


class ParamTable:
    """Every parameter's global description of one model, built once on the meta device; ``count`` gives one
    rank's parameters under any layout without building it again."""

    def __init__(self, cfg):
        one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=1, tp=1, pp=1, vp=1,
                                                                    cp=1, ep=1, etp=None, cp_inner=None,
                                                                    **_EVEN_SPLIT),
                                  train=dataclasses.replace(cfg.train, global_batch_size=None))
        _, models = build_meta_chunks(one, 0)
        self.model = cfg.model
        self.layers: dict[int, list] = {}
        self.first, self.last, self.vocab = [], [], []  # embedding-side, output-side (final norm), vocab tensors
        for name, p in models[0].named_parameters():
            d = p.desc
            if name.startswith("decoder.layers."):
                self.layers.setdefault(int(name.split(".")[2]), []).append(d)
            elif "word_embeddings" in name or name.startswith("output_layer"):
                self.vocab.append((name.startswith("output_layer"), d))
            elif name.startswith("embedding"):
                self.first.append(d)
            else:
                self.last.append(d)
        self._cache: dict = {}

    @staticmethod
    def _local(d, tp: int, ep: int, etp: int) -> int:
        shape = list(d.global_shape)
        if d.partition_dim is not None:
            shape[d.partition_dim] //= etp if d.expert else tp
        if d.expert:
            shape[0] //= ep
        return math.prod(shape)

    def layer(self, i: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
        """(dense, expert) elements of layer ``i`` on one rank."""
        key = (is_moe_layer(self.model, i) if self.model.moe.num_experts else False, tp, ep, etp)
        if key not in self._cache:
            ds = self.layers[i]
            self._cache[key] = (sum(self._local(d, tp, ep, etp) for d in ds if not d.expert),
                                sum(self._local(d, tp, ep, etp) for d in ds if d.expert))
        return self._cache[key]

    def count(self, par, pp_rank: int) -> tuple[int, int]:
        """(dense, expert) parameter elements of a rank of pipeline stage ``pp_rank`` under ``par``."""
        etp = par.expert_tp
        dense = expert = 0
        for c in range(par.vp):
            for i in par.layer_range(self.model.num_layers, pp_rank, c):
                a, b = self.layer(i, par.tp, par.ep, etp)
                dense, expert = dense + a, expert + b
        first, last = pp_rank == 0, pp_rank == par.pp - 1
        vocab = self.model.padded_vocab_size(par.tp) // par.tp * self.model.hidden_size
        if first:
            dense += sum(self._local(d, par.tp, 1, 1) for d in self.first)
        if last:
            dense += sum(self._local(d, par.tp, 1, 1) for d in self.last)
        for is_output, _ in self.vocab:
            if (first and not is_output) or (last and is_output):
                dense += vocab
        if last and not first and not self.model.untie_embeddings_and_output_weights:
            dense += vocab  # the tied embedding's copy on the last stage
        return dense, expert


def analytic_state(cfg, table: ParamTable, pp_rank: int) -> StateBytes:
    """A rank's parameter, gradient and optimizer bytes from :class:`ParamTable` (module docstring)."""
    o, par = cfg.optim, cfg.parallel
    dense, expert = table.count(par, pp_rank)
    n = dense + expert
    e = o.params_dtype.itemsize
    states = 8 if o.optimizer == "adam" else (4 if o.sgd_momentum else 0)
    if cfg.fsdp_active:
        world = par.dp * par.cp
        return StateBytes(4 * -(-n // world), 4 * -(-n // world), (states * n) // world, n)
    grad = 2 if o.grad_reduce_in_bf16 else 4
    main = 4 if e == 2 else 0
    if o.use_distributed_optimizer:
        expert_dp = par.world_size // (par.ep * par.expert_tp * par.pp)
        opt = (main + states) * (dense / (par.dp * par.cp) + expert / expert_dp)
    else:
        opt = (main + states) * n
    return StateBytes(n * e, n * grad, int(opt), n)


def analytic_fsdp_units(cfg, table: ParamTable, pp_rank: int) -> list[int]:
    """A rank's FSDP units' elements in execution order (``state.fsdp_unit_numels`` without building the model):
    the embedding (first stage), each layer of each model chunk, the untied output layer (last stage)."""
    par, m = cfg.parallel, cfg.model
    vocab = m.padded_vocab_size(par.tp) // par.tp * m.hidden_size
    units = [vocab + sum(table._local(d, par.tp, 1, 1) for d in table.first)] if pp_rank == 0 else []
    for c in range(par.vp):
        units += [sum(table.layer(i, par.tp, par.ep, par.expert_tp))
                  for i in par.layer_range(m.num_layers, pp_rank, c)]
    if pp_rank == par.pp - 1 and m.untie_embeddings_and_output_weights:
        units.append(vocab)
    return units


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg, hw, stack: Stack = MEGATRON):
    """Every layout of ``cfg``'s model on its world size that ``stack`` runs (module docstring), as run configs
    (not yet validated)."""
    m, par, t = cfg.model, dataclasses.replace(cfg.parallel, **_EVEN_SPLIT), cfg.train
    world, gbs = par.world_size, t.global_batch_size
    heads, groups = m.num_attention_heads, m.num_query_groups
    experts = m.moe.num_experts
    for tp in [d for d in _divisors(min(hw.gpus_per_node, heads)) if heads % d == 0 and groups % d == 0]:
        for pp in [d for d in _divisors(m.num_layers) if d <= 128]:
            for cp in (1, 2, 4, 8):
                if world % (tp * pp * cp) or m.seq_length % (2 * cp * tp):
                    continue
                dp = world // (tp * pp * cp)
                for ep in ([1] if not experts else [d for d in _divisors(experts) if (dp * cp * tp) % d == 0]):
                    for etp in ((None,) if not experts else sorted({1, tp})):
                        if experts and (dp * cp * tp) % (ep * (etp or tp)):
                            continue
                        for vp in (1, 2, 4) if pp > 2 else (1,):
                            if layer_split_error(m.num_layers, pp, vp) is not None:
                                continue
                            for mbs in _micro_batch_sizes(stack, gbs, dp, pp * vp if pp > 1 else 1):
                                if gbs % (mbs * dp) or (vp > 1 and not _interleaves(pp, vp, gbs // (mbs * dp))):
                                    continue
                                dims = dataclasses.replace(par, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vp=vp)
                                yield from _variants(cfg, dims, mbs, dp * cp, stack)


def _micro_batch_sizes(stack: Stack, gbs: int, dp: int, stages: int) -> tuple:
    """The sizes ``stack`` tries; without gradient accumulation the DP rank's batch is one microbatch, or under PP
    (``stages`` > 1) any split of it into at least one microbatch per stage."""
    if stack.micro_batch_sizes is not None:
        return stack.micro_batch_sizes
    if gbs % dp:
        return ()
    per_rank = gbs // dp
    return (per_rank,) if stages == 1 else tuple(d for d in _divisors(per_rank) if per_rank // d >= stages)


def _interleaves(pp: int, vp: int, num_microbatches: int) -> bool:
    """Whether the interleaved schedule runs these microbatches (the schedule's own rule)."""
    try:
        check_interleaving(pp, vp, num_microbatches)
    except DegreeError:
        return False
    return True


def _variants(cfg, dims, mbs: int, dp_cp: int, stack: Stack):
    train = dataclasses.replace(cfg.train, micro_batch_size=mbs)
    for opt in stack.sharding if dp_cp > 1 else ("none",):
        o = cfg.optim  # the overlap flags go with the wrappers they belong to (the launch rejects them elsewhere)
        optim = dataclasses.replace(o, use_distributed_optimizer=opt == "dist-opt", use_torch_fsdp2=opt == "fsdp",
                                    overlap_grad_reduce=o.overlap_grad_reduce and opt != "fsdp",
                                    overlap_param_gather=o.overlap_param_gather and opt == "dist-opt")
        for rec in stack.recompute:
            kw = dict(recompute_granularity=rec, recompute_method="uniform" if rec == "full" else None,
                      recompute_num_layers=1 if rec == "full" else None)
            model = cfg.model.replace(**kw)
            yield dataclasses.replace(cfg, parallel=dims, train=train, optim=optim, model=model,
                                      sequence_parallel_flag=True)


def evaluate(cfg, hw, table: ParamTable, stack: Stack = MEGATRON, *, tp_overlap: bool = False,
             fit_only: bool = True) -> dict | None:
    """The screened plan of one candidate: peak memory of its first and last stage (``stack``'s activations) and
    the step-time model (``tp_overlap``: asynchronous TP); None when it does not fit and ``fit_only``."""
    pp = cfg.parallel.pp
    stages = sorted({0, pp - 1})
    act_kw, unsharded = stack.act_kw(pp), stack.torch_pipelining and pp > 1
    mem, state0, stage0 = 0.0, None, 0
    for s in stages:
        st = analytic_state(cfg, table, s)
        fsdp = fsdp_in_flight_bytes(cfg, analytic_fsdp_units(cfg, table, s), unsharded_grads=unsharded) \
            if cfg.fsdp_active else 0
        mem = max(mem, st.total + stage_activations(cfg, s, **act_kw).total + fsdp)
        if state0 is None or st.total > state0.total:
            state0, stage0 = st, s
    if fit_only and mem > hw.hbm_bytes:
        return None
    rank = cfg.parallel.rank_of(pp=stage0)
    colls = collectives(cfg, state0, rank, table.count(cfg.parallel, stage0)[1])
    return {"cfg": cfg, "peak_bytes": mem, "fits": mem <= hw.hbm_bytes,
            "time": step_time(cfg, hw, state0, colls, rank, tp_overlap=tp_overlap)}


def layout_key(cfg, fields=LAYOUT_FIELDS) -> tuple:
    """A run's layout: its parallel degrees and micro-batch size, the ``fields`` of :data:`LAYOUT_FIELDS`."""
    par = cfg.parallel
    values = {"tp": par.tp, "pp": par.pp, "vp": par.vp, "cp": par.cp, "ep": par.ep, "etp": par.expert_tp,
              "dp": par.dp, "mbs": cfg.train.micro_batch_size}
    return tuple(values[f] for f in fields)


def describe(cfg) -> str:
    par, o = cfg.parallel, cfg.optim
    opt = "fsdp2" if cfg.fsdp_active else "dist-opt" if o.use_distributed_optimizer else "-"
    moe = f" EP{par.ep} ETP{par.expert_tp}" if cfg.model.moe.num_experts else ""
    return (f"TP{par.tp} PP{par.pp} VP{par.vp} CP{par.cp}{moe} DP{par.dp} mbs{cfg.train.micro_batch_size} {opt} "
            f"recompute={cfg.model.recompute.recompute_granularity or '-'}"
            f"{' SP' if cfg.sequence_parallel else ''}")


def search(cfg, hw, top_k: int = 5, stack: Stack = MEGATRON, *, tp_overlap: bool = False) -> dict:
    """The ``top_k`` fitting layouts by predicted tokens/s, each its best variant the launch's rules accept.
    ``stack``: what the search may choose (:class:`Stack`); ``tp_overlap``: asynchronous TP for every layout."""
    m = cfg.model
    if dict(stack.activations).get("selective") == "per-op" and (m.moe.num_experts or
                                                                   m.attention.multi_latent_attention):
        raise ConfigError(f"--search-stack {stack.name}: its per-op selective checkpointing is modelled for dense "
                          "layers with standard attention; drop --num-experts / --multi-latent-attention or search "
                          "with --search-stack megatron")
    table = ParamTable(cfg)
    seen, fits, keys = 0, [], set()
    for cand in candidates(cfg, hw, stack):
        seen += 1
        keys.add(layout_key(cand))
        r = evaluate(cand, hw, table, stack, tp_overlap=tp_overlap)
        if r is not None:
            fits.append(r)
    fits.sort(key=lambda r: -r["time"]["tokens_per_s_per_gpu"])
    res = {"enumerated": seen, "fit": len(fits), "layouts": len({layout_key(r["cfg"]) for r in fits}),
           "ranked": fits, "keys": keys, "stack": stack, "tp_overlap": tp_overlap,
           "table": table, "own_problems": _problems(cfg), "_valid": {}, "_layouts": []}
    res["top"] = [r for _, r in zip(range(top_k), _layouts(res))]
    return res


def _problems(cfg) -> set[str]:
    """The launch's problems with ``cfg`` (its validation's lines; none for a valid run)."""
    from ..arguments.validation import validate

    try:
        validate(cfg)
    except ConfigError as e:
        return set(str(e).splitlines())
    return set()


def _valid(res: dict, r: dict) -> bool:
    """Whether the launch's rules accept ``r``'s layout: no problem beyond those of the searched run itself (a run
    of another stack modelled with a feature our launch lacks, as torchtitan's FSDP2 with Float8, is not held
    against every layout of it)."""
    key = id(r)
    if key not in res["_valid"]:
        res["_valid"][key] = _problems(r["cfg"]) <= res["own_problems"]
    return res["_valid"][key]


def _layouts(res: dict):
    """The distinct layouts (:data:`LAYOUT_FIELDS`) in rank order, each its best valid variant (memoised)."""
    yield from res["_layouts"]
    done = {layout_key(r["cfg"]) for r in res["_layouts"]}
    start = res.get("_cursor", 0)
    for i in range(start, len(res["ranked"])):
        res["_cursor"] = i + 1
        r = res["ranked"][i]
        key = layout_key(r["cfg"])
        if key in done or not _valid(res, r):
            continue
        done.add(key)
        res["_layouts"].append(r)
        yield r


def place(res: dict, cfg, fields=LAYOUT_FIELDS) -> tuple[int | None, dict | None]:
    """(rank, entry) of the best layout whose ``fields`` equal ``cfg``'s among the search's distinct layouts (1 is
    the winner); (None, None) when none fits memory."""
    want = layout_key(cfg, fields)
    for i, r in enumerate(_layouts(res)):
        if layout_key(r["cfg"], fields) == want:
            return i + 1, r
    return None, None


def as_run(res: dict, cfg, hw) -> dict:
    """``cfg`` exactly as given (its data-parallel state and recompute too) under the search's model, fitting or
    not: the published run beside the search's ranking."""
    return evaluate(cfg, hw, res["table"], res["stack"], tp_overlap=res["tp_overlap"], fit_only=False)


def _ms(x: float) -> str:
    return f"{x * 1e3:+.0f}" if abs(x) >= 0.01 else f"{x * 1e3:+.3g}"


def trade(winner: dict, other: dict, terms: int = 4) -> str:
    """What ``winner`` trades differently from ``other``: the step-time terms that differ most (``other`` minus
    the winner, ms; those over 0.1% of the winner's step), the net, and the two peaks."""
    a, b = winner["time"]["breakdown_s"], other["time"]["breakdown_s"]
    diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    floor = 1e-3 * winner["time"]["step_s"]
    big = sorted((k for k in diff if abs(diff[k]) > floor), key=lambda k: -abs(diff[k]))[:terms]
    net = other["time"]["step_s"] - winner["time"]["step_s"]
    parts = ", ".join(f"{k} {_ms(diff[k])}" for k in big) or "no term differs by 0.1% of the step"
    return (f"{parts} ms (step {_ms(net)} ms); peak {_gib(other['peak_bytes'])} GiB against the "
            f"winner's {_gib(winner['peak_bytes'])}")


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}" if x >= GIB else f"{x / GIB:.2g}"


def _line(i, r) -> list[str]:
    tm = r["time"]
    return [f"{i}. {describe(r['cfg'])}: {tm['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, step "
            f"{tm['step_s'] * 1e3:.1f} ms, MFU {tm['mfu'] * 100:.1f}%, peak {_gib(r['peak_bytes'])} GiB",
            "   breakdown (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in tm["breakdown_s"].items())]


def format_search(res: dict, hw, published=()) -> str:
    """The ranking; ``published``: (label, run config, the :data:`LAYOUT_FIELDS` its source states) of runs to
    find in it: each one's rank, its best variant and as run, and what the winner trades differently."""
    st = res["stack"]
    lines = [f"{res['enumerated']} layouts enumerated ({st.name}'s choices"
             f"{', asynchronous TP' if res['tp_overlap'] else ''}), {res['fit']} fit {hw.hbm_gib:.0f} GiB; "
             f"top {len(res['top'])} (a layout: its degrees and micro-batch size, at its best variant):"]
    if not res["top"]:
        return lines[0] + " none"
    win = res["top"][0]
    for i, r in enumerate(res["top"]):
        lines += _line(i + 1, r)
        if i:
            lines.append(f"   against 1.: {trade(win, r)}")
    for name, cfg, fields in published:
        rank, best = place(res, cfg, fields)
        shown = [f for f in fields if cfg.model.moe.num_experts or f not in ("ep", "etp")]
        known = " ".join(f"{f.upper()}{v}" for f, v in zip(shown, layout_key(cfg, shown)))
        at = [LAYOUT_FIELDS.index(f) for f in fields]
        searched = any(tuple(k[i] for i in at) == layout_key(cfg, fields) for k in res["keys"])
        lines.append(f"{name} ({known}): "
                     + (f"rank {rank} of {res['layouts']} fitting layouts" if rank else
                        "no variant of its layout fits" if searched else
                        f"not a layout of {st.name}'s choices"))
        if best is not None and best is not win:
            first, breakdown = _line(rank, best)
            lines += [f"   its best variant: {first.split('. ', 1)[1]}", breakdown,
                      f"   against 1.: {trade(win, best)}"]
        run = as_run(res, cfg, hw)
        lines.append(f"   as run ({describe(cfg)}): {run['time']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                     f"peak {_gib(run['peak_bytes'])} GiB{'' if run['fits'] else ' (does not fit)'}")
        if describe(run["cfg"]) != describe(win["cfg"]):
            lines.append(f"   against 1.: {trade(win, run)}")
    return "\n".join(lines)


__all__ = ["ParamTable", "analytic_state", "analytic_fsdp_units", "candidates", "evaluate", "search", "format_search",
           "describe", "Stack", "MEGATRON", "TORCHTITAN", "STACKS", "LAYOUT_FIELDS", "layout_key", "place", "as_run",
           "trade"]
