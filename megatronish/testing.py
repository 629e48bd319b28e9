"""Multi-process test harness: run a function on N gloo ranks started with ``fork``.

``from megatronish.testing import run_distributed`` (the tests and benchmarks use it).

``run_distributed(fn, world_size, *args)`` returns each rank's return value (rank order). A rank that
raises fails the test with that rank's traceback; a hang fails it after ``timeout`` seconds instead of
hanging CI. ``fork`` starts 8 ranks in ~0.1 s (``spawn`` re-imports torch in each: ~11 s), so a test group
should run many checks inside one call.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import socket
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from .parallel import comm_log as comm


def subprocess_env(**extra: str) -> dict:
    """The environment for a child Python process (a tool script, ``torchrun``) that must import this same
    ``megatronish``, e.g. a checkout's rather than another installed copy: ``PYTHONPATH`` leads with the directory
    that holds the package. ``extra`` entries are added."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=here + (os.pathsep + path if path else ""), **extra)


def repo_test_module(relpath: str):
    """A module of the repository's ``tests/`` tree (``relpath`` under it, e.g. ``distributed/test_torch_compile.py``)
    loaded from its file, so that a benchmark measures with the test's own model and runs rather than a copy."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", relpath)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(relpath))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, conn, fn, args, kwargs):
    status, payload = "ok", None
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MEGATRONISH_DEVICE="cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        payload = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # everything goes back to the parent
        status, payload = "error", traceback.format_exc()
    try:
        conn.send((status, payload))
    except Exception:  # an unpicklable result
        conn.send(("error", f"rank {rank}: could not send result:\n{traceback.format_exc()}"))
    conn.close()
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # skip pytest's atexit handlers inherited through fork


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], {}
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        # not daemonic: a rank may start processes of its own (--num-workers data loader workers); every rank is
        # killed below if it outlives the call
        p = ctx.Process(target=_worker, args=(rank, world_size, port, child, fn, args, kwargs), daemon=False)
        p.start()
        child.close()
        procs.append(p)
        conns[parent] = rank
    results, errors = [None] * world_size, {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        remaining = deadline - time.monotonic()
        # After the first failure, give the others a moment to report, then stop waiting.
        if errors:
            remaining = min(remaining, 2.0)
        if remaining <= 0:
            break
        ready = wait(list(pending), timeout=remaining)
        if not ready:
            break
        for conn in ready:
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", f"rank {rank} exited without reporting (crashed?)"
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    if errors:
        first = next(iter(errors))  # the first to report is the likeliest cause (others then lose peers)
        raise AssertionError(f"rank {first} of {world_size} failed:\n{errors[first]}"
                             + (f"\n(ranks {sorted(errors)} failed)" if len(errors) > 1 else ""))
    if pending:
        raise TimeoutError(f"ranks {sorted(pending.values())} of {world_size} did not finish within "
                           f"{timeout:.0f} s (hang?)")
    return results


def assert_parity(got, want, what: str, rtol: float = 1e-5) -> None:
    """``got`` equals ``want`` to ``rtol``; elements near zero are held to ``rtol`` of ``want``'s largest magnitude
    (reduction order moves them by that much, relative to the tensor)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def global_tensors(models, parallel, *, grads: bool = False, optimizer=None,
                   rtol: float = 1e-5) -> dict[str, torch.Tensor]:
    """Every parameter of the global model (or its reduced gradient, ``main_grad``) assembled on every rank from
    the slices the ranks hold (collective over the world; for tests). Each rank places its pieces at their global
    offsets. Replicas (data-parallel, tensor-parallel copies, expert-DP) must agree to ``rtol`` (elements near zero:
    ``rtol`` of the tensor's largest magnitude), else AssertionError: a missing reduction leaves them apart; the
    lowest rank's copy is returned. With the distributed optimizer (``optimizer`` given) only the gradient shard
    this rank owns counts."""
    from .checkpoint.state import param_pieces
    from .parallel.fsdp import local_shard

    local = {}
    for m in models:
        for name, p in m.named_global_parameters():
            if grads and getattr(p, "main_grad", None) is None:
                continue
            value = (p.main_grad if grads else local_shard(p)).detach().float()
            mask = torch.ones_like(value)
            if grads and optimizer is not None and getattr(optimizer, "distributed", False):
                mask = torch.zeros_like(value)
                slot = optimizer.slot_of.get(id(p))
                if slot is not None:
                    mask.view(-1)[slot.lo:slot.hi] = 1
            local[name] = (p, value, mask.bool())
    names = [None] * dist.get_world_size()
    comm.all_gather_object(names, sorted((n, tuple(q.desc.global_shape)) for n, (q, _, _) in local.items()))
    rank, world = dist.get_rank(), dist.get_world_size()
    entries = sorted({entry for rank_names in names for entry in rank_names})
    # where this rank holds each element: its value (hi/lo: +-inf elsewhere, for the replicas' spread) and rank;
    # all of them in one MIN all-reduce (hi negated), then each element's lowest holder's copy in one sum
    spans = {}
    for name, shape in entries:
        hi, lo = torch.full(shape, -float("inf")), torch.full(shape, float("inf"))
        owner = torch.full(shape, float(world))
        if name in local:
            p, value, mask = local[name]
            for dst, src in ((hi, value.masked_fill(~mask, -float("inf"))),
                             (lo, value.masked_fill(~mask, float("inf"))),
                             (owner, torch.full_like(value, float(rank)).masked_fill(~mask, float(world)))):
                _place(dst, p, src, parallel)
        spans[name] = (hi, lo, owner)
    reduced = _all_reduce_packed([t for hi, lo, owner in spans.values() for t in (-hi, lo, owner)],
                                 dist.ReduceOp.MIN)
    for i, name in enumerate(spans):
        neg_hi, lo, owner = reduced[3 * i: 3 * i + 3]
        spans[name] = (-neg_hi, lo, owner)
    mine_of = {}
    for name, shape in entries:
        hi, lo, owner = spans[name]
        held = owner < world
        hi, lo = hi.where(held, torch.zeros(())), lo.where(held, torch.zeros(()))
        scale = float(torch.maximum(hi.abs(), lo.abs()).max()) if hi.numel() else 0.0
        spread = hi - lo
        bad = spread > rtol * torch.maximum(hi.abs(), lo.abs()) + rtol * scale
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(f"global_tensors: the replicas of {name}{' (gradient)' if grads else ''} disagree "
                                 f"at {list(at)}: {float(lo[at]):.6g} .. {float(hi[at]):.6g} (rtol {rtol}); a "
                                 "missing reduction?")
        # the lowest-ranked holder's copy of each element
        mine = torch.zeros(shape)
        if name in local:
            p, value, mask = local[name]
            src = value.masked_fill(~mask, 0.0)
            for piece in param_pieces(p, src, p.desc, parallel):
                region = _region(mine, piece)
                region.copy_(torch.where(_region(owner, piece) == rank, piece.tensor, region))
        mine_of[name] = mine
    return {name: t.clone() for name, t in zip(mine_of, _all_reduce_packed(list(mine_of.values())))}


def _all_reduce_packed(tensors: list, op=None) -> list:
    """``tensors`` all-reduced (``op``, SUM by default) in one collective: views of the packed result."""
    if not tensors:
        return []
    packed = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(packed, op=dist.ReduceOp.SUM if op is None else op)
    out, at = [], 0
    for t in tensors:
        out.append(packed[at: at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _region(t: torch.Tensor, piece) -> torch.Tensor:
    """The view of the global ``t`` that ``piece`` (a ``param_pieces`` entry) covers."""
    for dim, (at, n) in enumerate(zip(piece.offsets, piece.tensor.shape)):
        t = t.narrow(dim, at, n)
    return t


def _place(dst: torch.Tensor, p, src: torch.Tensor, parallel) -> None:
    """Copy ``src`` (this rank's slice of ``p``, shaped like it) into the global ``dst`` at its pieces' offsets."""
    from .checkpoint.state import param_pieces

    for piece in param_pieces(p, src, p.desc, parallel):
        _region(dst, piece).copy_(piece.tensor)
