"""The batch scripts' requeue decision after a failed training step (scripts/slurm/requeue.sh), through its dry run:
opt-in, capped by the job's requeue count, never for an exit code a new run would repeat, and reading only the
worker exit codes torchrun reported since the step's last start."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUEUE = os.path.join(ROOT, "scripts", "slurm", "requeue.sh")
SCRIPTS = [os.path.join(ROOT, "scripts", "slurm", f) for f in ("pretrain_gpt.sbatch", "pretrain_gpt_per_task.sbatch",
                                                                "requeue.sh")]
MARK = "=== training step start: job 7 restart {}\n"
REPORT = "Root Cause (first observed failure):\n[0]:\n  rank      : 3 (local_rank: 1)\n  exitcode  : {} (pid: 12)  \n"


def _decide(rc, *logs, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("REQUEUE_ON_FAILURE", "MAX_REQUEUES",
                                                             "NO_REQUEUE_EXIT_CODES", "SLURM_RESTART_COUNT")}
    p = subprocess.run(["bash", REQUEUE, str(rc), *map(str, logs)], env={**full, **env}, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode == 0, p.stdout.strip()


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", script], check=True, timeout=30)


def test_requeue_is_opt_in_and_capped():
    assert _decide(4) == (False, "no requeue: REQUEUE_ON_FAILURE is not 1")
    ok, why = _decide(4, REQUEUE_ON_FAILURE="1")
    assert ok and why.startswith("requeue: step exit code 4") and "requeue 1 of at most 3" in why, why
    assert _decide(137, REQUEUE_ON_FAILURE="1", SLURM_RESTART_COUNT="2")[0]
    ok, why = _decide(4, REQUEUE_ON_FAILURE="1", SLURM_RESTART_COUNT="3")
    assert not ok and "requeued 3 times already (MAX_REQUEUES=3)" in why, why
    assert not _decide(4, REQUEUE_ON_FAILURE="1", MAX_REQUEUES="0")[0]


@pytest.mark.parametrize("rc", [2, 3, 5])
def test_no_requeue_for_a_failure_that_comes_back(rc):
    ok, why = _decide(rc, REQUEUE_ON_FAILURE="1")
    assert not ok and f"exit code {rc} comes back" in why, why
    assert _decide(rc, REQUEUE_ON_FAILURE="1", NO_REQUEUE_EXIT_CODES="")[0]


def test_worker_exit_codes_since_the_last_start(tmp_path):
    a, b = tmp_path / "node-0.log", tmp_path / "node-1.log"
    # torchrun exits 1 whatever its workers did: their codes come from its failure report of this start only
    a.write_text(MARK.format(0) + REPORT.format(2) + MARK.format(1) + "training\n" + REPORT.format(-9))
    b.write_text(MARK.format(0) + REPORT.format(5) + MARK.format(1) + REPORT.format(4))
    ok, why = _decide(1, a, b, tmp_path / "missing.log", REQUEUE_ON_FAILURE="1", SLURM_RESTART_COUNT="1")
    assert ok and "worker exit codes: -9 4;" in why, why
    b.write_text(MARK.format(0) + REPORT.format(4) + MARK.format(1) + REPORT.format(2))
    ok, why = _decide(1, a, b, REQUEUE_ON_FAILURE="1", SLURM_RESTART_COUNT="1")
    assert not ok and "exit code 2 comes back" in why, why
