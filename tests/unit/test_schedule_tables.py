"""Pipeline schedules without processes: the order of work each rank executes (produced by running the real
schedule code on recording stand-ins) matches Megatron's rules, derived here independently; every message
sent is the one its receiver expects; and the exchanges complete (no deadlock) even under rendezvous
semantics (a send completes only when its receive is posted)."""
import itertools

import pytest

from megatronish.parallel.dims import ConfigError
from megatronish.parallel.pipeline.schedules import (
    check_interleaving,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    schedule_table,
    schedule_trace,
)

CASES = [  # (p, v, M)
    (2, 1, 1), (2, 1, 4), (3, 1, 2), (3, 1, 5), (4, 1, 3), (4, 1, 8), (8, 1, 16),
    (2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 2, 12), (4, 3, 8), (8, 2, 16),
]


# ---------------------------------------------------------------------------- Megatron's rules, restated
def megatron_table(p, v, M, r, forward_only=False):
    """Expected ("F"|"B", microbatch, chunk) order, from the rules in Megatron's schedules.py.

    1F1B: warm-up min(p-r-1, M) forwards, then alternate F/B, then the remaining B.
    Interleaved: virtual microbatches follow get_schedule_table(M, v, group=p) — for each group of p
    microbatches, chunk 0 for the group, then chunk 1, ...; backward uses chunk v-1-c. Warm-up
    (p-r-1)*2 + (v-1)*p capped at M*v (everything when forward-only), then alternate, then the rest.
    """
    if v == 1:
        fwd = [(mb, 0) for mb in range(M)]
        bwd = list(fwd)
        warmup = min(p - r - 1, M)
    else:
        fwd = []
        for start in range(0, M, p):
            for chunk in range(v):
                fwd += [(mb, chunk) for mb in range(start, min(start + p, M))]
        bwd = [(mb, v - 1 - c) for mb, c in fwd]
        warmup = M * v if forward_only else min((p - r - 1) * 2 + (v - 1) * p, M * v)
    if forward_only:
        return [("F",) + f for f in fwd]
    table = [("F",) + f for f in fwd[:warmup]]
    for i in range(len(fwd) - warmup):
        table += [("F",) + fwd[warmup + i], ("B",) + bwd[i]]
    table += [("B",) + b for b in bwd[len(fwd) - warmup:]]
    return table, warmup


@pytest.mark.parametrize("p,v,M", CASES)
def test_table_matches_megatron(p, v, M):
    for r in range(p):
        expected, warmup = megatron_table(p, v, M, r)
        got = schedule_table(p, v, M, r)
        assert got == expected, f"p={p} v={v} M={M} rank {r}"
        # each (microbatch, chunk) forwarded once and backwarded once, backward after forward
        fwd = [(mb, c) for op, mb, c in got if op == "F"]
        bwd = [(mb, c) for op, mb, c in got if op == "B"]
        every = sorted(itertools.product(range(M), range(v)))
        assert sorted(fwd) == every and sorted(bwd) == every
        position = {(op, mb, c): i for i, (op, mb, c) in enumerate(got)}
        assert all(position[("F", mb, c)] < position[("B", mb, c)] for mb, c in every)
        # memory bound: forwarded-but-not-backwarded never above warm-up + 1
        in_flight = peak = 0
        for op, _, _ in got:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= warmup + 1, f"p={p} v={v} M={M} rank {r}: {peak} in flight > warm-up {warmup} + 1"


@pytest.mark.parametrize("p,v,M", [(4, 1, 8), (4, 2, 8), (2, 2, 4), (3, 1, 2)])
def test_forward_only_table(p, v, M):
    for r in range(p):
        assert schedule_table(p, v, M, r, forward_only=True) == megatron_table(p, v, M, r, forward_only=True)


def test_known_interleaved_table():
    # p=2, v=2, M=4, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards
    assert schedule_table(2, 2, 4, 0)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
                                              ("F", 2, 0), ("B", 0, 1)]


# ---------------------------------------------------------------------------- messages and deadlock freedom
def _traces(p, v, M, forward_only=False):
    return [schedule_trace(p, v, M, r, forward_only) for r in range(p)]


def _check_routing(p, v, traces):
    """The i-th activation rank r sends is the input of the forward that consumes rank r+1's i-th received
    activation, for the same microbatch and the right chunk; likewise gradients going back."""
    for r, trace in enumerate(traces):
        nxt, prv = (r + 1) % p, (r - 1) % p
        sent_act = [s["send_next"] for s in trace if s["op"] == "comm" and s["send_next"] is not None]
        sent_grad = [s["send_prev"] for s in trace if s["op"] == "comm" and s["send_prev"] is not None]
        used_act = {s["input"]: (s["microbatch"], s["chunk"]) for s in traces[nxt] if s["op"] == "F" and s["input"]}
        used_grad = {s["output_grad"]: (s["microbatch"], s["chunk"]) for s in traces[prv]
                     if s["op"] == "B" and s["output_grad"]}
        recv_act = [s["recv_prev"] for s in traces[nxt] if s["op"] == "comm" and s["recv_prev"]]
        recv_grad = [s["recv_next"] for s in traces[prv] if s["op"] == "comm" and s["recv_next"]]
        assert len(sent_act) == len(recv_act) == len(used_act), f"rank {r} -> {nxt} activations"
        assert len(sent_grad) == len(recv_grad) == len(used_grad), f"rank {r} -> {prv} gradients"
        for i, (_, _, mb, c) in enumerate(sent_act):
            target_chunk = c + 1 if nxt == 0 else c  # the ring: last rank's chunk c feeds rank 0's chunk c+1
            assert used_act[("recv_activation", nxt, i)] == (mb, target_chunk), (r, i)
        for i, (_, _, mb, c) in enumerate(sent_grad):
            target_chunk = c - 1 if r == 0 else c
            assert used_grad[("recv_gradient", prv, i)] == (mb, target_chunk), (r, i)


def _batches(p, traces):
    """Per rank, the list of batched exchanges, each a list of ops (kind, channel, index)."""
    counters = {}
    out = []
    for r, trace in enumerate(traces):
        nxt, prv = (r + 1) % p, (r - 1) % p
        batches = []
        for s in trace:
            if s["op"] != "comm":
                continue
            ops = []
            # the transport's fixed order: send activation, send gradient, recv activation, recv gradient
            for kind, present, channel in (("send", s["send_next"], ("act", r, nxt)),
                                           ("send", s["send_prev"], ("grad", r, prv)),
                                           ("recv", s["recv_prev"], ("act", prv, r)),
                                           ("recv", s["recv_next"], ("grad", nxt, r))):
                if present is not None:
                    key = (kind, channel)
                    counters[key] = counters.get(key, 0) + 1
                    ops.append((kind, channel, counters[key] - 1))
            batches.append(ops)
        out.append(batches)
    return out


def _check_no_deadlock(p, batches):
    """Every rank posts its current batch and waits for all of it; an op completes once its counterpart has
    been posted. Fails if at some point no rank can complete its batch."""
    pos = [0] * p
    matched = set()
    while any(pos[r] < len(batches[r]) for r in range(p)):
        posted = {op for r in range(p) if pos[r] < len(batches[r]) for op in batches[r][pos[r]]}
        for kind, channel, i in posted:
            other = ("recv" if kind == "send" else "send", channel, i)
            if other in posted:
                matched.add((kind, channel, i))
        progressed = False
        for r in range(p):
            if pos[r] < len(batches[r]) and all(op in matched for op in batches[r][pos[r]]):
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock: ranks stuck at batches {pos} of {[len(b) for b in batches]}"


def _check_tagless_order(p, batches):
    """Where tags are ignored (NCCL), messages between two ranks match in posting order: the kinds sent
    from a to b must come in the order b receives them (matters when p == 2: next == prev)."""
    for a in range(p):
        for b in range(p):
            sent = [ch[0] for r in [a] for batch in batches[r] for kind, ch, _ in batch
                    if kind == "send" and ch[1:] == (a, b)]
            received = [ch[0] for r in [b] for batch in batches[r] for kind, ch, _ in batch
                        if kind == "recv" and ch[1:] == (a, b)]
            assert sent == received, f"{a} -> {b}: sent {sent}, received {received}"


@pytest.mark.parametrize("p,v,M", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_messages_route_and_complete(p, v, M, forward_only):
    traces = _traces(p, v, M, forward_only)
    _check_routing(p, v, traces)
    batches = _batches(p, traces)
    _check_no_deadlock(p, batches)
    _check_tagless_order(p, batches)


# ---------------------------------------------------------------------------- configuration errors
def test_interleaving_needs_microbatches_multiple_of_p():
    from megatronish import parallel_config
    from megatronish.parallel.dims import DegreeError

    with pytest.raises(ConfigError, match=r"multiple of --pipeline-model-parallel-size 4, but it is 6.*"
                                          r"--global-batch-size 12 / \(--micro-batch-size 2"):
        parallel_config.check_interleaving(4, 2, 6, micro_batch_size=2, global_batch_size=12, data_parallel_size=1)
    with pytest.raises(DegreeError, match=r"microbatches per iteration \(6\) to be a multiple of pp 4") as e:
        schedule_table(4, 2, 6, 0)  # parallel/ states the numbers
    assert "--" not in str(e.value)
    with pytest.raises(DegreeError):
        check_interleaving(4, 2, 6)


def test_layer_split_error_names_flags():
    from megatronish.config import gpt2
    from megatronish.model.build import build_model_chunks, check_layer_split
    from megatronish.parallel.context import ParallelContext
    from megatronish.parallel.dims import ParallelDims

    with pytest.raises(ConfigError, match=r"--num-layers 6 .* --pipeline-model-parallel-size 2 x 2 virtual.*"
                                          r"--num-layers-per-virtual-pipeline-stage"):
        check_layer_split(6, 2, 2)
    with pytest.raises(ConfigError, match=r"--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"):
        build_model_chunks(gpt2(num_layers=6, hidden_size=32, num_attention_heads=4, vocab_size=64),
                           ParallelContext.fake(ParallelDims(world_size=4, pp=4), 0))


def test_get_forward_backward_func():
    assert get_forward_backward_func(1, 1) is forward_backward_no_pipelining
    assert get_forward_backward_func(2, 1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving


def test_build_model_chunks_layer_assignment():
    from megatronish.config import gpt2
    from megatronish.model.build import build_model_chunks
    from megatronish.parallel.context import ParallelContext
    from megatronish.parallel.dims import ParallelDims

    cfg = gpt2(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    dims = ParallelDims(world_size=2, pp=2, vp=2)
    layers = {}
    for r in range(2):  # pipeline rank r is global rank r here; its context is built without processes
        for c, chunk in enumerate(build_model_chunks(cfg, ParallelContext.fake(dims, r))):
            names = {n.split(".")[2] for n, _ in chunk.named_global_parameters() if n.startswith("decoder.layers")}
            layers[(r, c)] = sorted(int(i) for i in names)
            assert chunk.pre_process == (r == 0 and c == 0) and chunk.post_process == (r == 1 and c == 1)
    # chunk c on rank r holds layers c*L/v + r*L/(p*v) ...
    assert layers == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
