"""Megatron-LM's pipeline layout string: which (virtual) pipeline stage holds the embedding, which transformer
layers, the multi-token-prediction layers and the loss. Pure functions on strings; ``ParallelDims`` reads a
layout through them and ``parallel_config`` turns a :class:`LayoutError` into the line naming the flag.

Grammar (Megatron-LM's ``PipelineParallelLayerLayout.parse_str_to_list``): stages are separated by ``|``; inside
a stage ``E`` is the embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction layer and
``L`` the output layer with the loss. ``x*n`` repeats one character ``n`` times, ``(...)*n`` repeats a group
(groups do not nest; a group may hold ``|``); commas are cosmetic. ``"Et*3|(tt|)*2,tL"`` is the four stages
``Ettt``, ``tt``, ``tt``, ``tL``.

The stages are listed in the order a microbatch visits them (global stages). With ``p`` pipeline ranks a layout
of ``n`` stages gives ``v = n / p`` chunks per rank, placed as ``ParallelDims.place_stage`` places global stages
(Megatron's interleaving: stage ``c*p + r`` is chunk ``c`` of rank ``r``; under the V schedule, a V).

The rules are Megatron-LM's (``validate_layer_layout``: ``E`` the first layer and ``L`` the last, each once,
every ``t`` before the ``m`` layers, all ``m`` on one stage) plus this model's placement: the embedding opens the
first stage and the loss closes the last (Megatron-LM also runs ``E``/``L`` after or before empty stages). A stage
between them may be empty: it passes its input on unchanged (and the gradient back), as Megatron-LM's pass-through
stages do. The ``m`` layers may sit on a stage before the loss's (a standalone MTP stage, :func:`mtp_stage`): its
output is the decoder's hidden states followed by each depth's along the sequence, which the stages after it pass
on and the loss stage splits (Megatron-LM's ``MultiTokenPredictionBlock`` / ``process_mtp_loss``).
"""
from __future__ import annotations

import functools
import itertools
import re
from typing import Sequence

__all__ = ["LayoutError", "LAYER_CHARS", "parse_layout", "check_layout", "mtp_stage", "stage_layer_counts",
           "layout_of_counts", "format_layout"]

LAYER_CHARS = "EtmL"  # embedding, transformer layer, multi-token-prediction layer, loss


class LayoutError(ValueError):
    """A layout string that cannot be run, stated in words (``parallel_config`` names the flag)."""


def _unroll(text: str) -> str:
    """Commas dropped, then ``(group)*n`` and ``x*n`` repeated, in that order (one pass each, as Megatron-LM)."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)


@functools.lru_cache(maxsize=64)
def parse_layout(text: str) -> tuple[str, ...]:
    """The stages of ``text``, each unrolled to a string of :data:`LAYER_CHARS`, in stage order."""
    stages = tuple(_unroll(text).split("|"))
    for k, stage in enumerate(stages):
        bad = next((ch for ch in stage if ch not in LAYER_CHARS), None)
        if bad is not None:
            raise LayoutError(f"stage {k} ({stage!r} once repeats are unrolled) holds {bad!r}; a stage holds only "
                              f"E (embedding), t (transformer layer), m (multi-token prediction) and L (loss), "
                              f"repeated as x*n or (group)*n with no nested groups")
    return stages


def check_layout(stages: Sequence[str], pp: int) -> None:
    """Raise :class:`LayoutError` unless the stages fit ``pp`` pipeline ranks and this model can place them."""
    n, flat = len(stages), "".join(stages)
    if n % pp:
        raise LayoutError(f"its {n} stages do not divide among {pp} pipeline ranks; give a multiple of {pp} stages "
                          f"(pipeline size x virtual stages per rank)")
    if pp == 1 and n > 1:
        raise LayoutError(f"its {n} stages need pipeline parallelism (one stage per pipeline rank and virtual "
                          f"stage), but the pipeline size is 1")
    for ch, what in (("E", "the embedding"), ("L", "the loss")):
        if flat.count(ch) != 1:
            raise LayoutError(f"it names {ch} ({what}) {flat.count(ch)} times; give it exactly once")
    if not flat.startswith("E"):
        raise LayoutError(f"its first layer is {flat[0]!r}; E (the embedding) must come first")
    if not flat.endswith("L"):
        raise LayoutError(f"its last layer is {flat[-1]!r}; L (the loss) must come last")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise LayoutError("a t comes after an m; every transformer layer must come before the multi-token "
                          "prediction layers")
    if not stages[0].startswith("E"):
        raise LayoutError("E (the embedding) is not in the first stage; this model keeps the embedding on the "
                          "first stage (drop the empty stages before it)")
    if not stages[-1].endswith("L"):
        raise LayoutError("L (the loss) is not in the last stage; this model keeps the loss on the last stage "
                          "(drop the empty stages after it)")
    holding = [k for k, stage in enumerate(stages) if "m" in stage]
    if len(holding) > 1:
        raise LayoutError(f"the m layers are on stages {holding[0]} and {holding[1]}; put every multi-token "
                          f"prediction layer on one stage (Megatron-LM's rule)")


def mtp_stage(stages: Sequence[str]) -> int | None:
    """The stage holding the ``m`` layers when it is not the loss's (a standalone MTP stage), else None."""
    holding = [k for k, stage in enumerate(stages) if "m" in stage]
    return holding[0] if holding and "L" not in stages[holding[0]] else None


def stage_layer_counts(stages: Sequence[str]) -> tuple[int, ...]:
    """Transformer layers (``t``) of every stage."""
    return tuple(stage.count("t") for stage in stages)


def layout_of_counts(counts: Sequence[int], mtp_num_layers: int = 0) -> tuple[str, ...]:
    """The stages of a split given as transformer layers per stage: ``E`` opens the first, the ``m`` layers and
    ``L`` close the last (the layout equivalent to ``--decoder-first/last-pipeline-num-layers`` and the
    account-for splits)."""
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_num_layers + "L"
    return tuple(stages)


def _stage_text(stage: str) -> str:
    runs = ((ch, len(list(group))) for ch, group in itertools.groupby(stage))
    return "".join(ch * k if k < 3 else f"{ch}*{k}" for ch, k in runs)


def format_layout(stages: Sequence[str]) -> str:
    """A short string that :func:`parse_layout` reads back as ``stages``: runs of 3 or more as ``x*n``, repeated
    stages as ``(stage|)*n`` (a comma after it, as Megatron-LM writes them), e.g. ``Et*3|(tt|)*2,tL``."""
    out, i, n = "", 0, len(stages)
    while i < n - 1:  # the last stage, with no "|" after it, is written on its own
        k = 1
        while i + k < n - 1 and stages[i + k] == stages[i]:
            k += 1
        out += f"({_stage_text(stages[i])}|)*{k}," if k > 1 and stages[i] else _stage_text(stages[i]) + "|"
        i += k if stages[i] else 1
    return out + _stage_text(stages[-1])
