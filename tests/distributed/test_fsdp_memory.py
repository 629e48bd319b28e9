"""FSDP2 memory: the parameters, gradients and Adam states a rank holds (measured: distinct storages after a
step) are 1/DP of DDP's at DP 4 (within 10%: FSDP2 pads each parameter's rows to a multiple of DP), and the
start-up estimate says the same. A DP size of 1 warns once and runs as DDP; the flags' bad combinations are one
error line each; a NaN in one rank's gradient shard skips the step on every rank."""
import io
from contextlib import redirect_stdout

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.errors import ConfigError
from megatronish.parallel import groups
from megatronish.parallel.ddp import DistributedDataParallel
from megatronish.parallel.fsdp import FullyShardedDataParallel
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training
from megatronish.training.memory import measured_state_bytes, theoretical_memory

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval",
        "100", "--seed", "3", "--optimizer", "adam"]


def _measure(argv, world):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    out = io.StringIO()
    with redirect_stdout(out):
        run, state = training.setup(cfg)
        training.train_step(run, state)
    n = sum(p.numel() for m in run.models for p in m.parameters())
    return {"measured": measured_state_bytes(run.chunks, run.optimizer), "wrapper": type(run.chunks[0]).__name__,
            "estimate": theoretical_memory(cfg, n)["weights_and_optimizer"], "log": out.getvalue()}


def _worker(rank, world):
    if world == 1:
        return _measure(["--use-torch-fsdp2"], 1)
    return {"ddp": _measure([], world), "fsdp": _measure(["--use-torch-fsdp2"], world)}


@pytest.fixture(scope="module")
def dp4():
    return run_distributed(_worker, 4, timeout=600)


def test_fsdp_holds_a_quarter_of_ddp_at_dp4(dp4):
    for rank, r in enumerate(dp4):
        ddp, fsdp = r["ddp"], r["fsdp"]
        assert ddp["wrapper"] == DistributedDataParallel.__name__
        assert fsdp["wrapper"] == FullyShardedDataParallel.__name__
        ratio = fsdp["measured"] / (ddp["measured"] / 4)
        assert 0.9 <= ratio <= 1.1, f"rank {rank}: FSDP2 {fsdp['measured']} B vs DDP/4 {ddp['measured'] / 4} B"
        # the estimate: 16 B/param under DDP with Adam, 16/4 under FSDP2; measured within 10% of it
        assert fsdp["estimate"] == pytest.approx(ddp["estimate"] / 4)
        assert fsdp["measured"] == pytest.approx(fsdp["estimate"], rel=0.1)
        assert ddp["measured"] == pytest.approx(ddp["estimate"], rel=0.1)
    assert "FSDP2 over 4 ranks" in dp4[0]["fsdp"]["log"]


def test_dp1_warns_and_runs_as_ddp():
    r = run_distributed(_worker, 1)[0]
    assert r["wrapper"] == DistributedDataParallel.__name__
    assert r["log"].count("WARNING: --use-torch-fsdp2 with a data-parallel size of 1") == 1


@pytest.mark.parametrize("flags, message", [
    (["--use-distributed-optimizer"], "--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive"),
    (["--num-experts", "4"], "--use-torch-fsdp2 with --num-experts"),
    (["--fsdp-prefetch-layers", "-1"], "--fsdp-prefetch-layers must be >= 0"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce is our DDP's"),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size is our DDP's"),
])
def test_bad_combinations_are_one_line(flags, message):
    with pytest.raises(ConfigError) as e:
        configs_from_args(parse_args(BASE + ["--use-torch-fsdp2"] + flags), 2)
    lines = str(e.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_fsdp_options_need_the_flag():
    with pytest.raises(ConfigError) as e:
        configs_from_args(parse_args(BASE + ["--fsdp-reshard-after-forward", "never"]), 2)
    lines = str(e.value).splitlines()
    assert lines == ["--fsdp-reshard-after-forward set FSDP2 options; add --use-torch-fsdp2 or drop them"], lines


def _nan_worker(rank, world):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + ["--use-torch-fsdp2", "--optimizer", "sgd"]), world)
    with redirect_stdout(io.StringIO()):
        run, state = training.setup(cfg)
        before = [p.to_local().clone() for m in run.models for p in m.parameters()]
        step = run.optimizer.step

        def poisoned_step():  # a NaN in one element of rank 1's shard of one weight
            if rank == 1:
                next(s for s in run.optimizer.slots if s.model.dim() == 2).model.main_grad.view(-1)[0] = float("nan")
            return step()

        run.optimizer.step = poisoned_step
        result = training.train_step(run, state)
    after = [p.to_local() for m in run.models for p in m.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    return result.update_successful, result.grad_norm, unchanged


def test_nan_gradient_shard_on_one_rank_skips_the_step_everywhere():
    """The grad norm sums the local shards over the world: a NaN in one rank's shard makes every rank's norm NaN,
    and every rank skips the update (the NaN check of the training step)."""
    for ok, norm, unchanged in run_distributed(_nan_worker, 2):
        assert not ok and norm != norm and unchanged
