"""Every collective the package issues, recorded in a small per-process ring, and the diagnosis of a hang from
every rank's ring (docs/reliability.md).

The package calls the thin wrappers here (``all_reduce``, ``all_gather``, ``reduce_scatter_tensor``, ...) instead
of ``torch.distributed``'s functions; each appends one tuple to this process's ring and calls ``torch.distributed``
with the same arguments. A record holds the process's sequence number, the group's sequence number (the n-th
collective this process issued on that group), the kind, the group's name (its kind in the
:class:`~megatronish.parallel.context.ParallelContext`, registered by ``groups.initialize_model_parallel``;
``world`` for the default group; any other group is named by its rank list), the tensors' shapes and dtypes, and
the call site (the first frame outside this module and ``torch``). Nothing is sent anywhere while recording.

When a collective fails (a timeout, a mismatch), the training entry point gathers every rank's ring
(:func:`snapshot`, published through the rank watchdog's store connection) and :func:`diagnose` finds the
collective and the first rank that is elsewhere: the lowest member of the collective's group whose ring at that
group sequence number holds a different collective (kind or site), or nothing because it never got there.
Point-to-point operations are recorded too (kind ``p2p``, counted apart from the group's collectives).
"""
from __future__ import annotations

import os
import sys
from collections import deque

import torch
import torch.distributed as dist

__all__ = ["CommLog", "log", "reset", "register_group", "snapshot", "diagnose", "format_diagnosis",
           "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
           "barrier", "send", "recv",
           "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object", "P2POp", "ISEND",
           "IRECV"]

RING_SIZE = 64  # records kept per process
SHOWN = 3  # collectives of the rank that is elsewhere named in the line

# Point-to-point batches: P2POp(ISEND | IRECV, tensor, peer, group, tag) lists go to batch_isend_irecv below.
P2POp, ISEND, IRECV = dist.P2POp, dist.isend, dist.irecv

_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep  # the directory holding the package
_P2P = "p2p"


class CommLog:
    """One process's ring of collectives (``record``), the names of its groups, and the record whose call raised."""

    def __init__(self, size: int = RING_SIZE):
        self.ring: deque = deque(maxlen=size)
        self.seq = 0
        self.group_seq: dict = {}  # group key -> collectives issued on it
        self.groups: dict = {}  # group -> (name, ranks)
        self.failed: tuple | None = None

    def register_group(self, group, name: str, ranks) -> None:
        if group is not None:
            self.groups[group] = (name, tuple(ranks))

    def _group(self, group) -> tuple[str, tuple[int, ...]]:
        info = self.groups.get(group)
        if info is not None:
            return info
        if group is None or group is dist.GroupMember.WORLD:
            ranks = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
            info = ("world", ranks)
        else:
            try:
                ranks = tuple(dist.get_process_group_ranks(group))
            except Exception:  # a stand-in group: its own call names the problem
                ranks = tuple(getattr(group, "ranks", ()))
            info = (str(list(ranks)), ranks)
        self.groups[group] = info
        return info

    def record(self, kind: str, group, tensors: tuple) -> tuple:
        """Append one record; the caller's frame is found past this module and ``torch``."""
        name, _ = self._group(group)
        key = group if kind != _P2P else (_P2P, group)
        gseq = self.group_seq.get(key, 0) + 1
        self.group_seq[key] = gseq
        self.seq += 1
        f = sys._getframe(2)
        while f.f_back is not None and (f.f_code.co_filename == _HERE or f.f_code.co_filename.startswith(_TORCH)):
            f = f.f_back
        rec = (self.seq, gseq, kind, name, tensors, f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        self.ring.append(rec)
        return rec

    def snapshot(self, state: str = "running", error: str | None = None) -> dict:
        """The ring as plain data (JSON): ``records`` oldest first, ``groups`` (name -> ranks), ``counts`` (name ->
        collectives issued on it), ``failed`` (the process sequence number of the call that raised, if any)."""
        ring, failed = tuple(self.ring), self.failed  # one step under the GIL: safe against the recording thread
        groups = {name: list(ranks) for name, ranks in list(self.groups.values())}
        counts = {self._group(key)[0]: n for key, n in list(self.group_seq.items())
                  if not (isinstance(key, tuple) and key and key[0] == _P2P)}
        return {"state": state, "error": error, "seq": self.seq, "failed": failed[0] if failed else None,
                "groups": groups, "counts": counts, "records": [_as_dict(rec) for rec in ring]}


def _as_dict(rec: tuple) -> dict:
    seq, gseq, kind, name, tensors, path, line, func = rec
    if path.startswith(_ROOT):
        path = path[len(_ROOT):]
    return {"seq": seq, "group": name, "group_seq": gseq, "kind": kind,
            "tensors": [_describe(t) for t in tensors], "site": f"{path}:{line} in {func}"}


def _describe(t) -> str:
    if isinstance(t, str):
        return t
    if len(t) == 3:  # a point-to-point op: (op, peer, tensor)
        return f"{t[0]} {t[1]} {list(t[2].shape)} {str(t[2].dtype).replace('torch.', '')}"
    shape, dtype = t
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


_LOG = CommLog()


def log() -> CommLog:
    """This process's ring."""
    return _LOG


def reset() -> None:
    """Start a fresh ring (a forked process that must not inherit its parent's records)."""
    global _LOG
    _LOG = CommLog()


def register_group(group, name: str, ranks) -> None:
    """Name ``group`` (its kind in the parallel context) in this process's records."""
    _LOG.register_group(group, name, ranks)


def snapshot(state: str = "running", error: str | None = None) -> dict:
    return _LOG.snapshot(state, error)


# ------------------------------------------------------------------------------------------ the wrappers
def _t(x) -> tuple:
    return (x.shape, x.dtype)


def _call(rec, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException:
        _LOG.failed = rec
        raise


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return _call(_LOG.record("all_reduce", group, (_t(tensor),)), dist.all_reduce, tensor, op=op, group=group,
                 async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _call(_LOG.record("all_gather", group, (_t(tensor),)), dist.all_gather, tensor_list, tensor,
                 group=group, async_op=async_op)


def _gather_into_tensor():
    """One all-gather into a flat tensor: torch's ``all_gather_single`` where it exists (newer torch warns that
    ``all_gather_into_tensor``, the same collective, is deprecated), else ``all_gather_into_tensor``."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _call(_LOG.record("all_gather_into_tensor", group, (_t(input_tensor),)), _gather_into_tensor(),
                 output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_single(output, input, group=None, async_op=False):
    return _call(_LOG.record("all_gather_single", group, (_t(input),)), _gather_into_tensor(), output, input,
                 group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return _call(_LOG.record("reduce_scatter", group, tuple(_t(x) for x in input_list)), dist.reduce_scatter,
                 output, input_list, op=op, group=group, async_op=async_op)


def _reduce_scatter_from_tensor():
    """One reduce-scatter from a flat tensor: ``reduce_scatter_single`` where this torch has it (newer torch warns
    that ``reduce_scatter_tensor``, the same collective, is deprecated), else ``reduce_scatter_tensor``."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return _call(_LOG.record("reduce_scatter_tensor", group, (_t(input),)), _reduce_scatter_from_tensor(), output,
                 input, op=op, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return _call(_LOG.record("reduce_scatter_single", group, (_t(input),)), _reduce_scatter_from_tensor(), output,
                 input, op=op, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return _call(_LOG.record("all_to_all", group, tuple(_t(x) for x in input_tensor_list)), dist.all_to_all,
                 output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    return _call(_LOG.record("all_to_all_single", group, (_t(input),)), dist.all_to_all_single, output, input,
                 output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
                 async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    return _call(_LOG.record("broadcast", group, (_t(tensor),)), dist.broadcast, tensor, src=src, group=group,
                 async_op=async_op)


def barrier(group=None):
    return _call(_LOG.record("barrier", group, ()), dist.barrier, group=group)


def send(tensor, dst, group=None, tag=0):
    return _call(_LOG.record(_P2P, group, (("send to", dst, tensor),)), dist.send, tensor, dst, group=group,
                 tag=tag)


def recv(tensor, src=None, group=None, tag=0):
    return _call(_LOG.record(_P2P, group, (("recv from", src, tensor),)), dist.recv, tensor, src, group=group,
                 tag=tag)


def batch_isend_irecv(p2p_op_list):
    ops = tuple(("send to" if op.op is ISEND else "recv from", op.peer, op.tensor) for op in p2p_op_list)
    group = p2p_op_list[0].group if p2p_op_list else None
    return _call(_LOG.record(_P2P, group, ops), dist.batch_isend_irecv, p2p_op_list)


def all_gather_object(object_list, obj, group=None):
    return _call(_LOG.record("all_gather_object", group, ("object",)), dist.all_gather_object, object_list, obj,
                 group=group)


def broadcast_object_list(object_list, src=None, group=None):
    return _call(_LOG.record("broadcast_object_list", group, ("object",)), dist.broadcast_object_list,
                 object_list, src=src, group=group)


def gather_object(obj, object_gather_list=None, dst=None, group=None):
    return _call(_LOG.record("gather_object", group, ("object",)), dist.gather_object, obj, object_gather_list,
                 dst=dst, group=group)


# ------------------------------------------------------------------------------------------ the diagnosis
def _current(ring: dict) -> dict | None:
    """The collective a rank is in: the one whose call raised, else its latest."""
    records = ring.get("records") or []
    if ring.get("failed") is not None:
        for rec in records:
            if rec["seq"] == ring["failed"]:
                return rec
    return records[-1] if records else None


def _at(ring: dict, group: str, group_seq: int, kind: str) -> dict | None:
    for rec in ring.get("records") or []:
        if rec["group"] == group and rec["group_seq"] == group_seq and (rec["kind"] == _P2P) == (kind == _P2P):
            return rec
    return None


def _elsewhere(cur: dict, ring: dict | None) -> tuple[bool, dict | None]:
    """Whether the rank with ``ring`` is elsewhere than the collective ``cur``, and its record at that place."""
    if ring is None:
        return True, None
    if cur["kind"] == _P2P:  # a peer of a point-to-point batch: elsewhere unless it is in one on the group too
        last = _current(ring)
        return not (last and last["kind"] == _P2P and last["group"] == cur["group"]), None
    rec = _at(ring, cur["group"], cur["group_seq"], cur["kind"])
    if rec is None:  # never got there, or the record left its ring (then its count says it did)
        return (ring.get("counts") or {}).get(cur["group"], 0) < cur["group_seq"], None
    return (rec["kind"], rec["site"]) != (cur["kind"], cur["site"]), rec


def diagnose(rings: dict[int, dict]) -> dict | None:
    """From every rank's :func:`snapshot` (``{rank: ring}``): the collective of the lowest rank whose collective
    has a member elsewhere, and that member (the lowest one). ``{"rank", "collective", "ranks", "other",
    "other_record", "other_last"}``, or None when every member of every rank's collective got there."""
    for r in sorted(rings):
        cur = _current(rings[r])
        if cur is None:
            continue
        members = rings[r].get("groups", {}).get(cur["group"], [])
        if cur["kind"] == _P2P:
            members = sorted({int(t.split()[2]) for t in cur["tensors"] if t.split()[2].isdigit()})
        for q in sorted(members):
            if q == r:
                continue
            away, rec = _elsewhere(cur, rings.get(q))
            if away:
                other = rings.get(q) or {}
                return {"rank": r, "collective": cur, "ranks": list(members), "other": q, "other_record": rec,
                        "other_last": (other.get("records") or [])[-SHOWN:], "other_state": other.get("state"),
                        "error": rings[r].get("error")}
    return None


def _name(rec: dict) -> str:
    return f"{rec['kind']} #{rec['group_seq']} on {rec['group']} at {rec['site']}"


def format_diagnosis(d: dict) -> str:
    """The one line: the collective, where it is, and the first rank that is elsewhere with its last collectives."""
    cur, q = d["collective"], d["other"]
    ranks = d["ranks"]
    group = cur["group"] if cur["group"] == str(ranks) or cur["kind"] == _P2P else f"{cur['group']} {ranks}"
    tensors = ", ".join(cur["tensors"])
    what = (f"{cur['kind']} #{cur['group_seq']} on group {group} ({tensors}) at {cur['site']}"
            if cur["kind"] != _P2P else f"p2p on group {group} ({tensors}) at {cur['site']}")
    cause = f" ({d['error']})" if d.get("error") else ""
    if d["other_record"] is not None:
        away = f"rank {q} issued {d['other_record']['kind']} at {d['other_record']['site']} there instead"
    else:
        away = f"rank {q} never reached it"
    if d.get("other_state") == "finished":
        away += " (it had finished)"
    last = "; ".join(_name(rec) for rec in d["other_last"]) or "none"
    return (f"collective {what} did not complete on rank {d['rank']}{cause}: {away}; rank {q}'s last collectives: "
            f"{last}")
