"""End to end through ``pretrain_gpt.py`` processes: SIGTERM to one rank with ``--exit-signal-handler`` saves and
every rank exits 0; killing a process while an asynchronous save is in flight leaves the previous checkpoint
loadable and chosen; ``tools/checkpoint/inspect_checkpoint.py`` reads what was written."""
import json
import os
import signal
import subprocess
import sys
import time

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint.offline import iter_model_tensors, read_checkpoint_meta
from megatronish.parallel import groups
from megatronish.testing import free_port, run_distributed
from support.launch import children

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "100000", "--lr", "1e-3",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def _wait_for_line(proc, needle: str, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no line with {needle!r} within {timeout} s:\n{''.join(lines[-20:])}")


def test_sigterm_to_one_rank_saves_and_all_exit_zero(tmp_path):
    save = str(tmp_path / "ck")
    port = str(free_port())
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, "--save", save, "--exit-signal-handler"]
    procs = []
    for rank in range(2):  # two processes of one job (DP 2), as a launcher would start them
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE if rank == 0 else
                                      subprocess.DEVNULL, stderr=open(tmp_path / f"err{rank}", "w")))
    try:
        _wait_for_line(procs[0], "iteration        3/", 120)
        # only rank 1 receives it (rank 0 learns through the all-reduce), together with its data loader workers,
        # as a scheduler signals every process of a job step: the workers leave it to the training process
        workers = children(procs[1].pid)
        assert len(workers) == 2, workers  # --num-workers 2 (the default)
        for pid in [procs[1].pid, *workers]:
            os.kill(pid, signal.SIGTERM)
        out, _ = procs[0].communicate(timeout=120)
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    errs = [(tmp_path / f"err{r}").read_text() for r in range(2)]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "exiting program after receiving SIGTERM" in out
    meta = read_checkpoint_meta(save)
    assert 3 <= meta["iteration"] < 100 and meta["layout"]["dp"] == 2
    assert f"saved checkpoint {os.path.join(save, 'iter_%07d' % meta['iteration'])}" in out

    tool = os.path.join(ROOT, "tools", "checkpoint", "inspect_checkpoint.py")
    inspect = subprocess.run([sys.executable, tool, save, "--json"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    info = json.loads(inspect.stdout)
    assert info["iteration"] == meta["iteration"] and info["config"]["model"]["hidden_size"] == 32
    assert info["tensors"]["embedding.word_embeddings.weight"]["shape"] == [128, 32]
    assert info["optimizer_tensors"]["decoder.final_layernorm.weight.exp_avg"]["shape"] == [32]


# The second save's writer stalls after a few items (a slow disk); the process is killed while it is in flight.
SLOW_WRITER = """
import sys, time
import torch.distributed.checkpoint.filesystem as fs
import megatronish.checkpoint.dcp_io as dcp_io
import megatronish.checkpoint.tensor_archive as tensor_archive
saves, written = [0], [0]
real_save, real_item, real_archive = dcp_io.save, fs._write_item, tensor_archive.write
def save(*a, **k):
    saves[0] += 1
    written[0] = 0
    return real_save(*a, **k)
def slow(real):
    def write(*a, **k):
        written[0] += 1
        if saves[0] >= 2 and written[0] == 4:
            print("SLOW WRITE IN FLIGHT", flush=True)
            time.sleep(600)
        return real(*a, **k)
    return write
dcp_io.save, fs._write_item, tensor_archive.write = save, slow(real_item), slow(real_archive)
from megatronish.tools.pretrain_gpt import main
main(sys.argv[1:])
"""


def _resume_losses(rank, world, save):
    groups.destroy_model_parallel()
    from megatronish.training.pretrain import pretrain

    argv = FLAGS + ["--load", save, "--exit-interval", "3"]
    return [loss for _, loss in pretrain(configs_from_args(parse_args(argv), world)).state.history]


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ck")
    script = tmp_path / "slow.py"
    script.write_text(SLOW_WRITER)
    cmd = [sys.executable, str(script), *FLAGS, "--save", save, "--save-interval", "2", "--async-save"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "err", "w"))
    try:
        # the writer stalls; training goes on while the save is in flight (the two lines come in either order)
        lines = _wait_for_line(proc, "SLOW WRITE IN FLIGHT", 120)
        if not any("iteration        5/" in line for line in lines):
            lines += _wait_for_line(proc, "iteration        5/", 60)
        assert any("saving checkpoint" in line and "iter_0000004" in line for line in lines), "".join(lines)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"
    assert os.path.isdir(os.path.join(save, "iter_0000004"))  # partly written, never named by the tracker
    assert not os.path.exists(os.path.join(save, "iter_0000004", ".metadata"))
    meta = read_checkpoint_meta(save)
    assert meta["iteration"] == 2 and len(dict(iter_model_tensors(save))) == len(meta["tensors"])
    assert len(run_distributed(_resume_losses, 1, save)[0]) == 1  # resumes at iteration 2, trains to 3
