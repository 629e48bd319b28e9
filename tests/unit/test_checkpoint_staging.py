"""Asynchronous saves snapshot into staging buffers allocated once: every later save reuses them (same memory, no
new allocation) and writes the values of its own moment (the model and optimizer tensors are copied after the save
call returns, before the loop's next update); a save while the previous one is still writing waits for
it before touching the buffers; the stored tensors are byte-identical to a synchronous save's."""
import dataclasses
import mmap
import os
import resource
import threading

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import dcp_io
from megatronish.checkpoint.dcp_io import Obj, Piece, Sharded
from megatronish.checkpoint.state import DeferredCopies, StagingBuffers
from megatronish.testing import run_distributed

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0"]


def _entries(big, small):
    return {"model.big": Sharded((8, 6), [Piece(big[:4], (0, 0)), Piece(big[4:], (4, 0))]),
            "model.bf16": Sharded.whole(small),
            "model.col": Sharded((8, 3), [Piece(big[:, :3], (0, 0))]),  # a non-contiguous view
            "common_state": Obj({"iteration": 1})}


def test_stage_copies_and_reuses_buffers():
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(8, 6, generator=g), torch.randn(5, 7, generator=g).to(torch.bfloat16)
    staging = StagingBuffers()
    first = _entries(big, small)
    staging.stage(first)
    staged = {(k, p.offsets): p.tensor for k, e in first.items() if isinstance(e, Sharded) for p in e.pieces}
    assert staging.allocations == 4 and len(staged) == 4
    want = {("model.big", (0, 0)): big[:4], ("model.big", (4, 0)): big[4:], ("model.bf16", (0, 0)): small,
            ("model.col", (0, 0)): big[:, :3]}
    before = {k: v.clone() for k, v in want.items()}
    for k, t in staged.items():
        assert torch.equal(t, before[k]) and t.dtype == before[k].dtype
        assert t.is_contiguous() and t.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    big.add_(1.0)  # the training step changes the tensors: the snapshot does not move
    small.mul_(2)
    assert all(torch.equal(staged[k], before[k]) for k in staged)

    second = _entries(big, small)
    staging.stage(second)
    assert staging.allocations == 4  # reused, not reallocated
    for k, e in second.items():
        for p in getattr(e, "pieces", []):
            assert p.tensor is staged[(k, p.offsets)]
            assert torch.equal(p.tensor, want[(k, p.offsets)])  # the values of this save's moment

    third = {"model.big": Sharded((9, 6), [Piece(torch.ones(9, 6), (0, 0))])}  # another shape: a new buffer
    staging.stage(third)
    assert staging.allocations == 5 and torch.equal(third["model.big"].pieces[0].tensor, torch.ones(9, 6))


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTFORK"), reason="Linux madvise")
def test_staging_buffers_are_not_shared_with_forked_processes():
    """A process forked after set-up (data loader workers) would share the buffers' pages copy-on-write: the next
    save's copy would fault on every page. The buffers are kept out of forked children."""
    src = torch.randn(1 << 20)  # 4 MiB: 1024 pages
    staging = StagingBuffers()
    staging.reserve({"model.w": Sharded.whole(src)})
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that lives while the parent copies
        os.read(r, 1)
        os._exit(0)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        entries = {"model.w": Sharded.whole(src * 2)}
        after_alloc = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        staging.stage(entries)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - after_alloc
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
    assert staging.allocations == 1 and torch.equal(entries["model.w"].pieces[0].tensor, src * 2)
    assert faults < 256, (faults, after_alloc - before)  # not one per page (1024)


def _checkpointer(root, async_save):
    from megatronish.checkpoint.manager import Checkpointer
    from megatronish.model.build import build_model_chunks
    from megatronish.optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
    from megatronish.optim.optimizer import build_optimizer
    from megatronish.parallel import groups

    argv = ARGS + ["--save", root] + (["--async-save"] if async_save else [])
    cfg = configs_from_args(parse_args(argv), 1)
    groups.destroy_model_parallel()
    ctx = groups.initialize_model_parallel(cfg.parallel)
    models = build_model_chunks(cfg.model, ctx)
    for m in models:
        m.init_parameters(cfg.train.seed)
    params = [p for m in models for p in m.parameters()]
    opt = build_optimizer([(n, p) for m in models for n, p in m.named_parameters()], "adam", 1e-3, 0.01)
    sched = OptimizerParamScheduler(opt, **scheduler_steps_from_config(cfg))
    return Checkpointer(cfg, models, opt, sched, parallel=ctx), opt, params


def _step(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _model_tensors(iter_dir):
    md = dcp_io.read_index(iter_dir)
    return {k: dcp_io.read_tensor(iter_dir, md, k) for k in md.state_dict_metadata
            if k.startswith(("model.", "optimizer."))}


def _tensor_items(iter_dir):
    """The stored bytes (a ``torch.save`` archive each) of every tensor item."""
    md = dcp_io.read_index(iter_dir)
    return {(i.fqn, tuple(i.offset)): dcp_io.read_range(iter_dir, info, i.fqn)[0]
            for i, info in md.storage_data.items() if i.offset is not None}


def _async_worker(rank, world, root):
    from megatronish.checkpoint import manager
    from megatronish.training.pretrain import TrainState

    manager._log = lambda msg: None
    ck, opt, params = _checkpointer(os.path.join(root, "async"), True)
    snapshots, out = {}, {}
    ck.reserve_staging()  # what set-up does with --async-save
    out["allocations_reserved"] = ck._staging.allocations
    run_copies = DeferredCopies.run
    for it in (1, 2):
        _step(opt, params, it)
        snapshots[it] = [p.detach().clone() for p in params]
        go, copied = threading.Event(), []
        if it == 2:  # copies held back: save returns without them, the loop's wait_for_snapshot waits for them
            DeferredCopies.run = lambda self: (go.wait(30), run_copies(self), copied.append(True))
        ck.save(TrainState(iteration=it))
        out[f"copied_when_save_returned_{it}"] = list(copied)
        buffers = {k: v.data_ptr() for k, v in ck._staging.buffers.items()}
        out[f"allocations_{it}"] = ck._staging.allocations
        out[f"buffers_{it}"] = buffers
        threading.Timer(0.2, go.set).start()
        ck.wait_for_snapshot()  # what the training loop does before its next update
        out[f"copied_after_wait_{it}"] = list(copied)
        DeferredCopies.run = run_copies
        _step(opt, params, 100 + it)  # the model moves on while the write runs
        ck.wait()

    # a save while the previous one is still writing: it waits; the buffers are not touched during the write
    release, order = threading.Event(), []
    write = ck._write

    def slow_write(entries, iter_dir, iteration):
        staged = {k: [p.tensor.clone() for p in e.pieces] for k, e in entries.items() if isinstance(e, Sharded)}
        release.wait(30)
        out["unchanged_during_write"] = all(torch.equal(a, p.tensor) for k, e in entries.items()
                                            if isinstance(e, Sharded) for a, p in zip(staged[k], e.pieces))
        order.append(f"write {iteration} done")
        write(entries, iter_dir, iteration)

    ck._write = slow_write
    _step(opt, params, 3)
    snapshots[3] = [p.detach().clone() for p in params]
    ck.save(TrainState(iteration=3))
    ck.wait_for_snapshot()
    _step(opt, params, 4)
    snapshots[4] = [p.detach().clone() for p in params]
    threading.Timer(0.3, release.set).start()
    ck.save(TrainState(iteration=4))  # waits for iteration 3's write
    order.append("save 4 returned")
    ck.finish(TrainState(iteration=4))
    out["order"] = order
    out["allocations_end"] = ck._staging.allocations
    names = [n for n, _ in ck.named]
    out["params_match"] = {it: all(torch.equal(t, _model_tensors(os.path.join(root, "async", f"iter_{it:07d}"))
                                               ["model." + n]) for n, t in zip(names, snapshots[it]))
                           for it in (1, 2, 3, 4)}
    # the same state saved synchronously: every tensor item has the same bytes
    async_dir, sync_dir = os.path.join(root, "async_iter_4"), os.path.join(root, "async", "iter_0000004")
    os.rename(sync_dir, async_dir)
    ck.ck, ck._on_disk = dataclasses.replace(ck.ck, async_save=False), None
    ck.save(TrainState(iteration=4))
    out["same_tensor_bytes"] = _tensor_items(async_dir) == _tensor_items(sync_dir)
    return out


def test_async_saves_reuse_staging_and_write_each_moment(tmp_path):
    out = run_distributed(_async_worker, 1, str(tmp_path))[0]
    assert out["allocations_reserved"] > 0
    assert out["allocations_1"] == out["allocations_2"] == out["allocations_end"] == out["allocations_reserved"]
    assert out["buffers_2"] == out["buffers_1"]  # the same memory, save after save
    assert out["params_match"] == {1: True, 2: True, 3: True, 4: True}
    # the save call returns before the model and optimizer copies; the loop's wait covers them
    assert out["copied_when_save_returned_2"] == [] and out["copied_after_wait_2"] == [True]
    assert out["order"][0] == "write 3 done" and "save 4 returned" in out["order"]
    assert out["unchanged_during_write"] is True
    assert out["same_tensor_bytes"] is True
