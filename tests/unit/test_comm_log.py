"""The ring of collectives (``megatronish.parallel.comm_log``): what a record holds, and the diagnosis that picks the
collective and the first rank that is elsewhere from every rank's ring (hand-made rings, no processes)."""
import json

import pytest
import torch
import torch.distributed as dist

from megatronish.parallel import comm_log

HERE = "tests/unit/test_comm_log.py"


class _Group:
    """Stands in for a process group (only its identity matters to the recorder)."""


# torch's all-gather into one tensor: all_gather_single where this torch has it (comm_log calls it then)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


@pytest.fixture
def calls(monkeypatch):
    """torch.distributed's collectives replaced by recorders of their calls; a fresh ring."""
    seen = []
    for name in ("all_reduce", GATHER, "barrier", SCATTER):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: seen.append((_name, a, k)))
    monkeypatch.setattr(comm_log, "_LOG", comm_log.CommLog())
    return seen


def _line_of(fn_source_marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if fn_source_marker in line)


def test_the_ring_records_kind_group_tensors_site_and_sequence_numbers(calls):
    tp, dp = _Group(), _Group()
    comm_log.register_group(tp, "tp", (0, 1))
    comm_log.register_group(dp, "dp", (0, 2))
    x, y = torch.zeros(4, 3), torch.zeros(2, 5, dtype=torch.bfloat16)
    comm_log.all_reduce(x, group=tp)  # site: first
    comm_log.all_gather_into_tensor(torch.empty(4, 5, dtype=torch.bfloat16), y, group=dp)
    comm_log.all_reduce(x, group=tp, op=dist.ReduceOp.MAX)
    comm_log.barrier()  # site: world
    assert [c[0] for c in calls] == ["all_reduce", GATHER, "all_reduce", "barrier"]
    assert calls[2][2]["op"] == dist.ReduceOp.MAX and calls[2][2]["group"] is tp  # passed on unchanged

    snap = json.loads(json.dumps(comm_log.snapshot()))
    recs = snap["records"]
    assert [(r["seq"], r["group"], r["group_seq"], r["kind"]) for r in recs] == [
        (1, "tp", 1, "all_reduce"), (2, "dp", 1, "all_gather_into_tensor"), (3, "tp", 2, "all_reduce"),
        (4, "world", 1, "barrier")]
    assert recs[0]["tensors"] == ["[4, 3] float32"] and recs[1]["tensors"] == ["[2, 5] bfloat16"]
    assert recs[3]["tensors"] == []
    fn = "test_the_ring_records_kind_group_tensors_site_and_sequence_numbers"
    assert recs[0]["site"] == f"{HERE}:{_line_of('# site: first')} in {fn}"
    assert recs[3]["site"] == f"{HERE}:{_line_of('# site: world')} in {fn}"
    assert snap["groups"]["tp"] == [0, 1] and snap["groups"]["dp"] == [0, 2]
    assert snap["counts"] == {"tp": 2, "dp": 1, "world": 1} and snap["failed"] is None


def test_the_call_that_raised_is_marked_and_the_ring_keeps_its_size(monkeypatch, calls):
    monkeypatch.setattr(comm_log, "_LOG", comm_log.CommLog(size=3))
    tp = _Group()
    comm_log.register_group(tp, "tp", (0, 1))
    for _ in range(4):
        comm_log.all_reduce(torch.zeros(2), group=tp)

    def timeout(*a, **k):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    monkeypatch.setattr(dist, SCATTER, timeout)
    with pytest.raises(RuntimeError, match="Timed out"):
        comm_log.reduce_scatter_tensor(torch.empty(1), torch.zeros(2), group=tp)
    snap = comm_log.snapshot("failed", "timed out")
    assert [r["seq"] for r in snap["records"]] == [3, 4, 5] and snap["counts"] == {"tp": 5}
    assert snap["failed"] == 5 and snap["state"] == "failed" and snap["error"] == "timed out"


# ---------------------------------------------------------------------------------------------- the diagnosis
def _rec(seq, kind, group, group_seq, site="a.py:1 in f", tensors=("[4] float32",)):
    return {"seq": seq, "kind": kind, "group": group, "group_seq": group_seq, "site": site,
            "tensors": list(tensors)}


def _ring(records, groups, failed=None, state="running", error=None):
    counts = {}
    for r in records:
        counts[r["group"]] = max(counts.get(r["group"], 0), r["group_seq"])
    return {"state": state, "error": error, "failed": failed, "groups": groups, "counts": counts,
            "records": records, "seq": records[-1]["seq"] if records else 0}


TP2 = {"tp": [0, 1], "world": [0, 1]}


def test_a_rank_that_never_arrived_is_named_with_its_last_collectives():
    rings = {
        0: _ring([_rec(1, "all_reduce", "tp", 1), _rec(2, "all_reduce", "tp", 2, "m.py:22 in _all_reduce")], TP2,
                 failed=2, error="timed out"),
        1: _ring([_rec(1, "all_reduce", "tp", 1), _rec(2, "barrier", "world", 1, "t.py:9 in step", ())], TP2),
    }
    d = comm_log.diagnose(rings)
    assert (d["rank"], d["other"], d["other_record"]) == (0, 1, None)
    assert d["collective"]["kind"] == "all_reduce" and d["collective"]["group_seq"] == 2
    line = comm_log.format_diagnosis(d)
    assert "\n" not in line
    assert line == ("collective all_reduce #2 on group tp [0, 1] ([4] float32) at m.py:22 in _all_reduce did not "
                    "complete on rank 0 (timed out): rank 1 never reached it; rank 1's last collectives: "
                    "all_reduce #1 on tp at a.py:1 in f; barrier #1 on world at t.py:9 in step")


def test_a_different_collective_at_the_same_sequence_number():
    rings = {
        0: _ring([_rec(1, "all_gather", "tp", 1, "m.py:41 in _gather_along")], TP2, failed=1),
        1: _ring([_rec(1, "reduce_scatter_tensor", "tp", 1, "m.py:52 in _reduce_scatter_first")], TP2),
    }
    d = comm_log.diagnose(rings)
    assert (d["rank"], d["other"]) == (0, 1) and d["other_record"]["kind"] == "reduce_scatter_tensor"
    assert ("rank 1 issued reduce_scatter_tensor at m.py:52 in _reduce_scatter_first there instead"
            in comm_log.format_diagnosis(d))
    # the same kind from another line of code is elsewhere too
    rings[1]["records"][0].update(kind="all_gather", site="m.py:99 in other")
    assert comm_log.diagnose(rings)["other"] == 1


def test_the_lowest_member_in_another_group_is_named():
    """TP 4: ranks 1 and 3 reached the all-reduce, rank 2 waits in a data-parallel one (and rank 3 finished)."""
    tp4 = {"tp": [0, 1, 2, 3], "dp": [2, 6]}
    ar = [_rec(1, "all_reduce", "tp", 1), _rec(2, "all_reduce", "tp", 2, "m.py:22 in _all_reduce")]
    rings = {
        0: _ring(ar, tp4, failed=2),
        1: _ring(ar, tp4),
        2: _ring([ar[0], _rec(2, "all_reduce", "dp", 1, "ddp.py:5 in sync")], tp4),
        3: _ring(ar[:1], tp4, state="finished"),
    }
    d = comm_log.diagnose(rings)
    assert (d["rank"], d["other"]) == (0, 2)
    assert comm_log.format_diagnosis(d).endswith("all_reduce #1 on tp at a.py:1 in f; "
                                                 "all_reduce #1 on dp at ddp.py:5 in sync")
    del rings[2]["records"][1]  # now rank 2 is at the all-reduce's place: rank 3 (finished) is the first elsewhere
    rings[2]["records"].append(ar[1])
    rings[2]["counts"] = {"tp": 2}
    d = comm_log.diagnose(rings)
    assert d["other"] == 3 and "rank 3 never reached it (it had finished)" in comm_log.format_diagnosis(d)


def test_nothing_to_name_when_every_rank_got_there():
    ar = [_rec(1, "all_reduce", "tp", 1), _rec(2, "all_reduce", "tp", 2)]
    rings = {0: _ring(ar, TP2), 1: _ring(ar, TP2)}
    assert comm_log.diagnose(rings) is None
    # a record that left a rank's ring (its count says it was issued) is not "never arrived": rank 1 is not named
    # for rank 0's all-reduce #2; rank 0 is named for rank 1's #3
    rings[0]["failed"] = 2
    rings[1] = _ring([_rec(9, "all_reduce", "tp", 3)], TP2)
    d = comm_log.diagnose(rings)
    assert (d["rank"], d["other"], d["collective"]["group_seq"]) == (1, 0, 3)
