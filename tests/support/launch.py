"""Launching ``pretrain_gpt.py`` jobs from tests and watching them: a CPU environment for child processes, torchrun's
workers (their pids and ranks), whether a process is alive, waiting for an iteration's log line, and the losses a
``--metrics-file`` recorded; and running a job to its end, with every process's Python stacks when it does not end
in time."""
import json
import os
import signal
import subprocess
import sys
import time

from megatronish.testing import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def cpu_env(**extra):
    """The environment of a CPU job started from a test: one thread per process, and none of the launcher
    variables of the process running the tests."""
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, argv, *launcher_flags) -> list:
    """``torchrun --standalone --nproc-per-node N [launcher flags] pretrain_gpt.py ARGV``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *launcher_flags, PRETRAIN, *argv]


def children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_iteration(log_path, n, timeout=120):
    """Until the log at ``log_path`` has Megatron's line of iteration ``n``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            if f"iteration {n:8d}/" in f.read():
                return
        time.sleep(0.1)
    with open(log_path, errors="replace") as f:
        raise AssertionError(f"iteration {n} not reached:\n{f.read()[-3000:]}")


def metrics_losses(path, every: bool = False):
    """``{iteration: lm loss}`` of the training records in a ``--metrics-file`` (the last record of an iteration
    recorded twice, as after a restart); ``every``: ``[(iteration, lm loss)]`` of every record, in file order."""
    with open(path) as f:
        records = [(r["iteration"], r["lm_loss"]) for r in map(json.loads, f) if "split" not in r]
    return records if every else dict(records)


def _tree(pid):
    """``pid`` and every process below it (a launcher, its workers, their data loader workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += children(p)
        except OSError:
            pass
    return out


def run_job(cmd, *, timeout, env=None, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a job (a launcher and its workers) that must end
    within ``timeout`` seconds. One that does not fails the test with every process's Python stacks: the job runs with
    ``PYTHONFAULTHANDLER`` set, and each of its processes gets SIGABRT, which makes it print every thread's stack
    before it ends, so a rare hang in CI says where each rank stood."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # one process at a time, so that their stacks do not interleave; the launcher last, so that it does not end
        # its workers before they print
        tree = _tree(proc.pid)  # taken once: a process whose parent ended is no longer below the launcher
        for pid in reversed(tree):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 3
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        for pid in tree:  # torchrun starts its workers in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))} ... did not end in {timeout} s; its output, with each "
                             f"process's stacks:\n{out[-6000:]}\n{err[-20000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
