"""``--enable-optimizer-post-validation`` (optim/post_validation.py) through ``pretrain`` at PP 2 under ZBV: the step
is taken before the stages agree on its norm and validated one iteration later; the run equals the synchronous one
exactly (every loss, every parameter and optimizer state after 6 iterations):

- with ``--clip-grad`` between the iterations' norms, so that some steps stand and others are rolled back, taken
  again clipped, and the iteration computed since runs again (both counted);
- the same under PP 2 x DP 2 with the distributed optimizer;
- with a NaN gradient injected on rank 1 at iteration 3: with the NaN check, every rank raises the check's error
  naming iteration 3 and rank 1; without it, the step is skipped as the synchronous step skips it.

The flags it cannot run with are refused in one line each."""
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.errors import ConfigError, NonFiniteError
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import nan_check
from megatronish.training import pretrain as training

ITERS = 6
PV = ["--enable-optimizer-post-validation"]
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3",
        "--weight-decay", "0.1", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
        "--log-interval", "100", "--seed", "11", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
        "--rerun-mode", "disabled"]


def _norms(world, argv=()):
    """The gradient norms of an unclipped synchronous run."""
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(BASE + list(argv) + ["--clip-grad", "0"]), world))
    return [float(training.train_step(run, state).grad_norm) for _ in range(ITERS)]


def _pretrain(argv, world, inject=""):
    groups.destroy_model_parallel()
    os.environ[nan_check.INJECT_ENV] = inject
    try:
        result = training.pretrain(configs_from_args(parse_args(BASE + argv), world))
    except NonFiniteError as e:
        return {"error": str(e)}
    finally:
        os.environ.pop(nan_check.INJECT_ENV, None)
    run = result.context
    opt = run.optimizer
    pv = run.post_validation
    return {"error": None, "history": result.state.history, "steps": opt.num_steps, "lr": run.scheduler.lr,
            "params": {n: p.detach().clone() for m in run.models for n, p in m.named_global_parameters()},
            "states": [{k: v.clone() for k, v in opt.optimizer.state[s.main].items()} for s in opt.slots],
            "counts": None if pv is None else (pv.stood, pv.redone)}


def _worker(rank, world):
    norms = _norms(world)
    clip = ["--clip-grad", f"{sorted(norms)[len(norms) // 2]:.6f}"]  # some steps clip, others do not
    out = {"sync": _pretrain(clip, world), "post": _pretrain(clip + PV, world)}
    nan = "grad:3:1"
    out["nan-sync"] = _pretrain(clip, world, nan)
    out["nan-post"] = _pretrain(clip + PV, world, nan)
    off = ["--no-check-for-nan-in-loss-and-grad"]
    out["skip-sync"] = _pretrain(clip + off, world, nan)
    out["skip-post"] = _pretrain(clip + off + PV, world, nan)
    groups.destroy_model_parallel()
    out["differ"] = _differences(out["post"], out["sync"], "clipping") + _differences(
        out["skip-post"], out["skip-sync"], "skip")
    for case in out.values():  # what the test reads (tensors stay here)
        if isinstance(case, dict):
            case.pop("params", None), case.pop("states", None)
    return out


def _sharded_worker(rank, world):
    """PP 2 x DP 2 with the distributed optimizer (each rank steps its shard, the step's all-gather follows)."""
    flags = ["--use-distributed-optimizer"]
    norms = _norms(world, flags)
    flags += ["--clip-grad", f"{sorted(norms)[len(norms) // 2]:.6f}"]
    sync, post = _pretrain(flags, world), _pretrain(flags + PV, world)
    groups.destroy_model_parallel()
    return _differences(post, sync, "distributed optimizer"), post["counts"]


def _differences(a, b, what) -> list[str]:
    """Where run ``a`` is not exactly run ``b``: losses, counts, every parameter and optimizer state."""
    out = []
    if a["history"] != b["history"]:
        out.append(f"{what}: losses {a['history']} vs {b['history']}")
    if (a["steps"], a["lr"]) != (b["steps"], b["lr"]):
        out.append(f"{what}: steps and LR {(a['steps'], a['lr'])} vs {(b['steps'], b['lr'])}")
    out += [f"{what}: parameter {n}" for n, v in a["params"].items() if not torch.equal(v, b["params"][n])]
    out += [f"{what}: optimizer state {k}" for x, y in zip(a["states"], b["states"], strict=True) for k in x
            if not torch.equal(x[k], y[k])]
    return out


def test_post_validated_steps_equal_the_synchronous_ones():
    for out in run_distributed(_worker, 2, timeout=300):
        assert out["differ"] == [], out["differ"]
        stood, redone = out["post"]["counts"]
        assert stood > 0 and redone > 0, f"both paths must run: {stood} stood, {redone} taken again"
        assert out["nan-sync"]["error"].startswith("iteration 3: non-finite gradient on rank 1")
        assert out["nan-post"]["error"].startswith("iteration 3: non-finite gradient on rank 1"), out["nan-post"]
        assert "rolled back" in out["nan-post"]["error"]
        assert out["skip-sync"]["steps"] == ITERS - 1  # the NaN's iteration skipped, training went on


def test_post_validated_sharded_steps_equal_the_synchronous_ones():
    for differ, (stood, redone) in run_distributed(_sharded_worker, 4, timeout=300):
        assert differ == [], differ
        assert stood > 0 and redone > 0, f"both paths must run: {stood} stood, {redone} taken again"


@pytest.mark.parametrize("argv, expected", [
    (["--fp16"], "--enable-optimizer-post-validation with --fp16 is not supported"),
    (["--rerun-mode", "validate_results"], "add --rerun-mode disabled"),
    (["--check-for-spiky-loss"], "with --check-for-spiky-loss is not supported"),
])
def test_post_validation_refuses_what_must_see_the_step_first(argv, expected):
    with pytest.raises(ConfigError, match=expected.replace("-", r"\-")):
        configs_from_args(parse_args(BASE + PV + argv), 2)
