"""The first-GPU check (``scripts/device_check.sh``, docs/device_check.md): one script, at most 8 minutes on one
H100/H200, that writes ``device_check.json`` and prints a summary.

Steps, in order; each runs in its own process under its own time box, so a failure or a hang is recorded and the
next step still runs (the JSON is rewritten after every step, so a killed run keeps what it had):

1. ``env``         the environment report (``megatronish-env``);
2. ``gpu_tests``   ``pytest -m gpu tests/gpu``: compiled Triton kernels, attention backends, ``torch._grouped_mm``,
                   context-parallel block kernels, pinned async-save staging, each against its reference;
3. ``te_fp8``      a small Llama trained 50 steps in bf16 and in FP8 through Transformer Engine (delayed and current
                   scaling, MXFP8 where the GPU has it): final loss within 1% of bf16; TE's FP8 against our
                   emulated FP8 on the same weights;
4. ``mfu``         a ~1B Llama, bf16, seq 4096, the largest micro-batch that fits (a short search), 30 steps, our
                   layers and TE's: tokens/s, TFLOP/s, MFU against the datasheet peak, peak memory against the
                   memory formula;
5. ``kernels``     the fused kernels' speed against PyTorch eager (RMSNorm, RoPE, SwiGLU, cross entropy);
6. ``generation``  our KV-cached generation against transformers' ``generate``: tokens/s, same weights.

``--cpu-rehearsal`` runs every step that can run on CPU at tiny sizes (statuses ``ran``: executed, nothing judged)
and records the CUDA-only parts as ``skipped`` with the reason. A step's status is ``passed`` / ``failed`` (its
criterion judged on a GPU), ``ran`` (executed, no criterion applies), or ``skipped`` (with ``reason``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from ..errors import CommandLineParser
from .device_steps import REPO, STEP_FUNCTIONS, _result

STEPS = ("env", "gpu_tests", "te_fp8", "mfu", "kernels", "generation")
# Seconds per step on a GPU (together 8 minutes) and in the CPU rehearsal.
BUDGET_GPU = {"env": 30, "gpu_tests": 120, "te_fp8": 90, "mfu": 150, "kernels": 45, "generation": 45}
# The rehearsal runs on shared CI cores: a generous box per step (a loaded 2-core runner took 15 - 30 s per step)
BUDGET_CPU = {"env": 120, "gpu_tests": 120, "te_fp8": 120, "mfu": 120, "kernels": 120, "generation": 120}


# ============================================================================ the driver (parent process)
def _run_child(name: str, rehearsal: bool, budget: float) -> dict:
    env = dict(os.environ)
    env["MEGATRONISH_DEVICE"] = "cpu" if rehearsal else "cuda"
    if rehearsal and name == "kernels":
        env["TRITON_INTERPRET"] = "1"  # the same kernels through Triton's interpreter
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "megatronish.tools.device_check", "--step", name, "--result", out]
        if rehearsal:
            cmd.append("--cpu-rehearsal")
        # Its own session: the time box ends the step's whole process tree (gpu_tests' pytest, compile workers),
        # so nothing of a killed step keeps running on the GPU into the next one.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the session's id is the child's pid
            with contextlib.suppress(subprocess.TimeoutExpired):  # a descendant that left it may hold the pipes
                proc.communicate(timeout=10)
            r = _result("failed", f"timed out after {budget:.0f} s")
        else:
            with contextlib.suppress(ProcessLookupError):  # whatever the step left running in the background
                os.killpg(proc.pid, signal.SIGKILL)
            if os.path.exists(out):
                with open(out) as fh:
                    r = json.load(fh)
            else:
                lines = (stderr or stdout).strip().splitlines()
                r = _result("failed", f"exited {proc.returncode}: {lines[-1] if lines else 'no output'}",
                            stderr_tail=lines[-20:])
    r["seconds"] = round(time.perf_counter() - t0, 2)
    r["budget_seconds"] = budget
    return r


def default_output() -> str:
    return os.path.join(os.environ.get("OUT") or os.getcwd(), "device_check.json")


def run_all(steps, rehearsal: bool, output: str, print_fn=print) -> dict:
    budgets = BUDGET_CPU if rehearsal else BUDGET_GPU
    report = {"mode": "cpu-rehearsal" if rehearsal else "gpu", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "steps": {}}
    t0 = time.perf_counter()
    for name in steps:
        r = _run_child(name, rehearsal, budgets[name])
        report["steps"][name] = r
        report["seconds"] = round(time.perf_counter() - t0, 2)
        with open(output, "w") as fh:  # after every step: a killed run keeps what it had
            json.dump(report, fh, indent=1, default=str)
        print_fn(f"{name:11s} {r['status']:8s} {r['seconds']:6.1f} s  {summary_line(name, r)}")
    statuses = [r["status"] for r in report["steps"].values()]
    report["ok"] = "failed" not in statuses
    with open(output, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print_fn(f"device check ({report['mode']}): {len(statuses)} steps in {report['seconds']:.0f} s, "
             f"{statuses.count('failed')} failed; {output}")
    return report


def summary_line(name: str, r: dict) -> str:
    d = r.get("details", {})
    if r["status"] in ("skipped", "failed") and r.get("reason"):
        return r["reason"][:160]
    if name == "env":
        rep = d.get("report", {})
        g = rep.get("gpus") or []
        return (f"{g[0]['name']} " if g else "no GPU ") + f"torch {rep.get('versions', {}).get('torch')}"
    if name == "gpu_tests":
        return ", ".join(f"{v} {k}" for k, v in d.get("counts", {}).items())
    if name == "te_fp8":
        return ", ".join(f"{k} {v['status']}" for k, v in d.get("checks", {}).items())
    if name == "mfu":
        parts = []
        for k, p in d.get("paths", {}).items():
            if p.get("tflops"):
                mfu = f", MFU {p['mfu']:.1%}" if p.get("mfu") else ""
                parts.append(f"{k}: b={p['micro_batch']} {p['tokens_per_sec']:.0f} tok/s "
                             f"{p['tflops']:.2f} TFLOP/s{mfu}")
            else:
                parts.append(f"{k}: {p.get('status')} {p.get('reason', '')[:60]}")
        return "; ".join(parts)
    if name == "kernels":
        return ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in d.get("ops", {}).items())
    if name == "generation":
        return (f"ours {d.get('ours_tokens_per_sec', 0):.0f} tok/s, hf {d.get('hf_tokens_per_sec', 0):.0f} tok/s, "
                f"ratio {d.get('ratio', 0):.2f}, identical {d.get('greedy_tokens_identical')}")
    return r.get("reason", "")


def main(argv=None) -> int:
    p = CommandLineParser(prog="megatronish-device-check", description=__doc__.split("\n")[0])
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny sizes on CPU; CUDA-only parts skipped")
    p.add_argument("--output", default=None, help="the JSON report (default: $OUT/device_check.json, else "
                                                  "./device_check.json)")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS, help="run only these steps")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # child mode: one step
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.step:
        try:
            r = STEP_FUNCTIONS[a.step](a.cpu_rehearsal)
        except Exception as e:  # recorded as the step's failure; the parent goes on
            import traceback

            r = _result("failed", f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        with open(a.result, "w") as fh:
            json.dump(r, fh, default=str)
        return 0
    report = run_all(a.steps, a.cpu_rehearsal, a.output or default_output())
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
