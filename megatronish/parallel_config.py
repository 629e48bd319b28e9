"""The parallel layout against the flags: ``ParallelDims`` (``parallel/dims.py``) states a problem with the
degrees in numbers only (:class:`~megatronish.parallel.dims.DegreeError`); the lines here name the flags to change
(the words users see). Also the model's shapes against the degrees (:func:`validate_model`) and the virtual-stage
count from ``--num-layers-per-virtual-pipeline-stage``."""
from __future__ import annotations

from .errors import ConfigError
from .parallel.dims import PIPELINE_SCHEDULES, DegreeError, ParallelDims, layer_split_error
from .parallel.pipeline import schedules
from .parallel.pipeline.layout import parse_layout

__all__ = ["parallel_dims", "check_layer_split", "check_stage_split", "check_layout_mtp", "check_interleaving",
           "validate_model", "virtual_stages_from_layers"]
_TP = "--tensor-model-parallel-size"
_PP = "--pipeline-model-parallel-size"
_CP = "--context-parallel-size"
_EP = "--expert-model-parallel-size"
_ETP = "--expert-tensor-parallel-size"
_VP = "--num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage)"
_WORLD = "the world size {n} (torchrun --nproc-per-node x --nnodes)"
_FIRST, _LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
_LAYOUT = "--pipeline-model-parallel-layout"
_ACCOUNT = "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"
_DEGREE_FLAGS = {"world_size": "the world size (torchrun --nproc-per-node x --nnodes)", "tp": _TP, "pp": _PP,
                 "vp": _VP, "cp": _CP, "ep": _EP, "etp": _ETP, "decoder_first_pipeline_num_layers": _FIRST,
                 "decoder_last_pipeline_num_layers": _LAST,
                 "cp_inner": "--hierarchical-context-parallel-sizes (its first, all-to-all size)"}


def _degree_line(e: DegreeError) -> str:
    """The flag line of a :class:`DegreeError` from ``ParallelDims``."""
    v = e.values
    if e.kind == "not_positive":
        return f"{_DEGREE_FLAGS[v['name']]} must be an integer >= 1, got {v['value']!r}"
    if e.kind == "tie_embeddings":
        return f"tie_embeddings must be a bool (--untie-embeddings-and-output-weights), got {v['value']!r}"
    if e.kind == "world":
        return (f"{_TP} {v['tp']} x {_PP} {v['pp']} x {_CP} {v['cp']} = {v['model']} does not divide "
                f"{_WORLD.format(n=v['world_size'])}; change these degrees so that their product divides the "
                f"world size, or launch a multiple of {v['model']} processes")
    if e.kind == "experts":
        stage = v["stage"]
        return (f"{_EP} {v['ep']} x {_ETP} {v['etp']} = {v['ep'] * v['etp']} does not divide the "
                f"{stage} ranks of a pipeline stage (world size {v['world_size']} / {_PP} {v['pp']}, = "
                f"{_TP} {v['tp']} x {_CP} {v['cp']} x data-parallel {v['dp']}); the expert layers lay those ranks "
                f"out as expert-TP x EP x expert-DP, so choose EP x expert-TP dividing {stage}")
    if e.kind == "vp_without_pp":
        return (f"{_VP} gives {v['vp']} virtual stages per pipeline rank, which needs pipeline parallelism, but "
                f"{_PP} is 1; raise {_PP} above 1 or drop the virtual-stage flag")
    if e.kind == "cp_inner":
        return (f"--hierarchical-context-parallel-sizes {v['cp_inner']} ...: the all-to-all size {v['cp_inner']} "
                f"does not divide {_CP} {v['cp']}; INNER x OUTER must equal {_CP}")
    if e.kind in ("uneven_split", "uneven_without_pp"):
        return _uneven_line(e.kind, v)
    if e.kind in _SPLIT_LINES:
        return _SPLIT_LINES[e.kind].format(**v, stages_total=v.get("pp", 0) * v.get("vp", 0))
    if e.kind in ("schedule", "schedule_pp", "schedule_vp"):
        return _schedule_line(e.kind, v)
    if e.kind == "interleaving":
        return _interleaving_line(v["pp"], v["vp"], v["num_microbatches"])
    if e.kind == "layer_split":
        num_layers, pp, vp = v["num_layers"], v["pp"], v["vp"]
        if vp > 1:
            return (f"--num-layers {num_layers} is not divisible by {_PP} {pp} x {vp} virtual "
                    f"stages per rank (set by --num-layers-per-virtual-pipeline-stage or "
                    f"--num-virtual-stages-per-pipeline-rank) = {pp * vp}; every virtual stage must hold the same "
                    f"number of layers: choose --num-layers a multiple of {pp * vp}, or change the pipeline size or "
                    f"the virtual-stage size")
        return (f"--num-layers {num_layers} is not divisible by {_PP} {pp}; every pipeline "
                f"stage must hold the same number of layers: choose --num-layers a multiple of {pp} or another "
                f"pipeline size")
    return str(e)


def _uneven_line(kind: str, v: dict) -> str:
    if kind == "uneven_without_pp":
        return f"{_FIRST} / {_LAST} split the layers over pipeline ranks, but {_PP} is 1; drop them or raise {_PP}"
    given = " ".join(f"{flag} {n}" for flag, n in ((_FIRST, v["first"]), (_LAST, v["last"])) if n is not None)
    head = f"--num-layers {v['num_layers']} with {given} over {_PP} {v['pp']}"
    if v["reason"] == "vp":
        return (f"{head}: every pipeline rank's layers must divide by its {v['vp']} virtual stages ({_VP}), but "
                f"the first / middle / last ranks get {v['first']} / {v['per']} / {v['last']}; change the layer "
                f"numbers or the virtual stages")
    return (f"{head}: the {v['middle_layers']} remaining layers must split evenly over the {v['middle_ranks']} "
            f"ranks between the first and the last (none left when there are none); change --num-layers or these "
            f"numbers")


# The lines of a layout string and of the account-for splits, by DegreeError kind ({stages_total} = pp x vp).
_SPLIT_LINES = {
    "not_bool": "{name} must be a bool, got {value!r}",
    "layout": f"{_LAYOUT} {{layout!r}}: {{reason}}",
    "layout_stages": f"{_LAYOUT} {{layout!r}} has {{stages}} stages but {_PP} {{pp}} x {{vp}} virtual stages per "
                     f"rank is {{stages_total}}; the layout sets the virtual stages: drop {_VP}",
    "layout_layers": f"{_LAYOUT} {{layout!r}} holds {{found}} transformer layers (t) but --num-layers is "
                     f"{{num_layers}}; make them equal",
    "layout_conflict": f"{_LAYOUT} says what every stage holds; drop {_FIRST} / {_LAST} and {_ACCOUNT} "
                       f"(Megatron-LM rejects them together too)",
    "account_conflict": f"{_FIRST} / {_LAST} cannot be combined with {_ACCOUNT} (as in Megatron-LM); pass one "
                        f"way to split the layers, or give {_LAYOUT}",
    "account_without_pp": f"{_ACCOUNT} change how layers split over pipeline stages, but {_PP} is 1; drop them or "
                          f"raise {_PP}",
    "account_split": f"--num-layers {{num_layers}} with {_ACCOUNT} counts {{total}} layers, which do not split "
                     f"evenly into {_PP} {{pp}} x {{vp}} virtual stages per rank = {{stages_total}} stages; change "
                     f"--num-layers or the pipeline sizes, or give {_LAYOUT}",
}


def _schedule_line(kind: str, v: dict) -> str:
    s = v["schedule"]
    if kind == "schedule":
        return f"--pipeline-schedule {s!r} is unknown; choose one of {', '.join(PIPELINE_SCHEDULES)}"
    if kind == "schedule_pp":
        return f"--pipeline-schedule {s} needs pipeline parallelism, but {_PP} is 1; raise {_PP} or drop the flag"
    if s in ("zbv", "dualpipev"):
        return (f"--pipeline-schedule {s} places exactly 2 chunks on every pipeline rank (a V), but {_VP} gives "
                f"{v['vp']}; drop the virtual-stage flag ({s} implies 2) or set it to 2")
    if s == "interleaved-1f1b":
        return f"--pipeline-schedule interleaved-1f1b needs more than one virtual stage per rank; set {_VP}"
    return (f"--pipeline-schedule {s} runs one chunk per pipeline rank, but {_VP} gives {v['vp']}; drop the "
            f"virtual-stage flag, or use --pipeline-schedule interleaved-1f1b (or zbv for 2 chunks in a V)")


def _interleaving_line(p: int, v: int, num_microbatches: int, micro_batch_size: int | None = None,
                       global_batch_size: int | None = None, data_parallel_size: int | None = None) -> str:
    if None not in (micro_batch_size, global_batch_size, data_parallel_size):
        how = (f" (--global-batch-size {global_batch_size} / (--micro-batch-size {micro_batch_size} x "
               f"data-parallel size {data_parallel_size}))")
    else:
        how = " (--global-batch-size / (--micro-batch-size x data-parallel size))"
    return (f"the interleaved pipeline schedule ({v} virtual stages per rank, from "
            f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank) needs the number of "
            f"microbatches per iteration to be a multiple of {_PP} {p}, but it is "
            f"{num_microbatches}{how}; change --global-batch-size or --micro-batch-size so that it is a multiple of "
            f"{p}, or drop the virtual-stage flag")


def check_interleaving(p: int, v: int, num_microbatches: int, *, micro_batch_size: int | None = None,
                       global_batch_size: int | None = None, data_parallel_size: int | None = None) -> None:
    """Raise :class:`ConfigError` naming the batch and pipeline flags unless the interleaved schedule can run
    ``num_microbatches`` on ``p`` ranks (the rule is ``schedules.check_interleaving``)."""
    try:
        schedules.check_interleaving(p, v, num_microbatches)
    except DegreeError:
        raise ConfigError(_interleaving_line(p, v, num_microbatches, micro_batch_size, global_batch_size,
                                             data_parallel_size)) from None


def parallel_dims(**degrees) -> ParallelDims:
    """``ParallelDims(**degrees)``; degrees that do not fit raise :class:`ConfigError` naming the flags."""
    try:
        return ParallelDims(**degrees)
    except DegreeError as e:
        raise ConfigError(_degree_line(e)) from None


def check_layer_split(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                      last: int | None = None) -> None:
    """Raise :class:`ConfigError` unless ``num_layers`` splits into ``pp * vp`` (virtual) stages, evenly or with
    ``first``/``last`` layers on the first/last rank (the rule is ``parallel.dims.layer_split_error``; argument
    validation, :func:`validate_model` and ``build_model_chunks`` call this)."""
    error = layer_split_error(num_layers, pp, vp, first, last)
    if error is not None:
        raise ConfigError(_degree_line(error))


def check_stage_split(dims: ParallelDims, num_layers: int) -> None:
    """Raise :class:`ConfigError` unless ``num_layers`` splits into the stages of ``dims`` in its way (evenly,
    first/last, a layout string, account-for: ``ParallelDims.layer_split_error``)."""
    error = dims.layer_split_error(num_layers)
    if error is not None:
        raise ConfigError(_degree_line(error))


def check_layout_mtp(dims: ParallelDims, mtp_num_layers: int | None) -> None:
    """A layout string's ``m`` layers against ``--mtp-num-layers`` (Megatron's rule: as many as the depths)."""
    if dims.pipeline_model_parallel_layout is None:
        return
    found = "".join(parse_layout(dims.pipeline_model_parallel_layout)).count("m")
    if found != (mtp_num_layers or 0):
        raise ConfigError(f"{_LAYOUT} {dims.pipeline_model_parallel_layout!r} holds {found} multi-token prediction "
                          f"layers (m) but --mtp-num-layers is {mtp_num_layers or 0}; make them equal")


def virtual_stages_from_layers(num_layers: int | None, pp: int, layers_per_virtual_stage: int,
                               extra_layers: int = 0) -> int:
    """Virtual stages per pipeline rank for ``--num-layers-per-virtual-pipeline-stage N``: ``(L + x) / (p * N)``,
    ``x`` the embedding and/or loss counted as layers (the account-for splits, Megatron's rule)."""
    n = layers_per_virtual_stage
    total = None if num_layers is None else num_layers + extra_layers
    if n < 1 or total is None or pp < 1 or total % (pp * n):
        counted = f" (+ {extra_layers} for {_ACCOUNT})" if extra_layers else ""
        raise ConfigError(f"--num-layers {num_layers}{counted} / {_PP} {pp} is not a multiple of "
                          f"--num-layers-per-virtual-pipeline-stage {n}")
    return total // (pp * n)


def validate_model(dims: ParallelDims, *, num_layers: int, num_attention_heads: int,
                   num_query_groups: int | None = None, seq_length: int | None = None,
                   sequence_parallel: bool = False, hidden_size: int | None = None,
                   ffn_hidden_size: int | None = None) -> None:
    """Check model shapes against the degrees; raise :class:`ConfigError` naming the flag at fault.

    ``sequence_parallel`` is the resolved one (``RunConfig.sequence_parallel``: off at TP 1, as in Megatron-LM).
    ``hidden_size`` is checked against the head count because the head dimension (``--kv-channels``) is
    derived from it; pass ``hidden_size=None`` when ``--kv-channels`` is given explicitly.
    """
    tp, cp = dims.tp, dims.cp
    for flag, value in (("--num-layers", num_layers), ("--num-attention-heads", num_attention_heads),
                        ("--num-query-groups", num_query_groups), ("--seq-length", seq_length),
                        ("--hidden-size", hidden_size), ("--ffn-hidden-size", ffn_hidden_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
    if num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by {_TP} {tp}; "
            f"choose a tensor-parallel size that divides the head count")
    if num_query_groups is not None:
        if num_query_groups % tp:
            raise ConfigError(
                f"--num-query-groups {num_query_groups} is not divisible by {_TP} {tp}; "
                f"choose a tensor-parallel size that divides the number of query groups")
        if num_attention_heads % num_query_groups:
            raise ConfigError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--num-query-groups {num_query_groups}; each query group must hold the same number of heads")
    if hidden_size is not None and hidden_size % num_attention_heads:
        raise ConfigError(
            f"--hidden-size {hidden_size} is not divisible by --num-attention-heads {num_attention_heads}; "
            f"change one of them (or set --kv-channels explicitly)")
    if ffn_hidden_size is not None and ffn_hidden_size % tp:
        raise ConfigError(
            f"--ffn-hidden-size {ffn_hidden_size} is not divisible by {_TP} {tp}; "
            f"choose an FFN size that is a multiple of the tensor-parallel size")
    if seq_length is not None:
        if cp > 1 and seq_length % (2 * cp):
            raise ConfigError(
                f"--seq-length {seq_length} is not divisible by 2 x {_CP} {cp} = {2 * cp} (context parallelism "
                f"splits the sequence into 2*CP chunks for load balance); change --seq-length or {_CP}")
        if sequence_parallel and seq_length % (tp * cp):
            per_cp = f" x {_CP} {cp}" if cp > 1 else ""
            raise ConfigError(
                f"--seq-length {seq_length} is not divisible by {_TP} {tp}{per_cp} under --sequence-parallel; "
                f"change --seq-length or {_TP}, or drop --sequence-parallel")
    check_stage_split(dims, num_layers)
