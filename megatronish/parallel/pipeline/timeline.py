"""Pipeline timeline: per-rank forward / backward / send / recv spans, written as a Chrome trace.

A :class:`PipelineTimeline` is passed to a schedule (``timeline=``); ``None`` (the default) records nothing
and costs one ``is None`` test per step. Each event is a dict::

    {"rank": global rank, "name": "F" | "B" | p2p op name, "cat": "compute" | "comm",
     "start": seconds, "end": seconds, "microbatch": int | None, "chunk": int | None}

Times are wall-clock seconds (``time.time_ns``), so ranks on one host (and NTP-synced hosts) share an axis.
:func:`gather_timeline` collects every rank's events on rank 0; :func:`write_chrome_trace` writes them as
Chrome trace JSON (one process row per rank, compute and comm on two thread rows), which Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open; ``tools/plot_timeline.py`` draws it as a PNG and
:func:`ascii_timeline` as text (one row per rank). Waits for receives posted ahead
(``--overlap-p2p-communication``) are ``wait_activation`` / ``wait_gradient`` spans in the ``comm`` category.
"""
from __future__ import annotations

import contextlib
import json
import time

__all__ = ["PipelineTimeline", "gather_timeline", "write_chrome_trace", "read_chrome_trace", "bubble_fraction",
           "steady_state_bubble", "ascii_timeline"]


class PipelineTimeline:
    """Recorder for one rank. ``synchronize``: wait for the device before reading the clock (GPU)."""

    def __init__(self, rank: int | None = None, *, synchronize: bool = True):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank
        self.events: list[dict] = []
        self._sync = None
        if synchronize:
            from ... import device

            if device.device_type() == "cuda":
                self._sync = device.synchronize

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.time_ns() * 1e-9

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", microbatch: int | None = None, chunk: int | None = None):
        start = self._now()
        try:
            yield
        finally:
            self.events.append({"rank": self.rank, "name": name, "cat": cat, "start": start, "end": self._now(),
                                "microbatch": microbatch, "chunk": chunk})

    def clear(self) -> None:
        self.events.clear()


def span(timeline: PipelineTimeline | None, name: str, cat: str = "compute", microbatch=None, chunk=None):
    """``timeline.span(...)`` or a no-op context when the timeline is off."""
    if timeline is None:
        return contextlib.nullcontext()
    return timeline.span(name, cat, microbatch, chunk)


def gather_timeline(timeline: PipelineTimeline | None, dst: int = 0, group=None) -> list[dict] | None:
    """Every rank's events on ``dst`` (a flat list sorted by start; ``None`` on other ranks).

    Collective over ``group`` (default: the world): every rank must call it, with or without a timeline.
    """
    import torch.distributed as dist

    from .. import comm_log as comm

    mine = [] if timeline is None else list(timeline.events)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return sorted(mine, key=lambda e: e["start"])
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    comm.gather_object(mine, gathered, dst=dst, group=group)
    if gathered is None:
        return None
    return sorted((e for events in gathered for e in events), key=lambda e: e["start"])


def write_chrome_trace(path: str, events: list[dict], metadata: dict | None = None) -> None:
    """Write ``events`` (from all ranks) as Chrome trace JSON: pid = rank, tid 0 = compute, tid 1 = comm.

    ``metadata`` (e.g. ``{"p": 4, "v": 2, "m": 8}``) is stored under ``otherData`` for the plotting tool.
    """
    t0 = min((e["start"] for e in events), default=0.0)
    trace = []
    for rank in sorted({e["rank"] for e in events}):
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for tid, label in ((0, "compute"), (1, "p2p")):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
    for e in events:
        label = e["name"]
        if e["microbatch"] is not None:
            label += f"{e['microbatch']}" + (f".c{e['chunk']}" if e["chunk"] is not None else "")
        trace.append({"ph": "X", "name": label, "cat": e["cat"], "pid": e["rank"],
                      "tid": 0 if e["cat"] == "compute" else 1,
                      "ts": (e["start"] - t0) * 1e6, "dur": max(e["end"] - e["start"], 0.0) * 1e6,  # microseconds
                      "args": {"kind": e["name"], "microbatch": e["microbatch"], "chunk": e["chunk"]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": metadata or {}}, f)


def read_chrome_trace(path: str) -> tuple[list[dict], dict]:
    """Events (in :class:`PipelineTimeline`'s form, seconds from the trace start) and the metadata."""
    with open(path) as f:
        data = json.load(f)
    events = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        events.append({"rank": e["pid"], "name": args.get("kind", e["name"]), "cat": e.get("cat", "compute"),
                       "start": e["ts"] * 1e-6, "end": (e["ts"] + e["dur"]) * 1e-6,
                       "microbatch": args.get("microbatch"), "chunk": args.get("chunk")})
    return events, data.get("otherData", {})


def bubble_fraction(events: list[dict]) -> dict:
    """Measured pipeline bubble from the compute spans of all ranks.

    The iteration window is the first compute start to the last compute end over all ranks. Per rank,
    ``idle = window - busy``. Returns ``{"bubble": mean idle / mean busy, "idle_of_total": mean idle / window,
    "window": seconds, "per_rank": {rank: idle / busy}}``. ``bubble`` is comparable to Megatron's
    ``(p - 1) / (v * m)``, which is bubble time over ideal (busy) time.
    """
    compute = [e for e in events if e["cat"] == "compute"]
    if not compute:
        return {"bubble": float("nan"), "idle_of_total": float("nan"), "window": 0.0, "per_rank": {}}
    start, end = min(e["start"] for e in compute), max(e["end"] for e in compute)
    window = end - start
    busy: dict[int, float] = {}
    for e in compute:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + (e["end"] - e["start"])
    per_rank = {r: (window - b) / b for r, b in sorted(busy.items())}
    mean_busy = sum(busy.values()) / len(busy)
    mean_idle = window - mean_busy
    return {"bubble": mean_idle / mean_busy, "idle_of_total": mean_idle / window, "window": window,
            "per_rank": per_rank}


def steady_state_bubble(events: list[dict]) -> dict:
    """Measured bubble of back-to-back iterations that are not synchronized between each other (each compute span
    tagged with its ``"iteration"``): per rank, the period is the time from its first compute start in the first
    iteration to that of the last, over the iterations between; ``bubble = (mean period - mean busy) / mean busy``,
    busy the rank's compute per iteration over those iterations (the first and last iteration only bound the
    window). Comparable to :func:`bubble_fraction`'s ``bubble`` and to each schedule's formula. Returns
    ``{"bubble", "period", "busy", "per_rank": {rank: (period - busy) / busy}}``."""
    compute = [e for e in events if e["cat"] == "compute"]
    its = sorted({e["iteration"] for e in compute})
    first, last = its[0], its[-1]
    periods, busies, per_rank = [], [], {}
    for r in sorted({e["rank"] for e in compute}):
        mine = [e for e in compute if e["rank"] == r]
        starts = {i: min(e["start"] for e in mine if e["iteration"] == i) for i in (first, last)}
        period = (starts[last] - starts[first]) / (last - first)
        busy = sum(e["end"] - e["start"] for e in mine if first <= e["iteration"] < last) / (last - first)
        periods.append(period)
        busies.append(busy)
        per_rank[r] = (period - busy) / busy
    period, busy = sum(periods) / len(periods), sum(busies) / len(busies)
    return {"bubble": (period - busy) / busy, "period": period, "busy": busy, "per_rank": per_rank}


def ascii_timeline(events: list[dict], columns: int = 96) -> str:
    """The compute spans of all ranks as text, one row per rank over ``columns`` equal time slots from the first
    compute start to the last end: ``F``/``B``/``W`` for chunk 0 (or a single chunk), ``f``/``b``/``w`` for the
    other chunks, ``.`` idle. A slot shows the step that covers most of it."""
    compute = [e for e in events if e["cat"] == "compute"]
    if not compute:
        return ""
    start, end = min(e["start"] for e in compute), max(e["end"] for e in compute)
    slot = (end - start) / columns or 1.0
    rows = {}
    for r in sorted({e["rank"] for e in compute}):
        cover = [(0.0, ".")] * columns  # (covered time, letter) per slot
        for e in (e for e in compute if e["rank"] == r):
            letter = e["name"][0].upper() if not e["chunk"] else e["name"][0].lower()
            first, last = int((e["start"] - start) / slot), min(int((e["end"] - start) / slot), columns - 1)
            for i in range(first, last + 1):
                lo, hi = start + i * slot, start + (i + 1) * slot
                covered = min(hi, e["end"]) - max(lo, e["start"])
                if covered > cover[i][0]:
                    cover[i] = (covered, letter)
        rows[r] = "".join(letter if covered >= slot / 2 else "." for covered, letter in cover)
    return "\n".join(f"rank {r} |{row}|" for r, row in rows.items())
