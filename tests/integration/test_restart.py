"""A restart instead of a lost job: under ``torchrun --max-restarts 2`` with ``--save D --load D``, ``kill -9`` of
one worker at TP 2 x DP 2 makes the other ranks' watchdogs end them (exit 4) and torchrun start every worker again;
they load the latest complete checkpoint and the job finishes by itself (exit 0) with every recorded loss and the
final weights equal to an uninterrupted run's. The ranks of a restarted attempt agree on its number through the
job's store, whatever an earlier attempt left there (``training/attempt.py``): its process group and watchdogs never
read the failed attempt's keys (the gloo addresses of dead processes, the failure record)."""
import os
import signal
import subprocess
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import layout
from megatronish.checkpoint.offline import iter_model_tensors
from megatronish.testing import free_port, run_distributed
from megatronish.training.attempt import join_attempt
from megatronish.training.pretrain import pretrain
from support.launch import ROOT, alive, children, cpu_env, metrics_losses, rank_of, torchrun_cmd, wait_for_iteration

ITERS = 24
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
         "--log-interval", "1", "--tensor-model-parallel-size", "2", "--save-interval", "4"]


def _attempts(port, world, late: dict) -> list:
    """Every rank's ``join_attempt`` on the store at ``port``, each in a thread with its own client (``late``: rank
    -> seconds it starts late)."""
    got = [None] * world

    def rank(q):
        threading.Event().wait(late.get(q, 0))
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        got[q] = join_attempt(dist.PrefixStore("job", client), q, world, timeout_s=20)

    threads = [threading.Thread(target=rank, args=(q,)) for q in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_ranks_agree_on_the_attempt_whatever_the_store_holds():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    assert _attempts(port, 3, {}) == [0, 0, 0]
    # the restart: rank 2's greeting from attempt 0 is still in the store when rank 0 reads it
    assert _attempts(port, 3, {2: 0.3}) == [1, 1, 1]
    assert _attempts(port, 3, {0: 0.3, 1: 0.1}) == [2, 2, 2]
    del server


def _reference(rank, world, argv):
    pretrain(configs_from_args(parse_args(argv), world))


def test_kill_one_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path):
    ref, ck = str(tmp_path / "ref"), str(tmp_path / "ck")
    run_distributed(_reference, 4, [*FLAGS, "--save", ref, "--metrics-file", str(tmp_path / "ref.jsonl")])
    log_path = tmp_path / "out.log"
    argv = [*FLAGS, "--save", ck, "--load", ck, "--metrics-file", str(tmp_path / "ck.jsonl")]
    with open(log_path, "w") as log:
        # torchrun looks at its workers every 3 s: the ranks' watchdogs see the lost rank first, record the failure
        # in the store and exit 4, and the restarted attempt must not take that record for its own
        # at the lowest priority: this test must see iteration 5 and kill before the job's last iteration, also on
        # a busy machine (the job runs its 24 iterations in about 2 s)
        agent = subprocess.Popen(["nice", "-n", "19", *torchrun_cmd(4, argv, "--max-restarts", "2",
                                                                      "--monitor-interval", "3")],
                                 cwd=ROOT, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_iteration(log_path, 5)  # the checkpoint of iteration 4 is complete
        workers = {rank_of(p): p for p in children(agent.pid)}
        assert 3 in workers and alive(workers[3]), "the job ended before the kill"
        os.kill(workers[3], signal.SIGKILL)
        assert f"iteration {ITERS:8d}/" not in log_path.read_text(errors="replace"), "the job ended before the kill"
        agent.wait(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
    text = log_path.read_text(errors="replace")
    assert agent.returncode == 0, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 3 (pid ") and "is gone" in errors[0], text[-4000:]
    loaded = [line for line in text.splitlines() if line.startswith("loaded checkpoint ")]
    assert len(loaded) == 1 and "attempt 1 of this job" in text, text[-4000:]
    first_loaded = int(loaded[0].rsplit("iteration ", 1)[1].rstrip(")"))
    assert 4 <= first_loaded < ITERS

    want = metrics_losses(tmp_path / "ref.jsonl")
    records = metrics_losses(tmp_path / "ck.jsonl", every=True)
    assert sorted(want) == list(range(1, ITERS + 1)) and {i for i, _ in records} == set(want)
    assert [loss for i, loss in records] == [want[i] for i, _ in records]  # both attempts, every record, exact
    assert layout.read_tracker(ck) == ITERS
    ours = dict(iter_model_tensors(ck))
    theirs = dict(iter_model_tensors(ref))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
