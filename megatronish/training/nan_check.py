"""``--check-for-nan-in-loss-and-grad`` (Megatron's default: on): a NaN or Inf loss or gradient stops training
before the optimizer step, so neither the parameters nor a checkpoint ever hold the poisoned state. The message
names the iteration, the rank(s) that saw it, and the first parameter (global name) whose gradient is not finite.

Under fp16 with a loss scaler an overflowing gradient is the scaler's business (it skips the step and lowers the
scale, as before); only the loss is checked there.

Test hook: ``MEGATRONISH_TEST_INJECT_NAN=<loss|grad|spike>:<iteration>[:<rank>[:<kind>]]`` puts a NaN into this
rank's (or every rank's) local loss or first gradient at that iteration (1-based), or multiplies its local loss by
1000 (``spike``, for ``--check-for-spiky-loss``), to exercise the whole path. ``kind`` says what a rerun of the
iteration (``--rerun-mode validate_results``, :mod:`megatronish.training.rerun`) sees, with Megatron's
``--error-injection-type`` names: ``correct_result`` (the default) follows the micro-batches, as a value the data
produces would: every run of them, on whichever rank computes them; ``transient_error`` only the iteration's first
run; ``persistent_error`` every run on that rank, whatever micro-batches it computes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import device
from ..errors import NonFiniteError
from ..parallel import comm_log as comm

__all__ = ["check_loss_and_grads", "local_findings", "first_bad_param", "describe", "grad_tensors",
           "Injection", "injection_from_env", "inject_for_test", "INJECT_ENV", "INJECTION_KINDS"]

INJECT_ENV = "MEGATRONISH_TEST_INJECT_NAN"
INJECTION_KINDS = ("correct_result", "transient_error", "persistent_error")  # Megatron's --error-injection-type
SPIKE = 1000.0  # the factor of an injected loss spike


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass(frozen=True)
class Injection:
    """A fault put into one iteration: ``what`` (``loss``, ``grad``, ``spike``) on ``rank`` (None: every rank), of
    ``kind`` (one of :data:`INJECTION_KINDS`, see the module docstring)."""

    what: str
    rank: int | None = None
    kind: str = "correct_result"

    def hits(self, run_kind: str | None, owner: int | None) -> bool:
        """Whether this rank's run of the iteration gets it. ``run_kind``: ``first``, ``rerun`` or ``shifted`` (None:
        the iteration's only run); ``owner``: the rank whose micro-batches this rank computes (None: its own)."""
        me = _me()
        if self.kind == "transient_error":
            return run_kind in (None, "first") and self.rank in (None, me)
        if self.kind == "persistent_error":
            return self.rank in (None, me)
        return self.rank in (None, me if owner is None else owner)


def injection_from_env(iteration: int) -> Injection | None:
    """The test hook's fault at ``iteration`` (None: none asked for there)."""
    spec = os.environ.get(INJECT_ENV)
    if not spec:
        return None
    parts = spec.split(":") + ["", ""]
    if int(parts[1]) != iteration:
        return None
    return Injection(parts[0], int(parts[2]) if parts[2] else None, parts[3] or "correct_result")


def _injection(iteration: int) -> str | None:
    found = injection_from_env(iteration)
    return found.what if found is not None and found.hits(None, None) else None


def inject_for_test(chunks, stats: list[dict], iteration: int, run_kind: str | None = None,
                    owner: int | None = None, also: Injection | None = None) -> None:
    """Put the test hook's fault (see the module docstring) and ``also`` (``--error-injection-rate``'s) into this
    rank's loss or gradient where they hit this run of the iteration; nothing unless asked for."""
    for fault in (injection_from_env(iteration), also):
        if fault is None or not fault.hits(run_kind, owner):
            continue
        if fault.what == "loss" and stats:
            stats[0]["lm loss"] = stats[0]["lm loss"] * float("nan")
        elif fault.what == "spike" and stats:  # the token-loss sum, not the token count
            stats[0]["lm loss"] = stats[0]["lm loss"].clone()
            stats[0]["lm loss"][0] *= SPIKE
        elif fault.what == "grad":
            grad = next((g for c in chunks for g in map(_local_grad, reversed(c.params))
                         if g is not None and g.numel()), None)
            if grad is not None:  # the chunk's first parameter (FSDP2: the first whose shard has elements)
                grad.view(-1)[0] = float("nan")


def _local_grad(p) -> torch.Tensor | None:
    """The gradient this rank holds for ``p``: DDP's ``main_grad``, or (FSDP2, before the finalization points
    ``main_grad`` at it) the local shard of ``p.grad``."""
    g = getattr(p, "main_grad", None)
    if g is None and p.grad is not None:
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    return g


def grad_tensors(chunk) -> list[torch.Tensor]:
    """The chunk's gradients: DDP's one buffer, or (FSDP2) each parameter's local shard once reduced."""
    buf = getattr(chunk, "grad_buffer", None)
    if buf is not None:
        return [buf] if buf.numel() else []
    return [g for g in (getattr(p, "main_grad", None) for p in chunk.params) if g is not None]


def first_bad_param(models, chunks) -> str | None:
    """The global name of the first parameter whose gradient is not finite (None: none)."""
    bad = {id(p) for c in chunks for p in c.params
           if getattr(p, "main_grad", None) is not None and not torch.isfinite(p.main_grad).all()}
    if not bad:
        return None
    for m in models:
        for name, p in m.named_global_parameters():
            if id(p) in bad:
                return name
    return "?"


def local_findings(chunks, stats: list[dict], check_grads: bool) -> tuple[bool, bool]:
    """(this rank's local loss is not finite, one of its gradients is not finite (unless ``check_grads`` is
    False))."""
    loss_bad = any(not torch.isfinite(s["lm loss"]).all() for s in stats if "lm loss" in s)
    grad_bad = check_grads and any(not torch.isfinite(g).all() for c in chunks for g in grad_tensors(c))
    return loss_bad, grad_bad


def describe(seen: list[tuple]) -> str:
    """The line's what: ``seen`` holds each rank's (loss not finite, first parameter with a non-finite gradient or
    None), in rank order."""
    loss_ranks = [r for r, (lb, _) in enumerate(seen) if lb]
    grad_ranks = [(r, name) for r, (_, name) in enumerate(seen) if name is not None]
    parts = []
    if loss_ranks:
        parts.append(f"non-finite loss on rank{'s' if len(loss_ranks) > 1 else ''} {ranks_text(loss_ranks)}")
    if grad_ranks:
        parts.append(f"non-finite gradient on rank{'s' if len(grad_ranks) > 1 else ''} "
                     f"{ranks_text([r for r, _ in grad_ranks])}, first in {grad_ranks[0][1]} (rank {grad_ranks[0][0]})")
    return "; ".join(parts)


def local_report(models, chunks, stats: list[dict], check_grads: bool) -> tuple[torch.Tensor, tuple]:
    """This rank's findings: ``(flags, mine)``, flags ``[loss not finite, a gradient not finite]`` (int32, on the
    collective's device: MAX-reduce them over the world) and ``mine`` what :func:`raise_found` gathers."""
    loss_bad, grad_bad = local_findings(chunks, stats, check_grads)
    flags = torch.tensor([int(loss_bad), int(grad_bad)], dtype=torch.int32)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        flags = flags.to(device.current_device())
    mine = (int(loss_bad), first_bad_param(models, chunks) if grad_bad else None)
    return flags, mine


def raise_found(flags: torch.Tensor, mine: tuple, iteration: int, note: str) -> None:
    """With ``flags`` reduced over the world: nothing when all is finite, else gather every rank's ``mine``
    (collective) and raise :class:`~megatronish.errors.NonFiniteError` on every rank."""
    if not flags.any():
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    seen = [None] * world
    if world > 1:
        comm.all_gather_object(seen, mine)
    else:
        seen = [mine]
    raise NonFiniteError(f"iteration {iteration}: {describe(seen)}; {note}")


STOPPED_BEFORE_STEP = ("stopped before the optimizer step, nothing saved from this state "
                       "(--check-for-nan-in-loss-and-grad, Megatron's default)")


def check_loss_and_grads(models, chunks, stats: list[dict], *, iteration: int, check_grads: bool) -> None:
    """Raise :class:`~megatronish.errors.NonFiniteError` on every rank if any rank's local loss (last pipeline
    stage) or gradient (unless ``check_grads`` is False) is not finite. Collective (one small all-reduce; the names
    are gathered only when something is wrong)."""
    flags, mine = local_report(models, chunks, stats, check_grads)
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(flags, op=dist.ReduceOp.MAX)
    raise_found(flags, mine, iteration, STOPPED_BEFORE_STEP)


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
