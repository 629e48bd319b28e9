"""Crash-safe checkpoints, end to end through ``pretrain_gpt.py`` processes: SIGKILL half-way through a synchronous
save, SIGKILL half-way through an asynchronous save's background write, and a write that fails with ENOSPC (the
test hook) each leave the tracker naming the last complete checkpoint; the next ``--load`` ignores the
half-written directory and names it in a warning, and the resumed losses equal an uninterrupted run's. A real
file-size limit (RLIMIT_FSIZE) failing the first save is one error line, exit 2, and no tracker."""
import os
import resource
import signal
import subprocess
import sys

import pytest

from megatronish.checkpoint import layout
from megatronish.checkpoint.dcp_io import SAVE_FAULT_ENV
from megatronish.testing import subprocess_env
from support.launch import metrics_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
         "--log-interval", "1"]


def _env(**extra):
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", SAVE_FAULT_ENV):
        env.pop(k, None)
    env.update(extra)
    return env


def _start(argv, preexec=None, **env):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *argv], cwd=ROOT,
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)


def _finish(procs):
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _small_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing


CRASHES = {"kill_sync": ("kill", []), "kill_async": ("kill", ["--async-save"]), "enospc": ("enospc", [])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash")
    procs = {"reference": _start(["--metrics-file", str(d / "reference.jsonl")])}
    for name, (kind, extra) in CRASHES.items():
        procs[name] = _start(["--save", str(d / name), "--save-interval", "2", *extra],
                             **{SAVE_FAULT_ENV: f"{kind}:iter_0000004"})
    procs["rlimit"] = _start(["--save", str(d / "rlimit"), "--save-interval", "2"], preexec=_small_files)
    first = _finish(procs)
    resumed = _finish({name: _start(["--load", str(d / name), "--save", str(d / name), "--save-interval", "2",
                                     "--metrics-file", str(d / f"{name}.jsonl")])
                       for name in CRASHES})
    return d, first, resumed


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_crash_mid_save_keeps_the_last_complete_checkpoint(runs, name):
    d, first, resumed = runs
    code, stdout, stderr = first[name]
    if CRASHES[name][0] == "kill":
        assert code == -signal.SIGKILL, stderr[-2000:]
    else:
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert "saving iteration 4 failed" in errors[0] and "No space left on device" in errors[0]
        assert "latest_checkpointed_iteration.txt still names iteration 2" in errors[0]
    root = str(d / name)
    assert os.path.isdir(layout.checkpoint_dir(root, 4))  # half-written
    assert layout.read_tracker(root) in (2, 6)  # 2 after the crash; the resumed run then saved 6

    code, stdout, stderr = resumed[name]
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    warning = [line for line in stdout.splitlines() if line.startswith("WARNING: ignoring")]
    assert len(warning) == 1 and layout.checkpoint_dir(root, 4) in warning[0], stdout[-2000:]
    assert f"loaded checkpoint {layout.checkpoint_dir(root, 2)}" in stdout
    reference, after = metrics_losses(d / "reference.jsonl"), metrics_losses(d / f"{name}.jsonl")
    assert sorted(after) == [3, 4, 5, 6]
    assert all(after[i] == reference[i] for i in after), (after, reference)  # exact resume
    assert layout.read_tracker(root) == 6


def test_file_size_limit_fails_the_save_in_one_line(runs):
    d, first, _ = runs
    code, stdout, stderr = first["rlimit"]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "saving iteration 2 failed" in errors[0] and "File too large" in errors[0], errors[0]
    assert f"no complete checkpoint in {d / 'rlimit'} yet" in errors[0]
    assert layout.read_tracker(str(d / "rlimit")) is False
