"""Zero-bubble schedules without processes: every rank's action list is valid (each F before its B before its
W, each stage's steps in microbatch order, sends match receives in order), a replay of all ranks runs to the
end (no deadlock) for p in 2..8 and m in p..4p; the bubble of a unit-time replay (F = B = W = 1, 1F1B's and the
interleaved schedule's backward B = 2) for p = 4, m = 8 and 16; each rank's peak in-flight microbatches against
the schedule's formula; and the split backward's gradients equal the unsplit backward's bitwise."""
import functools

import pytest
import torch

from megatronish.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.parallel.pipeline.schedules import schedule_table
from megatronish.parallel.pipeline.zero_bubble import (
    SCHEDULES,
    Action,
    num_chunks,
    peak_in_flight,
    schedule_actions,
    simulate,
    stage_of,
)
from megatronish.parallel.weight_grad import WeightGradStore, attached, backward_input, backward_weight

UNIT = {"F": 1, "B": 1, "W": 1}


@functools.lru_cache(maxsize=None)
def _lists(schedule, p, m):
    return schedule_actions(schedule, p, m)


def _replay(schedule, p, m):
    lists = _lists(schedule, p, m)
    return lists, simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * num_chunks(schedule), UNIT)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_action_lists_valid(schedule):
    for p in range(2, 9):
        v = num_chunks(schedule)
        for m in range(p, 4 * p + 1):
            lists, _ = _replay(schedule, p, m)  # raises on a deadlock
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
        zbv = _replay("zbv", p, m)[1]["bubble"]
        assert h1 <= 0.4 * one_f_one_b and h1 == pytest.approx((p - 1) / (3 * m), rel=1e-9)
        assert zbv == pytest.approx((p - 1) / (6 * m), rel=1e-9)  # a sixth of 1F1B's


def test_peak_in_flight():
    """ZB-H1: between F and B at most p - r (1F1B's), between F and W min(m, 2p - 1 - r). ZBV (chunk-
    microbatches, half a stage each): at most 2p between F and B, 3p - 1 between F and W, reached on rank 0."""
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            for r, actions in enumerate(_lists("zb-h1", p, m)):
                assert peak_in_flight([a for a in actions if a.op != "W"]) == min(m, p - r)
                assert peak_in_flight(actions) == min(m, 2 * p - 1 - r)
            lists = _lists("zbv", p, m)
            for actions in lists:
                assert peak_in_flight([a for a in actions if a.op != "W"]) <= 2 * p
                assert peak_in_flight(actions) <= 3 * p - 1
            if m >= 2 * p:
                assert peak_in_flight([a for a in lists[0] if a.op != "W"]) == 2 * p
                assert peak_in_flight(lists[0]) == 3 * p - 1


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
