"""``--rerun-mode`` (training/rerun.py), on gloo ranks, fp32, a tiny model:

- ``validate_results`` (the default): transient faults (a NaN in one rank's gradient or loss on an iteration's first
  run only; the test hook and ``--error-injection-rate``) are caught, the iteration is rerun and training ends with
  weights equal bit for bit to an uninterrupted run's; a persistent fault (every run on that rank) names the rank;
  a fault that follows the micro-batches (the model's own result) stops with exit code 3's error after saving the
  state before the step; a transient loss spike (``--check-for-spiky-loss``) is rerun away;
- ``disabled`` stops at the first NaN with the NaN check's line, as before; ``report_stats`` runs every iteration
  twice, reports identical results and trains to the same weights;
- the flags' bad combinations are one line each; the spike rule and the comparison are Megatron's.
"""
import math
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import layout
from megatronish.errors import EXIT_FAULTY_RANK, EXIT_NON_FINITE, ConfigError, FaultyRankError, NonFiniteError
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import nan_check
from megatronish.training.pretrain import pretrain
from megatronish.training.rerun import LargeValue, relative_difference

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1000", "--attention-dropout", "0",
        "--hidden-dropout", "0"]
TP2_DP2 = BASE + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
                  "--tensor-model-parallel-size", "2"]


def _train(argv, world, inject=""):
    """``{"error": type and line or None, "history", "weights": this rank's parameters, "corrected"}``."""
    groups.destroy_model_parallel()
    os.environ[nan_check.INJECT_ENV] = inject
    try:
        result = pretrain(configs_from_args(parse_args(argv), world))
    except (NonFiniteError, FaultyRankError) as e:
        return {"error": (type(e).__name__, str(e))}
    finally:
        os.environ.pop(nan_check.INJECT_ENV, None)
    run = result.context
    return {"error": None, "history": result.state.history, "corrected": run.rerun.corrected if run.rerun else [],
            "weights": [p.detach().clone() for m in run.models for p in m.parameters()]}


def _same(a, b) -> bool:
    return a["history"] == b["history"] and all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


def _tp2_dp2(rank, world, root):
    ref = _train(TP2_DP2, world)
    out = {"disabled_same": _same(_train(TP2_DP2 + ["--rerun-mode", "disabled"], world), ref)}
    for name, argv, inject in [
            ("hook_transient", [], "grad:3:1:transient_error"),
            ("loss_transient", [], "loss:2:3:transient_error"),
            ("flag_transient", ["--error-injection-rate", "4"], ""),  # a fault on some rank in every iteration
            ("report_stats", ["--rerun-mode", "report_stats"], "")]:
        got = _train(TP2_DP2 + argv, world, inject)
        out[name] = {"error": got["error"], "same": got["error"] is None and _same(got, ref),
                     "corrected": got.get("corrected")}
    out["persistent_hook"] = _train(TP2_DP2, world, "loss:3:1:persistent_error")["error"]
    out["persistent_flag"] = _train(TP2_DP2 + ["--error-injection-rate", "4", "--error-injection-type",
                                               "persistent_error"], world)["error"]
    save = os.path.join(root, "diverged")
    out["divergence"] = _train(TP2_DP2 + ["--save", save, "--save-interval", "5"], world, "grad:4:2")["error"]
    out["divergence_tracker"] = layout.read_tracker(save)
    out["disabled_nan"] = _train(TP2_DP2 + ["--rerun-mode", "disabled"], world, "grad:3:1:transient_error")["error"]
    return out


def test_validate_results_tp2_dp2(tmp_path, capfd):
    res = run_distributed(_tp2_dp2, 4, str(tmp_path))
    text = capfd.readouterr().out
    for r in res:
        assert r["disabled_same"]  # the default path and --rerun-mode disabled train alike, bit for bit
        for name, corrected in (("hook_transient", [3]), ("loss_transient", [2]),
                                ("flag_transient", [1, 2, 3, 4, 5, 6]), ("report_stats", [])):
            assert r[name]["error"] is None and r[name]["same"], (name, r[name])
            assert r[name]["corrected"] == corrected, (name, r[name])
        kind, line = r["persistent_hook"]
        assert kind == "FaultyRankError" and line.startswith("iteration 3: non-finite loss on rank 1;"), line
        assert "a persistent fault of rank 1 (" in line and "rank 3 for rank 1" in line, line
        kind, line = r["persistent_flag"]
        assert kind == "FaultyRankError" and line.startswith("iteration 1: non-finite gradient on rank "), line
        faulty = int(line.split("rank ", 1)[1].split(",", 1)[0])
        assert f"a persistent fault of rank {faulty} (" in line, line
        kind, line = r["divergence"]
        assert kind == "NonFiniteError", line
        assert line.startswith("iteration 4: non-finite gradient on rank 2, first in"), line
        assert "the model's own result (a divergence)" in line and "rank 0 for rank 2" in line, line
        assert "the checkpoint of iteration 3 in --save" in line, line
        kind, line = r["disabled_nan"]
        assert kind == "NonFiniteError", line
        assert line.startswith("iteration 3: non-finite gradient on rank 1, first in"), line
        assert line.endswith("(--check-for-nan-in-loss-and-grad, Megatron's default)"), line
    # the state before the failed step, saved though not at an interval (rank 0 writes the tracker last)
    assert res[0]["divergence_tracker"] == 3
    warnings = [line for line in text.splitlines() if "a transient fault" in line]
    assert len(warnings) == 1 + 1 + 6 and warnings[0].startswith("WARNING: iteration 3: non-finite gradient on rank 1")
    stats = [line for line in text.splitlines() if line.startswith("rerun stats (--rerun-mode report_stats)")]
    assert stats == ["rerun stats (--rerun-mode report_stats), iterations 1-6: 6 reruns; loss identical in 6, largest "
                     "relative difference 0.000e+00; gradient norm identical in 6, largest relative difference "
                     "0.000e+00"], stats
    assert EXIT_NON_FINITE == 3 and EXIT_FAULTY_RANK == 5


SPIKY = BASE + ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "28",
                "--check-for-spiky-loss", "--check-for-large-grads"]


def _spike(rank, world):
    ref = _train(SPIKY, world)
    got = _train(SPIKY, world, "spike:27:1:transient_error")  # 4 micro-batches a rank: 100 samples by iteration 25
    late = _train(SPIKY, world, "spike:20:1:transient_error")  # before 100 samples: nothing judged yet
    return {"ref": ref["error"], "same": _same(got, ref), "corrected": got["corrected"], "late": late["corrected"]}


def test_transient_loss_spike_is_rerun_away():
    for r in run_distributed(_spike, 2):  # DP 2
        assert r["ref"] is None and r["same"] and r["corrected"] == [27] and r["late"] == [], r


def test_large_value_rule_and_comparison_are_megatrons():
    seen = LargeValue(10.0, samples=3)
    for v in (1.0, -2.0, float("nan"), 1.5):
        assert not seen.judge(v)
        seen.record(v)
    assert seen.count == 3 and seen.largest == 2.0
    assert not seen.judge(19.9) and seen.judge(20.0) and seen.judge(-25.0) and not seen.judge(math.inf)
    seen.record(1000.0)  # the largest is set by the first samples only
    assert seen.largest == 2.0
    assert relative_difference(1.0, 1.0) == 0.0 and relative_difference(math.nan, math.nan) == 0.0
    assert relative_difference(1.0, math.nan) == math.inf and relative_difference(3.0, 1.0) == 1.0


@pytest.mark.parametrize("extra, line", [
    (["--error-injection-rate", "-1"], "--error-injection-rate must be >= 0 (0: no injected faults), got -1"),
    (["--error-injection-type", "persistent_error"], "--error-injection-type persistent_error needs "
                                                     "--error-injection-rate N"),
    (["--error-injection-rate", "5", "--rerun-mode", "report_stats"], "--error-injection-rate 5 injects faults for "
                                                                        "--rerun-mode validate_results to find"),
    (["--error-injection-rate", "5", "--no-check-for-nan-in-loss-and-grad"], "--error-injection-rate 5 injects NaNs, "
                                                                             "which --check-for-nan-in-loss-and-grad"),
])
def test_bad_flag_combinations_are_one_line(extra, line):
    with pytest.raises(ConfigError) as e:
        configs_from_args(parse_args(TP2_DP2 + extra), 4)
    assert len(str(e.value).splitlines()) == 1 and str(e.value).startswith(line), str(e.value)


def test_defaults_are_megatrons():
    t = configs_from_args(parse_args(TP2_DP2), 4).train
    assert (t.rerun_mode, t.check_for_spiky_loss, t.check_for_large_grads, t.error_injection_rate,
            t.error_injection_type) == ("validate_results", False, False, 0, "transient_error")
