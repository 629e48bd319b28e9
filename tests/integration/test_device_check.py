"""``scripts/device_check.sh --cpu-rehearsal``: every step of the first-GPU check runs at tiny sizes on CPU (or is
skipped with its reason), the JSON lists each, and what ran is checked against its reference."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(180)
def test_cpu_rehearsal_runs_every_step_or_says_why(tmp_path):
    out = tmp_path / "device_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "device_check.sh"), "--cpu-rehearsal",
                           "--output", str(out)], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-rehearsal" and report["ok"] is True
    steps = report["steps"]
    assert list(steps) == ["env", "gpu_tests", "te_fp8", "mfu", "kernels", "generation"]
    for name, r in steps.items():
        assert r["status"] in ("ran", "skipped"), (name, r)
        assert r["status"] == "ran" or r["reason"], name
        assert r["seconds"] <= r["budget_seconds"]
    # the summary names every step
    for name in steps:
        assert f"\n{name}" in "\n" + proc.stdout
    # env: the report of this process's machine
    assert steps["env"]["details"]["report"]["device"] == "cpu"
    # gpu tests: collected, all skipped on CPU, each with the reason
    tests = steps["gpu_tests"]["details"]["tests"]
    assert len(tests) >= 10 and all(t["outcome"] == "skipped" and "no CUDA device" in t["reason"] for t in tests)
    # FP8: our emulated path ran against the fp32 baseline; every TE part skipped with the flag's error line
    checks = steps["te_fp8"]["details"]["checks"]
    base, emu = checks["baseline"]["losses"], checks["emulated_fp8_delayed"]["losses"]
    assert len(base) == len(emu) == 3 and base[0] == pytest.approx(emu[0], rel=0.05)
    for name in ("te_bf16", "te_fp8_delayed", "te_fp8_current", "te_mxfp8", "te_vs_emulated", "te_fp8_recompute"):
        assert checks[name]["status"] == "skipped"
        assert checks[name]["reason"].startswith("--transformer-impl transformer_engine needs Transformer Engine")
    # MFU: throughput consistent with the step time; no datasheet peak for a CPU
    local = steps["mfu"]["details"]["paths"]["local"]
    assert local["micro_batch"] == 2 and local["mfu"] is None
    assert local["tokens_per_sec"] == pytest.approx(local["micro_batch"] * 64 / local["step_seconds"])
    assert steps["mfu"]["details"]["paths"]["transformer_engine"]["status"] == "skipped"
    # kernels: interpreted on CPU (timed, not judged), or skipped without triton
    if steps["kernels"]["status"] == "ran":
        assert set(steps["kernels"]["details"]["ops"]) == {"rms_norm", "swiglu", "rope", "cross_entropy"}
    # generation: ours and transformers' produce the same greedy tokens
    assert steps["generation"]["details"]["greedy_tokens_identical"] is True
