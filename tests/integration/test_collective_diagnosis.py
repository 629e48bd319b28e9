"""Mismatched collectives end the job with one line naming the collective and the rank that is elsewhere.

Each job is two ranks started with ``fork`` that go through the training entry's path: ``run_rank`` (the watchdog
on), ``init_distributed`` and ``initialize_model_parallel`` with a 3 s process-group timeout, ``Watch.start``.
Two jobs run side by side:

- ``skip``: rank 1 skips a tensor-parallel all-reduce and waits in a barrier over the world;
- ``gather_vs_scatter``: rank 0 waits in a sequence-parallel all-gather while rank 1 waits in a reduce-scatter
  (the shape of a mixture-of-experts backward whose ranks disagree).

Each must end within a few seconds of the timeout with exactly one ``error:`` line, exit code 4 on both ranks, no
traceback, and every rank's collectives in ``collectives-0.json``.
"""
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from megatronish.errors import EXIT_PEER_LOST
from megatronish.parallel import comm_log, groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatronish.testing import free_port
from megatronish.training import watchdog
from megatronish.training.failure import run_rank
from megatronish.training.initialize import init_distributed

TIMEOUT_S = 3.0  # the process groups' timeout
LIMIT_S = 30.0
# Both ranks wait under the same timeout: the one that times out first ends its process, so the other may see its
# peer's connection close before its own timeout. Either is what happened; the diagnosis must not depend on which.
CAUSE = "(?:timed out|connection closed by a peer|connection reset by a peer)"


def _skip(rank, ctx):
    x = torch.ones(4, 8)
    for _ in range(2):
        reduce_from_tensor_model_parallel_region(x, ctx.tp_group)
    if rank != 1:  # rank 1 skips the third all-reduce
        reduce_from_tensor_model_parallel_region(x, ctx.tp_group)
    comm_log.barrier()


def _gather_vs_scatter(rank, ctx):
    x = torch.ones(4, 3)
    reduce_from_tensor_model_parallel_region(x, ctx.tp_group)
    if rank == 0:
        gather_from_sequence_parallel_region(x, group=ctx.tp_group)
    else:
        reduce_scatter_to_sequence_parallel_region(x, group=ctx.tp_group)


CASES = {"skip": _skip, "gather_vs_scatter": _gather_vs_scatter}


def _rank(case, rank, world, port, out_dir):
    """The forked rank: its output to ``rank<N>.log``; run the case under ``run_rank`` (which ends the process)."""
    fd = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGATRONISH_DEVICE="cpu", MEGATRONISH_WATCHDOG_INTERVAL="0.2")
    code = 1
    try:
        comm_log.reset()  # not the records of the process this one was forked from
        torch.set_num_threads(1)

        watch = watchdog.Watch()

        def work():
            init_distributed("gloo", TIMEOUT_S / 60)
            ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=world),
                                                   timeout_minutes=TIMEOUT_S / 60)
            watch.start(dist.get_rank(), dist.get_world_size())
            CASES[case](rank, ctx)

        run_rank(work, watch=watch, report_dir=out_dir)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(case, out_dir, world=2):
    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(case, rank, world, port, out_dir)
        pids.append(pid)
    return pids


def _wait(pids, deadline):
    codes = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    return [codes.get(pid) for pid in pids]


def test_mismatched_collectives_name_the_collective_and_the_rank_elsewhere(tmp_path):
    dirs = {case: tmp_path / case for case in CASES}
    for d in dirs.values():
        d.mkdir()
    t0 = time.monotonic()
    jobs = {case: _start(case, str(d)) for case, d in dirs.items()}
    codes = {case: _wait(pids, t0 + LIMIT_S) for case, pids in jobs.items()}
    took = time.monotonic() - t0
    print(f"both jobs ended {took:.1f} s after their start (process-group timeout {TIMEOUT_S:.0f} s)")

    lines = {}
    for case, d in dirs.items():
        text = "".join((d / f"rank{r}.log").read_text(errors="replace") for r in range(2))
        assert codes[case] == [EXIT_PEER_LOST] * 2, f"{case}: exit codes {codes[case]}\n{text[-3000:]}"
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, f"{case}: {len(errors)} error lines\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        lines[case] = errors[0]
        rings = json.loads((d / "collectives-0.json").read_text())
        assert rings["error"] in errors[0] and sorted(rings["ranks"]) == ["0", "1"]
        assert errors[0].endswith(f"every rank's collectives: {d / 'collectives-0.json'}")
    assert took < TIMEOUT_S + 10, f"the jobs took {took:.1f} s"

    skip = lines["skip"]
    assert re.search(r"collective all_reduce #3 on group tp \[0, 1\] \(\[4, 8\] float32\) at "
                     rf"megatronish/parallel/mappings\.py:\d+ in _all_reduce did not complete on rank 0 \({CAUSE}\): "
                     r"rank 1 never reached it; rank 1's last collectives: all_reduce #1 on tp at .*; "
                     r"all_reduce #2 on tp at .*; barrier #1 on world at "
                     r"tests/integration/test_collective_diagnosis\.py:\d+ in _skip;", skip), skip

    mixed = lines["gather_vs_scatter"]
    assert re.search(r"collective all_gather #2 on group tp \[0, 1\] \(\[4, 3\] float32\) at "
                     r"megatronish/parallel/mappings\.py:\d+ in _gather_along did not complete on rank 0 "
                     rf"\({CAUSE}\): rank 1 issued reduce_scatter_tensor at megatronish/parallel/mappings\.py:\d+ "
                     r"in _reduce_scatter_first there instead", mixed), mixed
