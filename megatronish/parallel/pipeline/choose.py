"""Which schedule runs a layout: ``--pipeline-schedule`` (``ParallelDims.pipeline_schedule``), else Megatron's
choice from the degrees (:func:`.schedules.get_forward_backward_func`: 1F1B, interleaved with virtual stages)."""
from __future__ import annotations

import functools

from .schedules import get_forward_backward_func
from .zb_runner import forward_backward_zero_bubble
from .zero_bubble import SCHEDULES

__all__ = ["forward_backward_func"]


def forward_backward_func(pp: int, vp: int = 1, schedule: str | None = None):
    """The schedule function for ``pp`` pipeline ranks with ``vp`` chunks each: ``zb-h1``, ``zbv`` and ``dualpipev``
    split the backward (:func:`.zb_runner.forward_backward_zero_bubble`); ``1f1b``, ``interleaved-1f1b`` and None
    are the schedules Megatron picks from the degrees (``ParallelDims`` has checked that they agree)."""
    if schedule in SCHEDULES:
        return functools.partial(forward_backward_zero_bubble, schedule=schedule)
    return get_forward_backward_func(pp, vp)
