"""Dead ranks and dead launchers, end to end, with the default --distributed-timeout-minutes:

- torchrun, TP 2 x DP 2: ``kill -9`` one worker; every process is gone within 60 s and the output names the lost
  rank;
- a per-task launch (each rank its own process, as ``srun`` in scripts/slurm starts them): ``kill -9`` one rank
  (and, separately, rank 0, which hosts the job's store); the others exit 4 within 60 s and one line names it;
- ``kill -9`` the torchrun launcher: no worker is alive after 30 s and no checkpoint is written after the kill.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatronish.errors import EXIT_PEER_LOST
from megatronish.testing import free_port
from support.launch import PRETRAIN, ROOT, alive, children, cpu_env, rank_of, torchrun_cmd, wait_for_iteration

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "100000", "--lr", "1e-3",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1"]
LIMIT_S = 60


def _torchrun(tmp_path, argv, nproc=4):
    log = open(tmp_path / "out.log", "w")
    return (subprocess.Popen(torchrun_cmd(nproc, [*FLAGS, *argv]), cwd=ROOT, env=cpu_env(), stdout=log,
                             stderr=subprocess.STDOUT), tmp_path / "out.log")


def test_torchrun_kill_one_worker_tp2_dp2(tmp_path):
    agent, log = _torchrun(tmp_path, ["--tensor-model-parallel-size", "2"])
    try:
        wait_for_iteration(log, 3)
        workers = {rank_of(p): p for p in children(agent.pid)}
        assert sorted(workers) == [0, 1, 2, 3]
        os.kill(workers[3], signal.SIGKILL)
        t0 = time.monotonic()
        agent.wait(timeout=LIMIT_S)
        while any(alive(p) for p in workers.values()) and time.monotonic() - t0 < LIMIT_S:
            time.sleep(0.2)
        took = time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
    text = log.read_text(errors="replace")
    assert agent.returncode != 0 and took < LIMIT_S, text[-3000:]
    assert not any(alive(p) for p in workers.values())
    # torchrun's report (or the watchdog's line) names the lost rank and its signal
    assert ("rank      : 3 (local_rank: 3)" in text and "Signal 9 (SIGKILL)" in text) or \
        "error: rank 3 " in text, text[-3000:]
    assert not [line for line in text.splitlines() if line.lstrip().startswith("File \"") and "megatronish" in line]


def _per_task(tmp_path, world):
    port = str(free_port())
    procs, logs = [], []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.log"
        env = cpu_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, PRETRAIN, *FLAGS,
                                       "--tensor-model-parallel-size", "2"], cwd=ROOT, env=env,
                                      stdout=open(path, "w"), stderr=subprocess.STDOUT))
        logs.append(path)
    return procs, logs


@pytest.mark.parametrize("victim", [3, 0])
def test_per_task_launch_kill_one_rank(tmp_path, victim):
    procs, logs = _per_task(tmp_path, 4)
    try:
        wait_for_iteration(logs[0], 3)
        procs[victim].kill()
        t0 = time.monotonic()
        for p in procs:
            p.wait(timeout=LIMIT_S)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text(errors="replace") for log in logs]
    everything = "\n".join(texts)
    print(f"all ranks exited {took:.1f} s after rank {victim} was killed")
    assert took < LIMIT_S
    assert [p.returncode for r, p in enumerate(procs) if r != victim] == [EXIT_PEER_LOST] * 3, everything[-4000:]
    errors = [line for line in everything.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"rank {victim} " in errors[0] and "is gone" in errors[0], everything[-4000:]
    assert "Traceback" not in everything


def test_kill_the_launcher_stops_every_worker(tmp_path):
    save = tmp_path / "ck"
    agent, log = _torchrun(tmp_path, ["--save", str(save), "--save-interval", "1"], nproc=2)
    try:
        wait_for_iteration(log, 3)
        workers = children(agent.pid)
        assert len(workers) == 2
        os.kill(agent.pid, signal.SIGKILL)
        killed_at = time.time()
        t0 = time.monotonic()
        while any(alive(p) for p in workers) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert not any(alive(p) for p in workers), "workers outlived their launcher"
        time.sleep(2)  # anything still writing would show up now
    finally:
        agent.wait(timeout=10)
        for p in workers:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    newest = max(os.stat(os.path.join(dp, f)).st_mtime for dp, _, fs in os.walk(save) for f in fs)
    assert newest <= killed_at + 0.5, f"a checkpoint file was written {newest - killed_at:.2f} s after the kill"
