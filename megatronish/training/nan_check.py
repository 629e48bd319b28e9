"""``--check-for-nan-in-loss-and-grad`` (Megatron's default: on): a NaN or Inf loss or gradient stops training
before the optimizer step, so neither the parameters nor a checkpoint ever hold the poisoned state. The message
names the iteration, the rank(s) that saw it, and the first parameter (global name) whose gradient is not finite.

Under fp16 with a loss scaler an overflowing gradient is the scaler's business (it skips the step and lowers the
scale, as before); only the loss is checked there.

Test hook: ``MEGATRONISH_TEST_INJECT_NAN=<loss|grad>:<iteration>[:<rank>]`` puts a NaN into this rank's (or every
rank's) local loss or first gradient at that iteration (1-based), to exercise the whole path.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import NonFiniteError
from ..parallel import comm_log as comm

__all__ = ["check_loss_and_grads", "inject_for_test", "INJECT_ENV"]

INJECT_ENV = "MEGATRONISH_TEST_INJECT_NAN"


def _injection(iteration: int) -> str | None:
    spec = os.environ.get(INJECT_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    what, at = parts[0], int(parts[1])
    rank = int(parts[2]) if len(parts) > 2 else None
    me = dist.get_rank() if dist.is_initialized() else 0
    return what if at == iteration and (rank is None or rank == me) else None


def inject_for_test(chunks, stats: list[dict], iteration: int) -> None:
    """The test hook (see the module docstring); nothing unless the environment variable asks for it."""
    what = _injection(iteration)
    if what == "loss" and stats:
        stats[0]["lm loss"] = stats[0]["lm loss"] * float("nan")
    elif what == "grad":
        for chunk in chunks:
            if chunk.params:
                chunk.params[-1].main_grad.view(-1)[0] = float("nan")  # the chunk's first parameter
                return


def _grad_tensors(chunk) -> list[torch.Tensor]:
    """The chunk's gradients: DDP's one buffer, or (FSDP2) each parameter's local shard once reduced."""
    buf = getattr(chunk, "grad_buffer", None)
    if buf is not None:
        return [buf] if buf.numel() else []
    return [g for g in (getattr(p, "main_grad", None) for p in chunk.params) if g is not None]


def _first_bad_param(models, chunks) -> str | None:
    bad = {id(p) for c in chunks for p in c.params
           if getattr(p, "main_grad", None) is not None and not torch.isfinite(p.main_grad).all()}
    if not bad:
        return None
    for m in models:
        for name, p in m.named_global_parameters():
            if id(p) in bad:
                return name
    return "?"


def check_loss_and_grads(models, chunks, stats: list[dict], *, iteration: int, check_grads: bool) -> None:
    """Raise :class:`~megatronish.errors.NonFiniteError` on every rank if any rank's local loss (last pipeline
    stage) or gradient (unless ``check_grads`` is False) is not finite. Collective (one small all-reduce; the names
    are gathered only when something is wrong)."""
    loss_bad = any(not torch.isfinite(s["lm loss"]).all() for s in stats if "lm loss" in s)
    grads = [g for c in chunks for g in _grad_tensors(c)]
    grad_bad = check_grads and any(not torch.isfinite(g).all() for g in grads)
    flags = torch.tensor([int(loss_bad), int(grad_bad)], dtype=torch.int32)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dev = grads[0].device if grads else torch.device("cpu")
        flags = flags.to(dev if dist.get_backend() == "nccl" else "cpu")
        comm.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags.any():
        return
    mine = (int(loss_bad), _first_bad_param(models, chunks) if grad_bad else None)
    seen = [None] * world
    if world > 1:
        comm.all_gather_object(seen, mine)
    else:
        seen = [mine]
    loss_ranks = [r for r, (lb, _) in enumerate(seen) if lb]
    grad_ranks = [(r, name) for r, (_, name) in enumerate(seen) if name is not None]
    parts = []
    if loss_ranks:
        parts.append(f"non-finite loss on rank{'s' if len(loss_ranks) > 1 else ''} {_ranks(loss_ranks)}")
    if grad_ranks:
        parts.append(f"non-finite gradient on rank{'s' if len(grad_ranks) > 1 else ''} "
                     f"{_ranks([r for r, _ in grad_ranks])}, first in {grad_ranks[0][1]} (rank {grad_ranks[0][0]})")
    raise NonFiniteError(f"iteration {iteration}: {'; '.join(parts)}; stopped before the optimizer step, nothing "
                         "saved from this state (--check-for-nan-in-loss-and-grad, Megatron's default)")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
