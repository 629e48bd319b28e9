#!/usr/bin/env python
"""Checkpoint throughput vs the disk, and training-loop time blocked by asynchronous vs synchronous saves.

1. Save / load GB/s on 1 and 4 ranks (``--ranks``, forked gloo processes), two ways:
   ``Checkpointer.save`` (synchronous, fsync'd like DCP's writer) / ``Checkpointer.load`` of the model (TP = ranks;
   the defaults give a 537 MB checkpoint), an AdamW optimizer with state (one step) and the LR schedule, loaded
   into the same model (DCP plans, reads into the parameters and optimizer state), and ``dcp_io.save`` / ``load``
   alone on a ``--state-mb`` state of fp32 row blocks. The limit is measured in the same run on the same disk:
   every rank writing a raw file of its own checkpoint file's byte count at the same time, two ways (``dd bs=8M
   conv=fsync`` through the page cache, and the same with ``oflag=direct``; the save is compared with the faster)
   and reading it back, again two ways (``dd bs=8M`` and the same with ``iflag=direct``; the load is compared with
   the faster). Before every read both the checkpoint files and the raw files are dropped from the page
   cache (``posix_fadvise DONTNEED``), so both reads come from the disk (or whatever cache the disk has below the
   OS); the checkpoint and the raw file alternate which is timed first. Median of ``--reps``.
   Each load is timed again without CRC-32 verification (``--no-verify-checkpoint``), in the same round.
2. (``--only throughput``: the Checkpointer rows only; ``--only ranks``: the ``dcp_io`` rows only; ``--only crc``:
   the checkpoint CRC-32's speed on one core, ``checkpoint/crc.py``'s implementation against ``zlib.crc32``.)
3. Loop blocking: ``pretrain()`` three times on the same shape — no saves, ``--save-interval K`` synchronous,
   and the same with ``--async-save`` — timing the wall time of the loop and the time the loop spends inside
   the checkpoint calls (save, poll, the wait for an async save's copies before the next update, final wait).

    python benchmarks/bench_checkpoint.py [--layers 6] [--hidden 512] [--vocab 50304] [--seq 128]
        [--micro-batch 2] [--iters 12] [--save-interval 4] [--reps 4] [--dir /tmp] [--ranks 1 4] [--state-mb 512]
        [--only throughput|ranks|blocking|crc]
"""
import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import dcp_io
from megatronish.checkpoint import manager as ckpt_manager
from megatronish.checkpoint.manager import Checkpointer
from megatronish.model.build import build_model_chunks
from megatronish.optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from megatronish.optim.optimizer import build_optimizer
from megatronish.parallel import groups
from megatronish.training.exit import ExitPolicy
from megatronish.training.pretrain import TrainState, pretrain

os.environ.setdefault("MEGATRONISH_DEVICE", "cpu")  # read when a device is first asked for

CHUNK = 8 << 20


def bench_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)  # with --hidden 512: 44.7 M parameters, a 537 MB checkpoint
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--reps", type=int, default=4)  # even: each order (checkpoint or raw first) timed equally often
    p.add_argument("--dir", default=None, help="where checkpoints and the raw file go (default: a temp dir)")
    p.add_argument("--only", choices=["throughput", "ranks", "blocking", "crc"], default=None, help="run one part")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="process counts of the storage measurement")
    p.add_argument("--state-mb", type=int, default=512, help="state size of the storage measurement (MiB)")
    return p.parse_args()


def flags(a, extra=()):
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(a.vocab - 1), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch), "--train-iters", str(a.iters), "--lr", "1e-4",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1000",
            *extra]


def drop_cache(path):
    """Evict ``path`` (a file or every file under a directory) from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def raw_write(path, nbytes):
    """``dd bs=8M conv=fsync``: page-cache writes of one 8 MiB buffer, fsync."""
    buf = os.urandom(CHUNK)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[: min(CHUNK, left)])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_direct_write(path, nbytes):
    """``dd bs=8M oflag=direct conv=fsync``: O_DIRECT writes of one page-aligned 8 MiB buffer (the unaligned tail
    through the page cache), fsync. None where the file system refuses O_DIRECT."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            direct = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            return None
        aligned, done = nbytes - nbytes % 4096, 0
        while done < aligned:
            done += os.pwrite(direct, memoryview(buf)[: min(CHUNK, aligned - done)], done)
        os.close(direct)
        while done < nbytes:
            done += os.pwrite(fd, memoryview(buf)[: nbytes - done], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path):
    """``dd bs=8M``: page-cache reads into one 8 MiB buffer."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - t0


def raw_direct_read(path):
    """``dd bs=8M iflag=direct``: O_DIRECT reads into one page-aligned 8 MiB buffer. None where the file system
    refuses O_DIRECT."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(bytes(CHUNK))
    t0 = time.perf_counter()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    try:
        offset = 0
        while True:
            n = os.preadv(fd, [buf], offset)
            if n <= 0:
                break
            offset += n
    except OSError:
        return None
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _checkpointer_side(a, root, rank, world):
    """``Checkpointer.save`` / ``.load`` of the model (TP = ``world``), an AdamW optimizer with state (one step)
    and the LR schedule; the load goes into the same model (DCP plans, reads into the parameters and optimizer
    state). Returns (save, clear (zeroes the values a load restores; untimed), load, check, description)."""
    tp = ["--tensor-model-parallel-size", str(world)] if world > 1 else []
    ck_root = os.path.join(root, f"ck_{world}")
    cfg = configs_from_args(parse_args(flags(a, tp + ["--save", ck_root, "--load", ck_root])), world)
    groups.destroy_model_parallel()
    ctx = groups.initialize_model_parallel(cfg.parallel)
    models = build_model_chunks(cfg.model, ctx)
    for m in models:
        m.init_parameters(cfg.train.seed)
    opt = build_optimizer([(n, p) for m in models for n, p in m.named_parameters()], "adam", 1e-4, 0.01)
    params = [p for m in models for p in m.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # Adam state exists
    sched = OptimizerParamScheduler(opt, **scheduler_steps_from_config(cfg))
    ck = Checkpointer(cfg, models, opt, sched, parallel=ctx)
    saved = [p.detach().clone() for p in params]
    n_params = sum(p.numel() for p in params) * world
    rep = [0]

    def save(_):
        rep[0] += 1
        ck.save(TrainState(iteration=rep[0]))
        dist.barrier()  # rank 0 writes the tracker after every rank's files are complete
        return os.path.join(ck_root, f"iter_{rep[0]:07d}")

    def clear():  # untimed: the load must put the values back
        ck._on_disk = None
        with torch.no_grad():
            for p in params:
                p.zero_()

    def load(_, verify=True):
        ck.ck.no_verify_checkpoint = not verify
        ck.load(TrainState())

    def check():
        assert all(torch.equal(p, q) for p, q in zip(params, saved))

    what = (f"Checkpointer, {n_params / 1e6:.1f} M-param model (TP {world}) + Adam exp_avg, exp_avg_sq + JSON "
            "state")
    return save, clear, load, check, what


def _storage_side(a, root, rank, world):
    """``dcp_io.save`` / ``load`` alone: each rank holds a row block of ``--state-mb`` of fp32 tensors."""
    rows = (a.state_mb << 20) // (4 * 4096 * 8)  # 8 global fp32 tensors of [rows, 4096]; each rank holds a row block
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(per, 4096, generator=g) for _ in range(8)]
    state = {f"model.w{i}": dcp_io.Sharded((per * world, 4096), [dcp_io.Piece(t, (rank * per, 0))])
             for i, t in enumerate(mine)}
    # loads go into tensors that already exist (a model's parameters), allocated once
    target = {k: dcp_io.Sharded(v.global_shape, [dcp_io.Piece(torch.zeros_like(v.pieces[0].tensor),
                                                              v.pieces[0].offsets)]) for k, v in state.items()}
    rep = [0]

    def save(_):
        rep[0] += 1
        path = os.path.join(root, f"ranks_{rep[0]}")
        dcp_io.save(state, path)
        return path

    def clear():
        for t in target.values():
            t.pieces[0].tensor.zero_()

    def load(path, verify=True):
        dcp_io.load(target, path, verify=verify)

    def check():
        assert all(torch.equal(target[k].pieces[0].tensor, state[k].pieces[0].tensor) for k in state)

    return save, clear, load, check, "dcp_io alone, fp32 row blocks"


def _rank_io(rank, world, port, root, a, side, out):
    """One rank of a save / load measurement (see :func:`io_throughput`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1 if world > 1 else max(1, os.cpu_count() or 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    save, clear, load, check, what = side(a, root, rank, world)
    raw = os.path.join(root, f"raw_{rank}.bin")
    times = {"save": [], "load": [], "load_nv": [], "write": [], "dwrite": [], "read": [], "dread": []}

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        if not (key in ("dwrite", "dread") and result is None):  # None: O_DIRECT refused by the file system
            times[key].append(time.perf_counter() - t0)
        return result

    warm = save(None)  # one untimed round of each: lazy set-up is not the disk
    nbytes = os.path.getsize(os.path.join(warm, f"__{rank}_0.distcp"))
    load(warm)
    raw_write(raw, nbytes)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm)
    for rep in range(a.reps):
        # the disk's own speed and ours alternate which goes first (a VM disk's host cache favours recent data)
        first, second = (("save", "write", "dwrite"), ("load", "read", "dread", "load_nv")) if rep % 2 == 0 else \
            (("dwrite", "write", "save"), ("load_nv", "dread", "read", "load"))
        ck = None
        writers = {"write": raw_write, "dwrite": raw_direct_write}
        for key in first:
            result = timed(key, (lambda: save(None)) if key == "save" else (lambda: writers[key](raw, nbytes)))
            ck = result if key == "save" else ck
        for key in second:
            if key in ("load", "load_nv"):
                clear()
            drop_cache(raw)
            if rank == 0:
                drop_cache(ck)
            readers = {"read": raw_read, "dread": raw_direct_read, "load": load,
                       "load_nv": lambda path: load(path, verify=False)}
            timed(key, lambda: readers[key](raw if key in ("read", "dread") else ck))
            if key in ("load", "load_nv"):
                check()
        dist.barrier()
        if rank == 0:
            total = dir_bytes(ck)
            shutil.rmtree(ck)
    if rank == 0:
        out.put((total, what, {k: statistics.median(v) if v else None for k, v in times.items()}))
    dist.destroy_process_group()


def io_throughput(a, root, sides):
    """Save / load on ``--ranks`` forked gloo processes against every rank writing / reading a raw file of its own
    checkpoint file's byte count at the same time (8 MiB writes, fsync; page cache dropped before every read, of
    the checkpoint files and the raw files alike). Wall time between barriers, median of ``--reps`` after one untimed
    round of each; the checkpoint and the raw file alternate which is timed first."""
    import multiprocessing
    import socket

    ctx = multiprocessing.get_context("fork")
    for name, side in sides:
        for world in a.ranks:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            out = ctx.Queue()
            procs = [ctx.Process(target=_rank_io, args=(r, world, port, root, a, side, out)) for r in range(world)]
            for p in procs:
                p.start()
            total, what, t = out.get(timeout=1800)
            for p in procs:
                p.join()
            gb = total / 1e9
            print(f"{name}: {world} rank(s), {total / 1e6:.0f} MB checkpoint ({what}), median of {a.reps}")
            disk = min(t["write"], t.get("dwrite") or t["write"])  # the faster of the two raw writes
            direct = f"{gb / t['dwrite']:6.3f}" if t.get("dwrite") else "   n/a"
            print(f"  save  {gb / t['save']:6.3f} GB/s   raw write, same bytes per rank: page cache "
                  f"{gb / t['write']:6.3f} GB/s, O_DIRECT {direct} GB/s   ratio to the faster {disk / t['save']:.2f}")
            dread = f"{gb / t['dread']:6.3f}" if t.get("dread") else "   n/a"
            disk = min(t["read"], t.get("dread") or t["read"])
            print(f"  load  {gb / t['load']:6.3f} GB/s   raw read, same bytes per rank:  page cache "
                  f"{gb / t['read']:6.3f} GB/s, O_DIRECT {dread} GB/s   ratio to the faster {disk / t['load']:.2f}")
            print(f"  load without CRC-32 verification (--no-verify-checkpoint) {gb / t['load_nv']:6.3f} GB/s   "
                  f"verified / unverified load time {t['load'] / t['load_nv']:.3f}")


def loop_blocking(a, root):
    # the loop is blocked inside the exit policy's per-iteration call (the save and poll), in the wait for the
    # snapshot's copies before each update (--async-save), and in the final wait
    blocked = {"after_iteration": 0.0, "wait_for_snapshot": 0.0, "finish": 0.0}
    save_calls = []  # each Checkpointer.save call's own time (inside after_iteration)

    def timed(name, fn):
        def wrapper(self, *args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kw)
            finally:
                if name in blocked:
                    blocked[name] += time.perf_counter() - t0
                else:
                    save_calls.append(time.perf_counter() - t0)
        return wrapper

    # where the loop waits for saves, and the save calls themselves
    owners = {"after_iteration": ExitPolicy, "wait_for_snapshot": Checkpointer, "finish": Checkpointer,
              "save": Checkpointer}
    originals = {name: getattr(owners[name], name) for name in owners}
    for name, fn in originals.items():
        setattr(owners[name], name, timed(name, fn))
    results = {}
    try:
        for mode, extra in (("none", []), ("sync", ["--save", os.path.join(root, "sync"), "--save-interval",
                                                    str(a.save_interval)]),
                            ("async", ["--save", os.path.join(root, "async"), "--save-interval", str(a.save_interval),
                                       "--async-save"])):
            groups.destroy_model_parallel()
            blocked.update(after_iteration=0.0, wait_for_snapshot=0.0, finish=0.0)
            save_calls.clear()
            cfg = configs_from_args(parse_args(flags(a, extra)), 1)
            t0 = time.perf_counter()
            pretrain(cfg)
            results[mode] = (time.perf_counter() - t0, blocked["after_iteration"] + blocked["wait_for_snapshot"],
                             blocked["finish"], list(save_calls), blocked["wait_for_snapshot"])
    finally:
        for name, fn in originals.items():
            setattr(owners[name], name, fn)
    saves = a.iters // a.save_interval
    print(f"training loop: {a.iters} iterations, a save every {a.save_interval} ({saves} saves; the last one, at the "
          "end of training, is waited for at exit)")
    for mode, (wall, loop, end, calls, snap) in results.items():
        print(f"  {mode:5s}  wall {wall:7.2f} s   blocked in the loop {loop:6.2f} s "
              f"({loop / max(saves, 1) * 1e3:7.1f} ms per save, of which waiting for the snapshot "
              f"{snap / max(saves, 1) * 1e3:.1f})   at exit {end:6.2f} s   save calls (ms): "
              + " ".join(f"{t * 1e3:.0f}" for t in calls[:saves]))
    (ws, ls, es, cs, _), (wa, la, ea, ca, _), w0 = results["sync"], results["async"], results["none"][0]
    med = statistics.median
    print(f"  blocked in the loop async / sync {la / ls:.3f};  incl. the exit wait {(la + ea) / (ls + es):.3f};  "
          f"wall overhead vs no saves: sync {ws - w0:+.2f} s, async {wa - w0:+.2f} s")
    if len(ca) > 1 and cs:
        print(f"  async save call after the first / sync save call (medians) {med(ca[1:saves]) / med(cs[:saves]):.3f} "
              "(the first save of a run included in the line above)")


def crc_speed(megabytes: int = 256, reps: int = 5) -> None:
    """GB/s of the checkpoint CRC-32 and of zlib's over the same bytes (best of ``reps``), one core."""
    import zlib

    from megatronish.checkpoint import crc

    data = os.urandom(megabytes << 20)
    speeds = {}
    for name, fn in ((crc.IMPLEMENTATION, crc.crc32), ("zlib", zlib.crc32)):
        best = min(_timed(fn, data) for _ in range(reps))
        speeds[name] = len(data) / best / 1e9
    ours = speeds[crc.IMPLEMENTATION]
    print(f"crc-32 over {megabytes} MB, one core: {crc.IMPLEMENTATION} {ours:.2f} GB/s, "
          f"zlib {speeds['zlib']:.2f} GB/s, ratio {ours / speeds['zlib']:.2f}")


def _timed(fn, data) -> float:
    t = time.perf_counter()
    fn(data)
    return time.perf_counter() - t


def main():
    a = bench_args()
    if a.only == "crc":
        crc_speed()
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=a.dir)
    ckpt_manager._log = lambda msg: None  # quiet
    try:
        sides = {"throughput": [("Checkpointer", _checkpointer_side)], "ranks": [("storage", _storage_side)],
                 None: [("Checkpointer", _checkpointer_side), ("storage", _storage_side)]}.get(a.only)
        if sides:
            io_throughput(a, root, sides)  # first: its forked ranks must not inherit this process's process group
        if a.only in (None, "blocking"):
            loop_blocking(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
