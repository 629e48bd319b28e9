"""``--check-for-nan-in-loss-and-grad``: a NaN injected at iteration k (the test hook) stops training before the
optimizer step at k, naming the iteration, the rank(s) and the first parameter with a non-finite gradient; the
last checkpoint stays the latest; with the check off the iteration is skipped and training goes on; under fp16
the loss scaler's skip is unchanged. End to end: exit code 3 and one ``error:`` line."""
import os
import subprocess
import sys

import pytest

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import layout
from megatronish.errors import EXIT_NON_FINITE, NonFiniteError
from megatronish.parallel import groups
from megatronish.testing import run_distributed, subprocess_env
from megatronish.training import nan_check
from megatronish.training.pretrain import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0",
        "--log-interval", "1000", "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "6"]


def _attempt(argv, world, inject):
    groups.destroy_model_parallel()
    os.environ[nan_check.INJECT_ENV] = inject
    cfg = configs_from_args(parse_args(BASE + argv), world)
    try:
        result = pretrain(cfg)
        return {"error": None, "iterations": result.state.iteration, "history": result.state.history,
                "steps": result.context.optimizer.num_steps}
    except NonFiniteError as e:
        return {"error": str(e)}
    finally:
        os.environ.pop(nan_check.INJECT_ENV, None)


def _worker(rank, world, root):
    out = {}
    save = os.path.join(root, "grad")
    out["grad"] = _attempt(["--save", save, "--save-interval", "2"], world, "grad:3:1")
    out["grad_tracker"] = layout.read_tracker(save)
    out["loss"] = _attempt([], world, "loss:2:0")
    out["off"] = _attempt(["--no-check-for-nan-in-loss-and-grad"], world, "grad:3:1")
    out["fp16"] = _attempt(["--fp16", "--initial-loss-scale", "1024"], world, "grad:3")
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE), world)
    from megatronish.model.build import build_model_chunks
    from megatronish.parallel.context import ParallelContext

    model = build_model_chunks(cfg.model, ParallelContext.fake(cfg.parallel, rank))[0]
    out["first_param"] = next(iter(model.named_global_parameters()))[0]
    return out


def test_nan_stops_before_the_step_and_names_it(tmp_path):
    res = run_distributed(_worker, 2, str(tmp_path))  # DP 2
    for r in res:
        g = r["grad"]
        assert g["error"] is not None, g
        assert g["error"].startswith("iteration 3: non-finite gradient on rank 1, first in "
                                     f"{r['first_param']} (rank 1)"), g["error"]
        assert "non-finite loss" not in g["error"]
        assert r["grad_tracker"] == 2  # the checkpoint of iteration 2 stays the latest; nothing saved at 3
        loss = r["loss"]["error"]
        assert loss is not None and loss.startswith("iteration 2: non-finite loss on rank 0;"), loss
        off = r["off"]
        assert off["error"] is None and off["iterations"] == 6 and off["steps"] == 5  # iteration 3 skipped
        fp16 = r["fp16"]
        assert fp16["error"] is None and fp16["iterations"] == 6 and fp16["steps"] == 5  # the scaler's skip


def test_nan_end_to_end_exit_code_and_one_line(tmp_path):
    save = str(tmp_path / "ck")
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu", **{nan_check.INJECT_ENV: "loss:4"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--save", save,
                           "--save-interval", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == EXIT_NON_FINITE, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(errors) == 1 and "iteration 4: non-finite loss on rank 0" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert layout.read_tracker(save) == 3 and not os.path.exists(layout.checkpoint_dir(save, 4))


@pytest.mark.parametrize("spec", ["grad:2", "loss:2:0"])
def test_injection_is_only_at_its_iteration(spec, monkeypatch):
    monkeypatch.setenv(nan_check.INJECT_ENV, spec)
    assert nan_check._injection(1) is None and nan_check._injection(2) == spec.split(":")[0]
