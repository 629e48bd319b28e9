"""Parallel degrees, rank <-> coordinate arithmetic and the rank lists of every process group.

Pure arithmetic: nothing here touches ``torch.distributed``, so every layout can be checked without processes.

Ranks are laid out in the order ``tp-cp-ep-dp-pp`` with tensor parallelism fastest (adjacent ranks, usually the
same node)::

    rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP

Mixture-of-experts layers use a second grid over the same ranks (Megatron-LM's expert rank generator): inside one
pipeline stage the ``TP x CP x DP`` ranks are laid out again as ``etp-ep-edp`` with expert tensor parallelism
fastest::

    rank = etp + ep*ETP + edp*ETP*EP + pp*TP*CP*DP

``ETP`` is ``--expert-tensor-parallel-size`` (default: TP), ``EP`` ``--expert-model-parallel-size``, and the
expert-data-parallel size ``EDP = TP*CP*DP / (ETP*EP)``. With ``ETP = TP`` and ``CP = 1`` this is the classic
"experts inside data parallelism" (``dp = ep + EP*edp``); with ``ETP < TP`` expert parallelism also spans the
tensor-parallel ranks.

Context parallelism may have two levels (``cp_inner``, a2a+p2p attention): inside every CP group, ``cp_inner``
adjacent CP ranks form an all-to-all group (``cp_inner``) and the CP ranks with the same index inside theirs form a
ring (``cp_outer``); the CP coordinate is ``inner + cp_inner * outer``.

Every group list is produced by one helper, :func:`masked_rank_groups`: the axes of the order get strides that are
prefix products of their sizes; a group fixes the coordinates on the unmasked axes and enumerates the masked ones.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import ClassVar, Sequence

from ..errors import ConfigError  # noqa: F401 - re-exported: older imports take it from here
from .pipeline import layout as pipeline_layout

__all__ = ["DegreeError", "ParallelDims", "masked_rank_groups", "layer_split_error", "PIPELINE_SCHEDULES"]

# --pipeline-schedule's values: 1F1B, Megatron's interleaved 1F1B, and the split-backward zero-bubble schedules
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")


class DegreeError(ValueError):
    """Degrees that do not fit, stated in numbers only. ``kind`` names the rule and ``values`` holds its numbers;
    ``megatronish.config`` turns them into the line that names the flags to change (``parallel_dims``,
    ``check_layer_split``)."""

    def __init__(self, kind: str, message: str, **values):
        super().__init__(message)
        self.kind, self.values = kind, values


def layer_split_error(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                      last: int | None = None) -> DegreeError | None:
    """The one layer-split rule: None when ``num_layers`` splits into ``pp * vp`` (virtual) stages, else the
    :class:`DegreeError` saying why. Evenly without ``first``/``last``; with them (an uneven split, Megatron's
    ``--decoder-first/last-pipeline-num-layers``) the first (last) pipeline rank holds ``first`` (``last``) layers,
    the ranks between share the rest evenly, and every rank's layers divide by ``vp``."""
    if first is None and last is None:
        if num_layers % (pp * vp) == 0:
            return None
        return DegreeError("layer_split", f"{num_layers} layers do not split evenly into pp {pp} x vp {vp} stages",
                           num_layers=num_layers, pp=pp, vp=vp)
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    values = dict(num_layers=num_layers, pp=pp, vp=vp, first=first, last=last, middle_layers=middle_layers,
                  middle_ranks=middle_ranks)
    if middle_layers < 0 or (middle_ranks == 0) != (middle_layers == 0):
        return DegreeError("uneven_split", f"{num_layers} layers leave {middle_layers} for the {middle_ranks} "
                           f"middle stages", reason="middle", **values)
    if middle_ranks and middle_layers % middle_ranks:
        return DegreeError("uneven_split", f"{middle_layers} middle layers do not split evenly into "
                           f"{middle_ranks} stages", reason="middle", **values)
    per = middle_layers // middle_ranks if middle_ranks else 0
    if any(n % vp for n in (first or 0, last or 0, per)):
        return DegreeError("uneven_split", f"a rank's layers ({first}, {per}, {last}) do not divide by vp {vp}",
                           reason="vp", per=per, **values)
    return None


@functools.lru_cache(maxsize=256)
def _masked_rank_groups(sizes: tuple[int, ...], mask: tuple[bool, ...]) -> tuple[tuple[int, ...], ...]:
    strides = list(itertools.accumulate((1,) + sizes[:-1], lambda a, b: a * b))

    def offsets(axes: list[int]) -> list[int]:
        # Every sum of coord*stride over `axes`, the first axis varying fastest.
        out = [0]
        for a in axes:
            out = [o + c * strides[a] for c in range(sizes[a]) for o in out]
        return out

    inner = offsets([a for a, m in enumerate(mask) if m])
    outer = offsets([a for a, m in enumerate(mask) if not m])
    groups = sorted((tuple(sorted(base + o for o in inner)) for base in outer), key=lambda g: g[0])
    return tuple(groups)


def masked_rank_groups(sizes: Sequence[int], mask: Sequence[bool]) -> list[list[int]]:
    """Rank groups over a grid of ``sizes`` (first axis fastest): ranks sharing every unmasked coordinate.

    ``mask[i]`` True means axis ``i`` varies inside a group. Groups are sorted ascending and ordered by their
    smallest rank.
    """
    if len(sizes) != len(mask):
        raise ValueError(f"sizes {list(sizes)} and mask {list(mask)} differ in length")
    return [list(g) for g in _masked_rank_groups(tuple(int(s) for s in sizes), tuple(bool(m) for m in mask))]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run. ``dp`` is derived: ``world_size // (tp * cp * pp)``.

    ``vp`` is the number of virtual pipeline stages (model chunks) per pipeline rank; 1 means no interleaving.
    ``tie_embeddings`` is False under ``--untie-embeddings-and-output-weights`` without multi-token prediction; it
    decides whether the last pipeline rank joins the embedding group. ``untie_embeddings_and_output_weights``
    matters only under a standalone MTP stage (:attr:`mtp_stage`): that stage's rank joins the group, and the last
    rank only when its output layer is tied. ``cp_inner`` splits CP into two levels (all-to-all inside, a ring
    across: ``cp_outer = cp / cp_inner``); None: one level, and no ``cp_inner``/``cp_outer`` groups.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    tie_embeddings: bool = True
    untie_embeddings_and_output_weights: bool = False
    etp: int | None = None  # --expert-tensor-parallel-size; None: the tensor-parallel size
    cp_inner: int | None = None  # the all-to-all level of two-level CP; None: one level
    # the pipeline schedule (None: 1F1B, interleaved with vp > 1); "zbv" places chunk 1 of rank r on stage 2p-1-r
    pipeline_schedule: str | None = None
    # an uneven split: layers on the first / last pipeline rank (the ranks between share the rest evenly)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    # Megatron's layout string: what every global stage holds (parallel/pipeline/layout.py); p * v stages
    pipeline_model_parallel_layout: str | None = None
    # the embedding / the loss count as one layer when the layers split evenly over the stages
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    order: ClassVar[str] = "tp-cp-ep-dp-pp"
    # Axes of the dense grid.
    _AXES: ClassVar[tuple[str, ...]] = ("tp", "cp", "dp", "pp")
    _TOKENS: ClassVar[dict[str, tuple[str, ...]]] = {
        "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
    }
    # The expert grid's axes (inside a pipeline stage: etp fastest, then ep, then edp).
    _EXPERT_AXES: ClassVar[tuple[str, ...]] = ("etp", "ep", "edp", "pp")
    # The dense grid with CP split into its two levels (only when ``cp_inner`` is set).
    _CP_LEVEL_AXES: ClassVar[tuple[str, ...]] = ("tp", "cp_inner", "cp_outer", "dp", "pp")

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        uneven = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        for name in ("world_size", "tp", "pp", "vp", "cp", "ep", "etp", "cp_inner") + uneven:
            value = getattr(self, name)
            if name in ("etp", "cp_inner") + uneven and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DegreeError("not_positive", f"{name} must be an integer >= 1, got {value!r}", name=name,
                                  value=value)
        for name in ("tie_embeddings", "untie_embeddings_and_output_weights", "account_for_embedding_in_pipeline_split",
                     "account_for_loss_in_pipeline_split"):
            if not isinstance(getattr(self, name), bool):
                raise DegreeError("tie_embeddings" if name == "tie_embeddings" else "not_bool",
                                  f"{name} must be a bool, got {getattr(self, name)!r}", name=name,
                                  value=getattr(self, name))
        self._check_split_kind()
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise DegreeError("world", f"tp {self.tp} x pp {self.pp} x cp {self.cp} = {model} does not divide the "
                              f"world size {self.world_size}", tp=self.tp, pp=self.pp, cp=self.cp, model=model,
                              world_size=self.world_size)
        stage = self.tp * self.cp * self.dp
        if stage % (self.expert_tp * self.ep):
            raise DegreeError("experts", f"ep {self.ep} x etp {self.expert_tp} does not divide the {stage} ranks of "
                              f"a pipeline stage", ep=self.ep, etp=self.expert_tp, stage=stage, tp=self.tp,
                              cp=self.cp, dp=self.dp, pp=self.pp, world_size=self.world_size)
        if self.vp > 1 and self.pp == 1:
            raise DegreeError("vp_without_pp", f"vp {self.vp} needs pp > 1", vp=self.vp)
        if self.uneven and self.pp == 1:
            raise DegreeError("uneven_without_pp", "an uneven layer split needs pp > 1")
        self._check_schedule()
        if self.cp_inner is not None and self.cp % self.cp_inner:
            raise DegreeError("cp_inner", f"cp_inner {self.cp_inner} does not divide cp {self.cp}",
                              cp_inner=self.cp_inner, cp=self.cp)

    def _check_split_kind(self) -> None:
        """One way to split the layers: a layout, or first/last numbers, or the account-for splits (Megatron's
        conflicts); a layout's stages fit ``pp * vp`` and this model."""
        text, account = self.pipeline_model_parallel_layout, self.account_for
        if text is not None:
            if self.uneven or account:
                raise DegreeError("layout_conflict", "a layout string with another way to split the layers",
                                  uneven=self.uneven, account=account)
            try:
                stages = pipeline_layout.parse_layout(text)
                pipeline_layout.check_layout(stages, self.pp)
            except pipeline_layout.LayoutError as e:
                raise DegreeError("layout", str(e), layout=text, reason=str(e)) from None
            if len(stages) != self.pp * self.vp:
                raise DegreeError("layout_stages", f"{len(stages)} layout stages for pp {self.pp} x vp {self.vp}",
                                  layout=text, stages=len(stages), pp=self.pp, vp=self.vp)
        if self.uneven and account:
            raise DegreeError("account_conflict", "first/last layer numbers with the account-for splits")
        if account and self.pp == 1:
            raise DegreeError("account_without_pp", "the account-for splits need pp > 1")

    @property
    def account_for(self) -> bool:
        """The embedding or the loss counts as a layer in the even split."""
        return self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split

    @property
    def custom_split(self) -> bool:
        """The layers split otherwise than evenly over the stages (a layout, first/last numbers, account-for)."""
        return self.uneven or self.account_for or self.pipeline_model_parallel_layout is not None

    def _check_schedule(self) -> None:
        """The schedule against the pipeline degrees: every named schedule but ``1f1b`` needs ``pp > 1``;
        ``1f1b`` and ``zb-h1`` one chunk per rank, ``interleaved-1f1b`` more, ``zbv`` exactly two."""
        s = self.pipeline_schedule
        if s is None:
            return
        if s not in PIPELINE_SCHEDULES:
            raise DegreeError("schedule", f"unknown pipeline schedule {s!r}", schedule=s)
        if self.pp == 1 and s != "1f1b":
            raise DegreeError("schedule_pp", f"pipeline schedule {s} needs pp > 1", schedule=s, pp=self.pp)
        need = {"1f1b": "1", "zb-h1": "1", "zbv": "2", "dualpipev": "2", "interleaved-1f1b": "> 1"}[s]
        if (need == "> 1" and self.vp == 1) or (need != "> 1" and self.vp != int(need)):
            raise DegreeError("schedule_vp", f"pipeline schedule {s} needs vp {need}, got {self.vp}", schedule=s,
                              vp=self.vp, need=need)

    @property
    def v_shape(self) -> bool:
        """Chunks placed in a V (``zbv``, ``dualpipev``): rank ``r`` holds stages ``r`` and ``2p-1-r``, so the first
        and the last stage are both on pipeline rank 0."""
        return self.pipeline_schedule in ("zbv", "dualpipev")

    def stage_of(self, pp_rank: int, vp_stage: int = 0) -> int:
        """Global stage of chunk ``vp_stage`` on pipeline rank ``pp_rank``: ``c*p + r`` (Megatron's interleaving),
        or in a V (``zbv``) ``r`` and ``2p-1-r``."""
        if self.v_shape and vp_stage == 1:
            return 2 * self.pp - 1 - pp_rank
        return vp_stage * self.pp + pp_rank

    @property
    def uneven(self) -> bool:
        """The first or the last pipeline rank holds its own number of layers."""
        return self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None

    def place_stage(self, stage: int) -> tuple[int, int]:
        """``(pipeline rank, chunk)`` holding global ``stage`` (inverse of :meth:`stage_of`)."""
        if self.v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage, 1
        return stage % self.pp, stage // self.pp

    def layer_split_error(self, num_layers: int) -> DegreeError | None:
        """:func:`layer_split_error` for this layout: a layout string's transformer layers must be ``num_layers``;
        with the account-for splits ``num_layers`` plus the embedding and/or the loss split evenly into the
        ``p * v`` stages (Megatron's rule)."""
        text = self.pipeline_model_parallel_layout
        if text is not None:
            found = sum(pipeline_layout.stage_layer_counts(pipeline_layout.parse_layout(text)))
            if found != num_layers:
                return DegreeError("layout_layers", f"the layout holds {found} transformer layers, not {num_layers}",
                                   layout=text, found=found, num_layers=num_layers)
            return None
        if self.account_for:
            total = num_layers + self.account_for_embedding_in_pipeline_split + self.account_for_loss_in_pipeline_split
            if total % (self.pp * self.vp):
                return DegreeError("account_split", f"{total} layers (the embedding and/or loss counted) do not split "
                                   f"evenly into pp {self.pp} x vp {self.vp} stages", num_layers=num_layers,
                                   total=total, pp=self.pp, vp=self.vp)
            return None
        return layer_split_error(num_layers, self.pp, self.vp, self.decoder_first_pipeline_num_layers,
                                 self.decoder_last_pipeline_num_layers)

    def stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of every global stage, in stage order: the one per-stage source that
        :meth:`rank_num_layers` and :meth:`layer_range` (and through them the model, the schedules' chunks, the
        checkpoint's layout record, the planner) read. A layout string's ``t`` counts; the account-for splits give
        every stage ``(L + e + l) / (p * v)`` slots, the embedding taking one of the first stage's and the loss one
        of the last's; else each rank's layers (evenly ``L / p``, or first/last) shared by its ``v`` chunks."""
        error = self.layer_split_error(num_layers)
        if error is not None:
            raise error
        n = self.pp * self.vp
        if self.pipeline_model_parallel_layout is not None:
            return pipeline_layout.stage_layer_counts(pipeline_layout.parse_layout(self.pipeline_model_parallel_layout))
        if self.account_for:
            e, loss = self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split
            counts = [(num_layers + e + loss) // n] * n
            counts[0] -= e
            counts[-1] -= loss
            return tuple(counts)
        return tuple(self._rank_share(num_layers, self.place_stage(s)[0]) // self.vp for s in range(n))

    def rank_num_layers(self, num_layers: int, pp_rank: int) -> int:
        """Layers on pipeline rank ``pp_rank`` (all its chunks): the sum of its stages' :meth:`stage_layer_counts`
        (evenly ``L / p``; under an uneven split the first / last rank's own number and the rest shared evenly by
        the ranks between)."""
        counts = self.stage_layer_counts(num_layers)
        return sum(counts[self.stage_of(pp_rank, c)] for c in range(self.vp))

    def _rank_share(self, num_layers: int, pp_rank: int) -> int:
        """A rank's layers under the even or the first/last split (checked by the caller)."""
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if pp_rank == 0 and first is not None:
            return first
        if pp_rank == self.pp - 1 and last is not None:
            return last
        middle_ranks = self.pp - (first is not None) - (last is not None)
        return (num_layers - (first or 0) - (last or 0)) // middle_ranks

    @property
    def mtp_stage(self) -> int | None:
        """The global stage holding the multi-token-prediction layers when a layout puts them on a stage of their
        own, before the loss's (Megatron-LM's standalone MTP stage); None when they sit with the loss (or there are
        none)."""
        text = self.pipeline_model_parallel_layout
        return None if text is None else pipeline_layout.mtp_stage(pipeline_layout.parse_layout(text))

    @property
    def message_blocks(self) -> int:
        """``[s, b, h]`` blocks, along the sequence, in the pipeline messages from a standalone MTP stage of ``D``
        layers on: ``1 + D`` (it sends the decoder's hidden states and each depth's), else 1."""
        if self.mtp_stage is None:
            return 1
        return 1 + "".join(pipeline_layout.parse_layout(self.pipeline_model_parallel_layout)).count("m")

    def stage_message_blocks(self, stage: int) -> int:
        """Sequence blocks of global ``stage``'s output message: :attr:`message_blocks` from a standalone MTP stage
        on, 1 before it."""
        mtp = self.mtp_stage
        return self.message_blocks if mtp is not None and stage >= mtp else 1

    @property
    def loss_pp_rank(self) -> int:
        """The pipeline rank holding the last stage (output layer and loss): ``p-1``, or 0 in a V."""
        return 0 if self.v_shape else self.pp - 1

    @property
    def mtp_pp_rank(self) -> int:
        """The pipeline rank holding the multi-token-prediction layers: a standalone MTP stage's, else the loss's."""
        mtp = self.mtp_stage
        return self.loss_pp_rank if mtp is None else self.place_stage(mtp)[0]

    # ------------------------------------------------------------------ degrees and coordinates
    @property
    def dp(self) -> int:
        """Data-parallel size (without CP)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``--expert-tensor-parallel-size``, default TP)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Size of an expert-data-parallel group: ``TP*CP*DP / (ETP*EP)``."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def cp_outer(self) -> int | None:
        """The ring level of two-level CP: ``cp / cp_inner`` (None without ``cp_inner``)."""
        return None if self.cp_inner is None else self.cp // self.cp_inner

    @property
    def _sizes(self) -> tuple[int, ...]:
        return (self.tp, self.cp, self.dp, self.pp)

    @property
    def _expert_sizes(self) -> tuple[int, ...]:
        return (self.expert_tp, self.ep, self.expert_dp, self.pp)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: ``dict(tp=, cp=, dp=, pp=)`` and in the expert grid ``etp=, ep=, edp=``."""
        self._check_rank(rank)
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        dp = rank // (self.tp * self.cp) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        etp, ep = self.expert_tp, self.ep
        return dict(tp=tp, cp=cp, dp=dp, pp=pp, etp=rank % etp, ep=rank // etp % ep,
                    edp=rank // (etp * ep) % self.expert_dp)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        for name, value, size in (("tp", tp, self.tp), ("cp", cp, self.cp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} out of range [0, {size})")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")

    # ------------------------------------------------------------------ groups
    def _groups(self, spec: str) -> list[list[int]]:
        """Groups whose members differ only along the axes named in ``spec`` (e.g. ``"tp-pp"``)."""
        tokens = spec.split("-")
        if set(tokens) <= set(self._EXPERT_AXES) and set(tokens) - {"pp"}:  # the expert grid
            return masked_rank_groups(self._expert_sizes, [axis in tokens for axis in self._EXPERT_AXES])
        varying: set[str] = set()
        for token in tokens:
            if token not in self._TOKENS:
                raise ValueError(f"unknown axis {token!r} in {spec!r}; known: {sorted(self._TOKENS)} "
                                 f"(or only expert axes {list(self._EXPERT_AXES)})")
            varying.update(self._TOKENS[token])
        return masked_rank_groups(self._sizes, [axis in varying for axis in self._AXES])

    def tp_groups(self) -> list[list[int]]:
        """Tensor-parallel groups."""
        return self._groups("tp")

    def pp_groups(self) -> list[list[int]]:
        """Pipeline-parallel groups, each listed from the first stage to the last."""
        return self._groups("pp")

    def dp_groups(self) -> list[list[int]]:
        """Data-parallel groups without context parallelism."""
        return self._groups("dp")

    def dp_cp_groups(self) -> list[list[int]]:
        """Data x context parallel groups (gradient reduction when CP > 1)."""
        return self._groups("cp-dp")

    def cp_groups(self) -> list[list[int]]:
        """Context-parallel groups."""
        return self._groups("cp")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp x pp): all ranks sharing the dp and cp coordinates."""
        return self._groups("tp-pp")

    def tp_dp_groups(self) -> list[list[int]]:
        """Tensor x data parallel groups (FP8 amax reduction)."""
        return self._groups("tp-dp")

    def tp_dp_cp_groups(self) -> list[list[int]]:
        """Tensor x data x context parallel groups (FP8 amax reduction with CP)."""
        return self._groups("tp-cp-dp")

    def tp_cp_groups(self) -> list[list[int]]:
        """Tensor x context parallel groups."""
        return self._groups("tp-cp")

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups (expert grid): same etp, edp and pp; differing in the ep index."""
        return self._groups("ep")

    def etp_groups(self) -> list[list[int]]:
        """Expert tensor-parallel groups (expert grid): the ranks splitting one expert's weights."""
        return self._groups("etp")

    def tp_ep_groups(self) -> list[list[int]]:
        """Expert tensor x expert parallel groups: the ranks the all-gather dispatcher gathers tokens over."""
        return self._groups("etp-ep")

    def expert_dp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: same etp, ep and pp; the replicas of one expert shard (its gradient is
        reduced over this group)."""
        return self._groups("edp")

    def expert_mp_groups(self) -> list[list[int]]:
        """Expert model-parallel groups (etp x ep x pp): where the expert weights' gradient norm is summed."""
        return self._groups("etp-ep-pp")

    def _cp_level_groups(self, level: str) -> list[list[int]]:
        if self.cp_inner is None:
            return []
        sizes = (self.tp, self.cp_inner, self.cp_outer, self.dp, self.pp)
        return masked_rank_groups(sizes, [axis == level for axis in self._CP_LEVEL_AXES])

    def cp_inner_groups(self) -> list[list[int]]:
        """Two-level CP's all-to-all groups: ``cp_inner`` adjacent ranks of a CP group (none without
        ``cp_inner``)."""
        return self._cp_level_groups("cp_inner")

    def cp_outer_groups(self) -> list[list[int]]:
        """Two-level CP's ring groups: the ranks of a CP group at the same index inside their all-to-all group
        (none without ``cp_inner``)."""
        return self._cp_level_groups("cp_outer")

    def embedding_pp_ranks(self) -> list[int]:
        """Pipeline ranks holding a copy of the word embedding: the first; with ``tie_embeddings`` and PP > 1 also
        the last (in a V the first again); under a standalone MTP stage that stage's rank, and the last only when
        the output layer is tied."""
        if not self.tie_embeddings or self.pp == 1:
            return [0]
        mtp, stages = self.mtp_stage, {0}
        if mtp is not None:
            stages.add(mtp)
        if mtp is None or not self.untie_embeddings_and_output_weights:
            stages.add(self.pp * self.vp - 1)
        return sorted({self.place_stage(s)[0] for s in stages})

    def embedding_groups(self) -> list[list[int]]:
        """Per pipeline group: the ranks of :meth:`embedding_pp_ranks` (``[first, last]`` when embeddings are
        tied and PP > 1, else ``[first]``)."""
        ranks = self.embedding_pp_ranks()
        return [[g[r] for r in ranks] for g in self.pp_groups()]

    def position_embedding_groups(self) -> list[list[int]]:
        """Per pipeline group: ``[first]`` (learned absolute positions live on the first stage)."""
        return [[g[0]] for g in self.pp_groups()]

    GROUP_KINDS: ClassVar[tuple[str, ...]] = (
        "tp", "pp", "dp", "dp_cp", "cp", "mp", "tp_dp", "tp_dp_cp", "tp_cp", "ep", "expert_dp",
        "embedding", "position_embedding", "etp", "tp_ep", "expert_mp", "cp_inner", "cp_outer",
    )

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of ``kind`` (one of :attr:`GROUP_KINDS`; ``-`` may replace ``_``)."""
        key = kind.replace("-", "_")
        if key not in self.GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; known: {', '.join(self.GROUP_KINDS)}")
        return getattr(self, f"{key}_groups")()

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``; ``[]`` if none does (the embedding kinds on middle stages,
        the CP-level kinds without ``cp_inner``)."""
        self._check_rank(rank)
        for group in self.groups(kind):
            if rank in group:
                return group
        return []

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers of one model chunk (one virtual stage of one pipeline rank): ``L / (p * v)`` (an even split;
        otherwise each stage's is in :meth:`stage_layer_counts`)."""
        if self.custom_split:
            raise ValueError("the layer split is not the even one: each stage's layers are stage_layer_counts(L)")
        error = layer_split_error(num_layers, self.pp, self.vp)
        if error is not None:
            raise error
        return num_layers // (self.pp * self.vp)

    def layer_range(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> range:
        """Global layer indices of virtual stage ``vp_stage`` on pipeline rank ``pp_rank``.

        Chunk ``c`` on rank ``r`` is global stage :meth:`stage_of` and holds its :meth:`stage_layer_counts` layers
        (evenly ``L/(p*v)``; interleaved: layers ``c*L/v + r*L/(p*v)`` onward), after those of the earlier stages.
        Layer numbers are global in every layout.
        """
        if not (0 <= pp_rank < self.pp and 0 <= vp_stage < self.vp):
            raise ValueError(f"pp_rank {pp_rank} / vp_stage {vp_stage} out of range ({self.pp}, {self.vp})")
        stage = self.stage_of(pp_rank, vp_stage)
        counts = self.stage_layer_counts(num_layers)
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def describe(self) -> str:
        """One line for the log, e.g. ``world 16 = tp 2 x cp 1 x dp 2 x pp 4 (ep 1, vp 1)``."""
        experts = f"ep {self.ep}, " if self.etp is None else f"ep {self.ep}, etp {self.etp}, "
        if self.cp_inner is not None:
            experts = f"cp_inner {self.cp_inner} x cp_outer {self.cp_outer}, " + experts
        return (f"world {self.world_size} = tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp} "
                f"({experts}vp {self.vp}, tied embeddings {self.tie_embeddings})"
                + (f", schedule {self.pipeline_schedule}" if self.pipeline_schedule else "")
                + (f", layout {self.pipeline_model_parallel_layout}" if self.pipeline_model_parallel_layout else ""))
