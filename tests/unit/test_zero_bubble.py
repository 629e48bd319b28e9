"""Zero-bubble schedules without processes: every rank's action list is valid (each F before its B before its
W, each stage's steps in microbatch order, sends match receives in order), a replay of all ranks runs to the
end (no deadlock, every step after the steps whose tensors it uses) for p in 2..8 and m in p..4p (dualpipev:
2p..4p), also with the receives posted ahead (``--overlap-p2p-communication``: each link's messages keep their
order, the bubble does not grow); the bubble of a unit-time replay (F = B = W = 1, 1F1B's and the
interleaved schedule's backward B = 2) for p = 4, m = 8 and 16; each rank's peak in-flight microbatches against
the schedule's formula; the split backward's gradients equal the unsplit backward's bitwise; and the text
timeline of a few spans."""
import functools

import pytest
import torch

from megatronish.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.parallel.pipeline.schedules import schedule_table
from megatronish.parallel.pipeline.timeline import ascii_timeline
from megatronish.parallel.pipeline.zero_bubble import (
    SCHEDULES,
    Action,
    dualpipev_order,
    num_chunks,
    peak_in_flight,
    post_receives_early,
    schedule_actions,
    simulate,
    stage_of,
)
from megatronish.parallel.weight_grad import WeightGradStore, attached, backward_input, backward_weight
from megatronish.precision.fp8 import Fp8LinearState, Fp8Recipe

UNIT = {"F": 1, "B": 1, "W": 1}


@functools.lru_cache(maxsize=None)
def _lists(schedule, p, m):
    return schedule_actions(schedule, p, m)


def _replay(schedule, p, m, early=False):
    lists = _lists(schedule, p, m)
    if early:
        lists = [post_receives_early(actions) for actions in lists]
    return lists, simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * num_chunks(schedule), UNIT,
                           posted_receives=early)


def _links(actions):
    """Each peer's messages in the order this rank posts them."""
    out = {}
    for a in actions:
        if a.op in ("SEND", "RECV"):
            out.setdefault(a.peer, []).append(a)
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_action_lists_valid(schedule):
    for p in range(2, 9):
        v = num_chunks(schedule)
        for m in range(2 * p if schedule == "dualpipev" else p, 4 * p + 1):
            lists, replay = _replay(schedule, p, m)  # raises on a deadlock
            if p <= 5:  # the receives posted ahead
                early, early_replay = _replay(schedule, p, m, early=True)
                assert early_replay["makespan"] <= replay["makespan"], (schedule, p, m)
                moved = 0
                for plain, ahead in zip(lists, early):
                    assert _links(plain) == _links(ahead) and len(plain) == len(ahead)
                    moved += sum(x != y for x, y in zip(plain, ahead))
                    ran = set()  # a receive comes before the step that uses it
                    for a in ahead:
                        if a.op == "RECV":
                            assert ("F" if a.kind == "activation" else "B", a.microbatch, a.chunk) not in ran
                        ran.add((a.op, a.microbatch, a.chunk))
                assert moved > 0
            sends, recvs = {}, {}
            for r, actions in enumerate(lists):
                seen = set()
                for a in actions:
                    if a.op in "FBW":
                        need = {"F": None, "B": "F", "W": "B"}[a.op]
                        assert need is None or (need, a.microbatch, a.chunk) in seen, (schedule, p, m, r, a)
                        assert (a.op, a.microbatch, a.chunk) not in seen
                        assert all((a.op, k, a.chunk) in seen for k in range(a.microbatch)), "out of order"
                        seen.add((a.op, a.microbatch, a.chunk))
                    elif a.op == "SEND":
                        sends.setdefault((r, a.peer), []).append((a.kind, a.microbatch))
                    else:
                        recvs.setdefault((a.peer, r), []).append((a.kind, a.microbatch))
                assert len(seen) == 3 * m * v, (schedule, p, m, r)
            assert sends == recvs, f"{schedule} p {p} m {m}: receives differ from sends (per link, in order)"


def test_bubble_unit_time():
    """Measured: mean over ranks of (window - busy) / busy, window = first start to last end, zero-latency
    messages. 1F1B and interleaved (v = 2) lists are this project's schedule tables replayed the same way."""
    for m in (8, 16):
        p = 4
        plain = [[Action(op, mb, c) for op, mb, c in schedule_table(p, 1, m, r)] for r in range(p)]
        one_f_one_b = simulate(plain, lambda r, c: r, p, {"F": 1, "B": 2})["bubble"]
        inter = [[Action(op, mb, c) for op, mb, c in schedule_table(p, 2, m, r)] for r in range(p)]
        interleaved = simulate(inter, lambda r, c: c * p + r, 2 * p, {"F": 1, "B": 2})["bubble"]
        assert one_f_one_b == pytest.approx((p - 1) / m, rel=0.1)
        assert interleaved == pytest.approx((p - 1) / (2 * m), rel=0.1)
        h1 = _replay("zb-h1", p, m)[1]["bubble"]
        assert h1 <= 0.4 * one_f_one_b and h1 == pytest.approx((p - 1) / (3 * m), rel=1e-9)
        # The V's least possible bubble: rank r's first input arrives after r half-stage forwards and every rank
        # has 6m half-stage steps, so the window is at least 6m + p - 1 (a sixth of 1F1B's); both V schedules
        # reach it.
        for schedule in ("zbv", "dualpipev"):
            replay = _replay(schedule, p, m)[1]
            assert replay["makespan"] == 6 * m + p - 1, schedule
            assert replay["bubble"] == pytest.approx((p - 1) / (6 * m), rel=1e-9)


def test_peak_in_flight():
    """ZB-H1: between F and B at most p - r (1F1B's), between F and W min(m, 2p - 1 - r). ZBV (chunk-
    microbatches, half a stage each): at most 2p between F and W, reached on rank 0. DualPipeV: 2p + 1."""
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            for r, actions in enumerate(_lists("zb-h1", p, m)):
                assert peak_in_flight([a for a in actions if a.op != "W"]) == min(m, p - r)
                assert peak_in_flight(actions) == min(m, 2 * p - 1 - r)
            lists = _lists("zbv", p, m)
            for actions in lists:  # W right after B in the steady state: the same peak until W as until B
                assert peak_in_flight([a for a in actions if a.op != "W"]) <= 2 * p
                assert peak_in_flight(actions) <= 2 * p
            if m >= 2 * p:
                assert peak_in_flight(lists[0]) == 2 * p
                # DualPipeV: 2(p-r-1) + 2(r+1) = 2p forwards before the first backward, one more before a W
                assert all(peak_in_flight(a) == 2 * p + 1 for a in _lists("dualpipev", p, m))


def test_dualpipev_needs_2p_microbatches():
    with pytest.raises(ValueError, match="at least 2p = 8 microbatches, got 7"):
        dualpipev_order(4, 7)


def _mlp():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, bias=True)
    row = RowParallelLinear(16, 8, bias=True)
    norm = torch.nn.LayerNorm(8)
    for p in (*col.parameters(), *row.parameters()):
        torch.nn.init.normal_(p)
    return torch.nn.ModuleList([col, row, norm])


def _run(mods, x, split):
    col, row, norm = mods
    store = WeightGradStore()
    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, fired=fired: fired.append(p))
             for p in mods.parameters()]
    with attached([mods], store):
        y = norm(row(torch.relu(col(x)[0]))[0])
        dy = torch.linspace(-1, 1, y.numel()).view_as(y)
        if split:
            dx, work = backward_input(y, dy, x, list(mods.parameters()), store)
            assert all(p.grad is None for p in mods.parameters()) and not fired  # nothing accumulated in B
            backward_weight(work)
        else:
            y.backward(dy)
            dx = x.grad
    for h in hooks:
        h.remove()
    assert len(fired) == len(list(mods.parameters()))  # every hook fired once
    return dx, [p.grad.clone() for p in mods.parameters()]


def test_split_backward_bitwise():
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1))
    a, b = _mlp(), _mlp()
    dx1, g1 = _run(a, x.clone().requires_grad_(True), split=False)
    dx2, g2 = _run(b, x.clone().requires_grad_(True), split=True)
    assert torch.equal(dx1, dx2)
    assert all(torch.equal(u, w) for u, w in zip(g1, g2))
    c = _mlp()  # without a store: plain F.linear's autograd
    xc = x.clone().requires_grad_(True)
    col, row, norm = c
    norm(row(torch.relu(col(xc)[0]))[0]).backward(torch.linspace(-1, 1, 64).view(4, 2, 8))
    for u, p in zip(g1, c.parameters()):
        torch.testing.assert_close(u, p.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_split_backward_under_fp8_defers_the_weight_gemms_bitwise(recipe):
    """The FP8 linears' wgrad GEMMs (and bias gradients) are queued in ``B``, not computed there, and ``W``'s
    gradients equal the unsplit FP8 backward's bitwise (the same fp8 tensors, the same operations)."""
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1))
    dy = torch.linspace(-1, 1, 64).view(4, 2, 8)
    runs = []
    for split in (False, True):
        mods = _mlp()
        col, row, norm = mods
        for name, lin in (("col", col), ("row", row)):
            lin.fp8 = Fp8LinearState(Fp8Recipe(fp8_format="hybrid", fp8_recipe=recipe), name)
        xi = x.clone().requires_grad_(True)
        store = WeightGradStore()
        with attached([mods], store):
            y = norm(row(torch.relu(col(xi)[0]))[0])
            if split:
                dx, work = backward_input(y, dy, xi, list(mods.parameters()), store)
                # the row-parallel bias is added after the TP reduction, outside the FP8 linear: computed in B
                queued = {id(col.weight), id(col.bias), id(row.weight)}
                assert len(work.queued) == 2 and {id(p) for ps, _ in work.queued for p in ps} == queued
                assert {id(p) for p, _ in work.computed} == {id(p) for p in (*norm.parameters(), row.bias)}
                assert all(p.grad is None for p in mods.parameters())
                backward_weight(work)
            else:
                y.backward(dy)
                dx = xi.grad
        runs.append((dx, [p.grad.clone() for p in mods.parameters()]))
    (dx1, g1), (dx2, g2) = runs
    assert torch.equal(dx1, dx2) and all(torch.equal(u, w) for u, w in zip(g1, g2))
    _, plain = _run(_mlp(), x.clone().requires_grad_(True), split=False)  # without FP8: other values
    assert not torch.equal(plain[0], g1[0])


def test_ascii_timeline():
    """One slot per quarter of the window: a step shows where it covers half a slot or more; chunk 1 lower case;
    comm spans (a wait) are not compute."""
    def ev(rank, name, start, end, chunk=0, cat="compute"):
        return {"rank": rank, "name": name, "cat": cat, "start": start, "end": end, "microbatch": 0, "chunk": chunk}

    events = [ev(0, "F", 0.0, 1.0), ev(0, "W", 1.0, 2.0, chunk=1), ev(1, "wait_activation", 0.0, 1.0, cat="comm"),
              ev(1, "B", 1.2, 2.0)]
    assert ascii_timeline(events, columns=4).splitlines() == ["rank 0 |FFww|", "rank 1 |..BB|"]
