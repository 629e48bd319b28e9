"""The sbatch scripts on a real Slurm: slurmctld and two slurmd daemons simulating two nodes on this host
(scripts/slurm/local_cluster.sh). Runs as root with Slurm installed or apt-get available (marker ``slurm``;
tests/conftest.py skips it otherwise, with the reason); where apt-get cannot install the packages (no reachable
package registry) it skips with that reason (tests/support/slurm_support.py).

* pretrain_gpt.sbatch on 2 nodes (torchrun per node, c10d rendezvous), TP 2 across the nodes, and the
  one-task-per-process variant at the same time: exit code, metrics, checkpoint;
* preprocess.sbatch tokenizes a corpus;
* an impossible request fails at submission (EnforcePartLimits);
* preemption: SIGTERM to the batch shell of a running job with --exit-signal-handler saves a checkpoint at the
  iteration it reached, the script requeues the job, and the requeued job resumes from that iteration;
* a lost rank: kill -9 of one worker of a TP 2 x DP 2 job (2 nodes x 2 processes) with --save/--load one
  directory; torchrun restarts the job's workers (TORCHRUN_ARGS="--max-restarts 2"), or, with torchrun's
  restarts spent, the script requeues the job (REQUEUE_ON_FAILURE=1); either way the job finishes by itself with
  the losses and final weights of an uninterrupted run.
"""
import json
import os
import subprocess
import time

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import layout
from megatronish.checkpoint.offline import iter_model_tensors
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain
from support.launch import metrics_losses
from support.slurm_support import up_outcome

pytestmark = pytest.mark.slurm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh")
SBATCH = os.path.join(ROOT, "scripts", "slurm", "pretrain_gpt.sbatch")
SBATCH_PER_TASK = os.path.join(ROOT, "scripts", "slurm", "pretrain_gpt_per_task.sbatch")
PREPROCESS = os.path.join(ROOT, "scripts", "slurm", "preprocess.sbatch")
NODES = ("mstest-n1", "mstest-n2")
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
         "--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, SLURM_LOCAL_DIR=os.path.join(state, "cluster"), SLURM_LOCAL_NODES=" ".join(NODES),
               SLURM_LOCAL_PORT_BASE="26817", SLURM_LOCAL_INSTALL="1")
    env["SLURM_CONF"] = os.path.join(env["SLURM_LOCAL_DIR"], "etc", "slurm.conf")

    def down():
        subprocess.run(["bash", CLUSTER, "down"], env=env, capture_output=True, text=True, timeout=120)

    t0 = time.time()
    up = subprocess.run(["bash", CLUSTER, "up"], env=env, capture_output=True, text=True, timeout=600)
    outcome = up_outcome(up.returncode, up.stderr)
    if outcome is not None:
        down()
        kind, why = outcome
        if kind == "skip":  # no reachable package registry: these tests cannot run on this machine
            pytest.skip(f"slurm test skipped: {why}")
        pytest.fail(f"{why}\n{up.stdout}")
    print(f"\nlocal Slurm up in {time.time() - t0:.1f} s\n{up.stderr.strip()}")
    # The jobs inherit this environment (sbatch --export=ALL).
    env.update(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu", PYTHON=os.environ.get("PYTHON", "python3"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    try:
        yield env
    finally:
        down()
        with open("/etc/hosts") as f:
            hosts = f.read()
        assert not any(n in hosts for n in NODES), "/etc/hosts not restored"


def _run(cmd, env, cwd, check=True):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, f"{cmd}: {p.stdout}{p.stderr}"
    return p


def _submit(env, cwd, *args):
    return _run(["sbatch", "--parsable", *args], env, cwd).stdout.strip().split(";")[0]


def _job(env, job):
    """`scontrol show job` as a dict (no accounting here, so no sacct)."""
    out = _run(["scontrol", "show", "job", "-o", job], env, "/").stdout
    fields = {}
    for tok in out.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields.setdefault(k, v)
    return fields


def _wait(env, job, until, timeout=240):
    t0 = time.time()
    while True:
        info = _job(env, job)
        if until(info):
            return info
        assert time.time() - t0 < timeout, f"job {job} stuck: {info.get('JobState')} {info.get('Reason')}"
        time.sleep(0.5)


def _done(info):
    return info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _logs(cwd):
    out = []
    for root, _, files in os.walk(cwd):
        for f in sorted(files):
            if f.endswith((".out", ".log")):
                with open(os.path.join(root, f)) as fh:
                    out.append(f"== {f}\n{fh.read()[-3000:]}")
    return "\n".join(out)


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


def test_sbatch_two_nodes_tp2_and_per_task(cluster, tmp_path):
    env = cluster
    runs = {}
    for name, script in (("torchrun", SBATCH), ("per_task", SBATCH_PER_TASK)):
        d = tmp_path / name
        d.mkdir()
        flags = FLAGS + ["--train-iters", "6", "--save", str(d / "ckpt"), "--save-interval", "3",
                         "--metrics-file", str(d / "metrics.jsonl")]
        runs[name] = (d, _submit(env, str(d), "-N", "2", script, *flags))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(str(i * j % 50) for j in range(20))}) + "\n"
                              for i in range(30)))
    (tmp_path / "data").mkdir()
    prep = _submit(env, str(tmp_path), PREPROCESS, "--input", str(corpus), "--output-prefix",
                   str(tmp_path / "data" / "corpus"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                   "--append-eod")

    for name, (d, job) in runs.items():
        info = _wait(env, job, _done)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{name}: {info}\n{_logs(d)}"
        assert info["NumNodes"] == "2" and info["NodeList"] == "mstest-n[1-2]", info
        records = [r for r in _metrics(d / "metrics.jsonl") if "split" not in r]
        assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6], name
        assert records[-1]["consumed_samples"] == 12
        assert all(r["lm_loss"] == r["lm_loss"] and 3.0 < r["lm_loss"] < 5.0 for r in records), records
        assert _tracker(d / "ckpt") == 6
        assert sorted(p for p in os.listdir(d / "ckpt") if p.startswith("iter_")) == ["iter_0000003", "iter_0000006"]
        assert (d / "ckpt" / "iter_0000006" / ".metadata").is_file()
        # One log per node; both ranks' shards in the checkpoint (TP 2 across the two nodes).
        logdir = d / "logs" / f"megatronish-gpt-{job}"
        assert sorted(os.listdir(logdir)) == ["node-0.log", "node-1.log"], _logs(d)
        shards = [p for p in os.listdir(d / "ckpt" / "iter_0000006") if p.endswith(".distcp")]
        assert len(shards) == 2, shards
    # Same seed, same layout: the two launch paths train the same model.
    a, b = (_metrics(runs[n][0] / "metrics.jsonl") for n in ("torchrun", "per_task"))
    assert [r["lm_loss"] for r in a] == pytest.approx([r["lm_loss"] for r in b], rel=1e-5)

    info = _wait(env, prep, _done)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_logs(tmp_path)}"
    assert (tmp_path / "data" / "corpus_text_document.bin").stat().st_size == 30 * 21 * 2  # 20 ids + EOD, uint16
    assert (tmp_path / "data" / "corpus_text_document.idx").is_file()

    # More nodes than the partition has: refused at submission, not left pending.
    bad = _run(["sbatch", "-N", "3", SBATCH, *FLAGS], env, str(tmp_path), check=False)
    assert bad.returncode != 0 and "Node count specification invalid" in bad.stderr, bad.stderr


def test_preempt_saves_requeues_and_resumes(cluster, tmp_path):
    env = cluster
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    iters = 150
    flags = FLAGS + ["--train-iters", str(iters), "--save", str(save), "--load", str(save), "--save-interval", "1000",
                     "--exit-signal-handler", "--metrics-file", str(metrics)]
    job = _submit(env, str(tmp_path), "-N", "2", SBATCH, *flags)

    t0 = time.time()
    while not (metrics.exists() and len(_metrics(metrics)) >= 10):
        assert time.time() - t0 < 120 and not _done(_job(env, job)), _logs(tmp_path)
        time.sleep(0.2)
    # What Slurm does before the time limit with --signal=B:TERM@120 (and preemption): SIGTERM to the batch shell.
    _run(["scancel", "--batch", "--signal=TERM", job], env, str(tmp_path))
    info = _wait(env, job, lambda i: i["Restarts"] == "1" and i["JobState"] == "PENDING", timeout=120)

    saved = _tracker(save)
    first = [r["iteration"] for r in _metrics(metrics)]
    assert 10 <= saved < iters, saved
    assert first == list(range(1, saved + 1)), first  # stopped right after the iteration it saved
    assert (save / f"iter_{saved:07d}" / ".metadata").is_file()
    assert sorted(os.listdir(save)) == ["iter_%07d" % saved, "latest_checkpointed_iteration.txt"]

    # Slurm holds a requeued job back until its previous run's credentials expire (cred_expire, 10 s in the local
    # cluster's slurm.conf); forcing an earlier start makes the launch fail with a revoked credential.
    info = _wait(env, job, _done, timeout=180)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{_logs(tmp_path)}"
    records = _metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(1, iters + 1))  # resumed at saved + 1, nothing repeated
    assert records[saved]["consumed_samples"] == 2 * (saved + 1)
    assert _tracker(save) == iters
    # torchrun's rendezvous decides which node holds rank 0 (the one that logs the load).
    logdir = tmp_path / "logs" / f"megatronish-gpt-{job}"
    node_logs = "".join((logdir / f).read_text() for f in sorted(os.listdir(logdir)))
    assert f"loaded checkpoint {save}/iter_{saved:07d} (iteration {saved}" in node_logs, node_logs[-3000:]
    with open(tmp_path / f"slurm-megatronish-gpt-{job}.out") as f:
        batch_log = f.read()
    assert "received SIGTERM" in batch_log and "requeueing job" in batch_log and "(restart 1)" in batch_log


def _task_pids(job, procid, var="SLURM_PROCID"):
    """Training processes of ``job`` whose ``var`` (Slurm's task id; torchrun's ``RANK``) is ``procid`` (both
    simulated nodes run on this host)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"pretrain_gpt.py" in cmd and environ.get(b"SLURM_JOB_ID") == job.encode() \
                and environ.get(var.encode()) == str(procid).encode():
            out.append(int(pid))

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])

    return [p for p in out if parent(p) not in out]  # not its data loader workers


def test_per_task_launch_lost_rank_ends_the_job(cluster, tmp_path):
    """kill -9 one task of the per-task launch (srun, no torchrun) with the default --distributed-timeout-minutes:
    the job ends within 60 s and a line names the lost rank."""
    env = cluster
    metrics = tmp_path / "metrics.jsonl"
    job = _submit(env, str(tmp_path), "-N", "2", SBATCH_PER_TASK, *FLAGS, "--train-iters", "100000",
                  "--metrics-file", str(metrics))
    t0 = time.time()
    while not (metrics.exists() and len(_metrics(metrics)) >= 3):
        assert time.time() - t0 < 180 and not _done(_job(env, job)), _logs(tmp_path)
        time.sleep(0.2)
    victims = _task_pids(job, 1)
    assert len(victims) == 1, victims
    os.kill(victims[0], 9)
    killed = time.time()
    info = _wait(env, job, _done, timeout=60)
    assert time.time() - killed < 60
    assert info["JobState"] != "COMPLETED", info
    text = _logs(tmp_path)
    assert "error: rank 1 " in text or "task 1: Killed" in text, text
    assert not _task_pids(job, 0)


RESTART_ITERS = 32
_GBS = FLAGS.index("--global-batch-size") + 1
RESTART_FLAGS = [*FLAGS[:_GBS], "8", *FLAGS[_GBS + 1:], "--lr-warmup-iters", "2", "--train-iters", str(RESTART_ITERS),
                 "--save-interval", "4"]


def _reference(rank, world, argv):
    pretrain(configs_from_args(parse_args(argv), world))


def test_lost_worker_restarts_or_requeues_and_finishes_like_an_uninterrupted_run(cluster, tmp_path):
    """kill -9 of rank 3 once the checkpoint of iteration 4 is complete, in two jobs at once: "restart" restarts
    in place (torchrun --max-restarts 2: same rendezvous inside the job), "requeue" has no torchrun restarts, so
    torchrun gives up and the script requeues the job (REQUEUE_ON_FAILURE=1), which resumes from --load."""
    env = cluster
    paths = {"restart": "--max-restarts 2", "requeue": "--max-restarts 0"}
    jobs = {}
    for name, torchrun_args in paths.items():
        d = tmp_path / name
        d.mkdir()
        flags = [*RESTART_FLAGS, "--save", str(d / "ckpt"), "--load", str(d / "ckpt"),
                 "--metrics-file", str(d / "metrics.jsonl")]
        job_env = dict(env, NPROC_PER_NODE="2", TORCHRUN_ARGS=torchrun_args, REQUEUE_ON_FAILURE="1")
        jobs[name] = _run(["sbatch", "--parsable", "-N", "2", SBATCH, *flags], job_env, str(d)).stdout.strip()
    ref = tmp_path / "ref"
    run_distributed(_reference, 4, [*RESTART_FLAGS, "--save", str(ref), "--metrics-file", str(ref / "m.jsonl")])

    t0, killed = time.time(), set()
    while len(killed) < len(jobs):
        for name, job in jobs.items():
            metrics = tmp_path / name / "metrics.jsonl"
            if name in killed or not (metrics.exists() and len(_metrics(metrics)) >= 5):
                continue  # the checkpoint of iteration 4 is complete once iteration 5 is recorded
            victims = _task_pids(job, 3, var="RANK")
            assert len(victims) == 1 and not _done(_job(env, job)), f"{name}: {victims}\n{_logs(tmp_path / name)}"
            os.kill(victims[0], 9)
            killed.add(name)
        assert time.time() - t0 < 180, _logs(tmp_path)
        time.sleep(0.1)

    want = metrics_losses(ref / "m.jsonl")
    assert sorted(want) == list(range(1, RESTART_ITERS + 1))
    theirs = dict(iter_model_tensors(str(ref)))
    for name, job in jobs.items():
        d = tmp_path / name
        info = _wait(env, job, lambda i: _done(i) and (name == "restart" or i["Restarts"] != "0"), timeout=240)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{name}: {info}\n{_logs(d)}"
        assert info["Restarts"] == ("0" if name == "restart" else "1"), info
        records = metrics_losses(d / "metrics.jsonl", every=True)
        assert {i for i, _ in records} == set(want), name
        assert [loss for i, loss in records] == [want[i] for i, _ in records], name  # every record, exact
        assert layout.read_tracker(str(d / "ckpt")) == RESTART_ITERS
        ours = dict(iter_model_tensors(str(d / "ckpt")))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        logdir = d / "logs" / f"megatronish-gpt-{job}"
        node_logs = "".join((logdir / f).read_text() for f in sorted(os.listdir(logdir)))
        loaded = [line for line in node_logs.splitlines() if line.startswith("loaded checkpoint ")]
        assert len(loaded) == 1 and 4 <= int(loaded[0].rsplit("iteration ", 1)[1].rstrip(")")) < RESTART_ITERS
        batch_log = (d / f"slurm-megatronish-gpt-{job}.out").read_text()
        if name == "restart":
            assert "attempt 1 of this job" in node_logs and "requeueing" not in batch_log, batch_log
        else:
            assert "requeueing job" in batch_log and "after a failure" in batch_log, batch_log
            assert "(restart 1)" in batch_log
