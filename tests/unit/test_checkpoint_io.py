"""The checkpoint storage layer against DCP's own: the same bytes on disk, bit-exact round trips, and reads of
any block (row blocks read in place, column blocks and odd layouts through torch.load)."""
import errno
import fcntl
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from megatronish.checkpoint import dcp_io
from megatronish.checkpoint.dcp_io import Obj, Piece, Sharded, api, buffers


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 1000, generator=g)  # 1.2 MB: written straight from the tensor's memory
    return {
        "model.big": Sharded.whole(big),
        "model.bf16": Sharded.whole(torch.randn(64, 48, generator=g).to(torch.bfloat16)),
        "model.vec": Sharded.whole(torch.randn(7, generator=g)),
        "model.int": Sharded.whole(torch.arange(12, dtype=torch.int64).reshape(3, 4)),
        "model.empty": Sharded.whole(torch.zeros(0, 5)),
        "model.view": Sharded.whole(big[10:20, :3]),  # a non-contiguous view of a larger storage
        "common_state": Obj({"iteration": 3, "t": torch.arange(4)}),
    }


def _plain(state):
    """The same entries as plain tensors / bytes for DCP's stock writer and reader."""
    return {k: v.pieces[0].tensor.contiguous() if isinstance(v, Sharded) else v for k, v in state.items()}


def _save_stock(state, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True, thread_count=1),
                 planner=dcp_io.SavePlanner(), no_dist=True)


def _empty_like(state):
    return {k: Sharded.whole(torch.full_like(v.pieces[0].tensor.contiguous(), 7)) if isinstance(v, Sharded) else Obj()
            for k, v in state.items()}


def _is_direct(fd):
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


@pytest.fixture(params=["direct", "page-cache", "direct-small-blocks"])
def write_mode(request, monkeypatch):
    """The file writer's paths: O_DIRECT out of aligned blocks (the default where the file system takes it; with
    8 KiB blocks every tensor spans many, and the last block has an unaligned tail), and page-cache writes."""
    opened = []
    real_open = buffers.open_direct
    monkeypatch.setattr(buffers, "open_direct", lambda path: opened.append(real_open(path)) or opened[-1])
    yield {"direct": {}, "page-cache": {"direct_io": False},
           "direct-small-blocks": {"pool": dcp_io.BouncePool(block=8192)}}[request.param]  # dcp_io.save's keywords
    if request.param != "page-cache" and getattr(os, "O_DIRECT", 0):
        assert opened and all(fd is not None for fd in opened), "O_DIRECT refused here: the direct path is untested"


def test_same_bytes_as_dcp_writer(tmp_path, write_mode):
    state = _state()
    dcp_io.save(state, str(tmp_path / "ours"), no_dist=True, **write_mode)
    _save_stock(state, str(tmp_path / "stock"))
    ours = sorted(f for f in os.listdir(tmp_path / "ours") if f.endswith(".distcp"))
    assert ours == sorted(f for f in os.listdir(tmp_path / "stock") if f.endswith(".distcp")) == ["__0_0.distcp"]
    with open(tmp_path / "ours" / ours[0], "rb") as a, open(tmp_path / "stock" / ours[0], "rb") as b:
        assert a.read() == b.read()
    md_ours, md_stock = dcp_io.read_index(str(tmp_path / "ours")), dcp_io.read_index(str(tmp_path / "stock"))
    assert md_ours.storage_data == md_stock.storage_data


def test_round_trip_bit_exact_and_stock_readable(tmp_path, write_mode):
    state = _state(1)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True, **write_mode)
    target = _empty_like(state)
    objects = dcp_io.load(target, path, no_dist=True)
    for k, v in state.items():
        if isinstance(v, Sharded):
            want, got = v.pieces[0].tensor, target[k].pieces[0].tensor
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.numel() else got,
                                                           want.contiguous().view(torch.uint8) if want.numel()
                                                           else want), k
    assert objects["common_state"]["iteration"] == 3 and torch.equal(objects["common_state"]["t"], torch.arange(4))
    # DCP's own reader loads what we wrote
    plain = {k: torch.zeros_like(v) for k, v in _plain(state).items() if isinstance(v, torch.Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(plain, storage_reader=FileSystemReader(path), no_dist=True)
    for k, v in plain.items():
        assert torch.equal(v, state[k].pieces[0].tensor.contiguous()), k


def test_load_with_the_callers_index_reads_it_once(tmp_path, monkeypatch):
    state = _state(2)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True)
    md = dcp_io.read_index(path)
    dcp_io.check_files(path, md)
    reads = []
    monkeypatch.setattr(dcp_io.reader, "read_index", lambda *a: reads.append(a) or pytest.fail("index read again"))
    target, plain = _empty_like(state), _empty_like(state)
    dcp_io.load(target, path, no_dist=True, index=md)
    monkeypatch.undo()
    dcp_io.load(plain, path, no_dist=True)  # reads the index itself
    assert not reads
    for k, v in state.items():
        if isinstance(v, Sharded):
            assert torch.equal(target[k].pieces[0].tensor, v.pieces[0].tensor.contiguous()), k
            assert torch.equal(target[k].pieces[0].tensor, plain[k].pieces[0].tensor), k


@pytest.mark.parametrize("rows,cols", [((0, 300), (0, 1000)), ((40, 90), (0, 1000)), ((0, 300), (100, 350)),
                                       ((7, 8), (500, 1000)), ((13, 14), (0, 1000))])
def test_block_reads(tmp_path, rows, cols):
    """A piece of another layout: row blocks are read in place, column blocks through the general path."""
    state = _state(2)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True)
    full = state["model.big"].pieces[0].tensor
    block = torch.full((rows[1] - rows[0], cols[1] - cols[0]), -1.0)
    alias = torch.empty_like(block)
    target = {"model.big": Sharded((300, 1000), [Piece(block, (rows[0], cols[0]), [alias])])}
    dcp_io.load(target, path, no_dist=True)
    assert torch.equal(block, full[rows[0]:rows[1], cols[0]:cols[1]])
    assert torch.equal(alias, block)


def test_split_pieces_from_two_stored_chunks(tmp_path):
    """Two stored row chunks read into one piece that straddles them (two reads into one destination)."""
    full = torch.randn(10, 6)
    stored = {"model.w": Sharded((10, 6), [Piece(full[:4].clone(), (0, 0)), Piece(full[4:].clone(), (4, 0))])}
    path = str(tmp_path / "ck")
    dcp_io.save(stored, path, no_dist=True)
    piece = torch.zeros(6, 6)
    dcp_io.load({"model.w": Sharded((10, 6), [Piece(piece, (2, 0))])}, path, no_dist=True)
    assert torch.equal(piece, full[2:8])


def test_failed_write_raises_and_closes(tmp_path, monkeypatch, write_mode):
    path = str(tmp_path / "ck")
    calls = []

    def failing_write(fd, data, offset):
        calls.append(len(data))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", failing_write)
    with pytest.raises(dcp_io.CheckpointError, match="No space left on device"):
        dcp_io.save(_state(), path, no_dist=True, **write_mode)
    assert calls and not os.path.exists(os.path.join(path, dcp_io.METADATA_FILE))
    # the blocks went back to the pool, and the next save works
    monkeypatch.undo()
    dcp_io.save(_state(), path, no_dist=True, **write_mode)
    assert os.path.exists(os.path.join(path, dcp_io.METADATA_FILE))


def test_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT but refuses the writes (EINVAL) after the first block: the rest of
    the file goes through the page cache, and the bytes are still DCP's."""
    real = os.pwrite
    direct = []

    def pwrite(fd, data, offset):
        if _is_direct(fd):
            direct.append(offset)
            if len(direct) > 1:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    state = _state()
    dcp_io.save(state, str(tmp_path / "ours"), no_dist=True, pool=dcp_io.BouncePool(block=8192))
    _save_stock(state, str(tmp_path / "stock"))
    if getattr(os, "O_DIRECT", 0):
        assert direct[:2] == [0, 8192]
    with open(tmp_path / "ours" / "__0_0.distcp", "rb") as a, open(tmp_path / "stock" / "__0_0.distcp", "rb") as b:
        assert a.read() == b.read()


def test_whole_chunks_and_row_blocks_skip_torch_load(tmp_path, monkeypatch):
    """Same-layout loads and row blocks never build a temporary tensor (torch.load is not called)."""
    state = _state(3)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True)

    def no_load(*a, **k):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_load)
    target = _empty_like(state)
    dcp_io.load(target, path, no_dist=True)
    assert torch.equal(target["model.big"].pieces[0].tensor, state["model.big"].pieces[0].tensor)
    rows = torch.zeros(50, 1000)
    dcp_io.load({"model.big": Sharded((300, 1000), [Piece(rows, (100, 0))])}, path, no_dist=True)
    assert torch.equal(rows, state["model.big"].pieces[0].tensor[100:150])


def _two_rank_worker(rank, world, root):
    """Each rank saves its row block (collective save), then loads the other rank's block (each rank plans and
    reads alone), then one rank asks for a tensor of the wrong shape: both ranks raise its error."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(3, 5, generator=g)
    dcp_io.save({"model.w": Sharded((6, 5), [Piece(mine, (3 * rank, 0))]),
                 f"rng.{rank}": Obj({"rank": rank})}, root, process_group=dist.group.WORLD)
    other = torch.zeros(3, 5)
    objects = dcp_io.load({"model.w": Sharded((6, 5), [Piece(other, (3 * (1 - rank), 0))]),
                           f"rng.{1 - rank}": Obj()}, root, process_group=dist.group.WORLD)
    shape = (6, 5) if rank == 0 else (6, 4)
    try:
        dcp_io.load({"model.w": Sharded(shape, [Piece(torch.zeros(3, shape[1]), (0, 0))])}, root,
                    process_group=dist.group.WORLD)
        error = None
    except dcp_io.CheckpointError as e:
        error = str(e)
    return mine.tolist(), other.tolist(), objects[f"rng.{1 - rank}"], error


def test_ranks_load_alone_and_fail_together(tmp_path):
    from megatronish.testing import run_distributed

    (m0, o0, r0, e0), (m1, o1, r1, e1) = run_distributed(_two_rank_worker, 2, str(tmp_path / "ck"))
    assert o0 == m1 and o1 == m0
    assert r0 == {"rank": 1} and r1 == {"rank": 0}
    assert e0 == e1 and "global shape [6, 5], this run's model needs [6, 4]" in e0


def test_dcp_debug_records_skipped_only_where_discarded(monkeypatch):
    import io
    import logging

    from torch.distributed.checkpoint import logger as dcp_logger

    def fresh(handler):
        lg = logging.Logger("dcp-test", logging.DEBUG)
        lg.propagate = False
        lg.addHandler(handler)
        monkeypatch.setattr(dcp_logger, "_dcp_logger", lg)
        return lg

    discarded = fresh(logging.NullHandler())
    api.skip_discarded_dcp_records()
    assert discarded.level == logging.INFO
    seen = io.StringIO()
    watched = fresh(logging.StreamHandler(seen))
    api.skip_discarded_dcp_records()
    assert watched.level == logging.DEBUG  # someone reads these records: they stay
    watched.debug("kept")
    assert "kept" in seen.getvalue()


def test_reads_start_with_one_willneed_per_run_of_adjacent_items(tmp_path, monkeypatch):
    """Before the first read the reader asks the kernel for every byte range it is about to read (within its
    read-ahead window), one ``POSIX_FADV_WILLNEED`` per run of adjacent stored items, so the disk works ahead of the
    copies and the per-item bookkeeping. The empty tensor is not read, which splits the file's items into two
    runs."""
    state = _state(3)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True)
    md = dcp_io.read_index(path)
    advice = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: (advice.append((off, n, how)),
                                                                         real(fd, off, n, how))[1])
    target = _empty_like(state)
    dcp_io.load(target, path, no_dist=True, index=md)
    info = {k.fqn: i for k, i in md.storage_data.items()}
    assert [k for k, _ in sorted(info.items(), key=lambda x: x[1].offset)][-2:] == ["model.empty", "model.view"]
    assert advice == [(0, info["model.empty"].offset, os.POSIX_FADV_WILLNEED),
                      (info["model.view"].offset, info["model.view"].length, os.POSIX_FADV_WILLNEED)]
    for k, v in state.items():
        if isinstance(v, Sharded):
            assert torch.equal(target[k].pieces[0].tensor, v.pieces[0].tensor.contiguous()), k


def test_read_ahead_merges_adjacent_ranges_and_stays_a_window_ahead(monkeypatch):
    """Runs of adjacent ranges are asked for in pieces of at most a window, only as far as a window beyond the
    reads, and never with length 0 (for ``posix_fadvise`` "to the end of the file")."""
    class Info:
        def __init__(self, offset, length):
            self.offset, self.length = offset, length

    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: calls.append((off, n)))
    ahead = dcp_io.reader.ReadAhead(-1, [Info(0, 10), Info(10, 5), Info(12, 1), Info(40, 8), Info(100, 0)], window=6)
    assert calls == [(0, 6)]  # the first run's first piece: the second starts a window beyond offset 0
    ahead.advance(4)
    assert calls[1:] == [(6, 6)]  # starts within 6 of 4; (12, 3) does not
    ahead.advance(7)
    assert calls[2:] == [(12, 3)]
    ahead.advance(30)
    assert calls[3:] == []  # 40 is not within 6 of 30
    ahead.advance(36)
    assert calls[3:] == [(40, 6)]
    ahead.advance(41)
    assert calls[4:] == [(46, 2)]
    ahead.advance(100)
    assert len(calls) == 5  # nothing for the empty range


def test_read_ahead_of_the_own_shard_asks_for_the_wanted_records(tmp_path, monkeypatch):
    """``read_ahead_own_shard`` asks for the records of the wanted entries in ``__{rank}_0.distcp`` (runs of
    adjacent records merged), nothing for a rank whose file the index does not name."""
    state = _state(5)
    path = str(tmp_path / "ck")
    dcp_io.save(state, path, no_dist=True)
    md = dcp_io.read_index(path)
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: calls.append((off, n, how)))
    wanted = {"model.big", "model.bf16", "model.view"}
    asked = dcp_io.read_ahead_own_shard(path, md, 0, lambda name: name in wanted)
    ranges = sorted((i.offset, i.length) for k, i in md.storage_data.items() if k.fqn in wanted)
    runs = []
    for off, n in ranges:
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((off, n))
    assert calls == [(off, n, os.POSIX_FADV_WILLNEED) for off, n in runs] and len(runs) >= 2
    assert asked == sum(n for _, n in ranges)
    calls.clear()
    assert dcp_io.read_ahead_own_shard(path, md, 1, lambda name: True) == 0  # no __1_0.distcp in this checkpoint
    assert dcp_io.read_ahead_own_shard(path, md, 0, lambda name: False) == 0
    assert calls == []


def test_loads_and_saves_pause_the_garbage_collector(tmp_path, monkeypatch):
    """A save or load runs with Python's automatic collection off on the main thread (restored afterwards; left
    alone where it is already off, and on other threads)."""
    import gc
    import threading

    seen = []
    read_data, write_data = dcp_io.Reader.read_data, dcp_io.Writer.write_data
    monkeypatch.setattr(dcp_io.Reader, "read_data", lambda *a: (seen.append(gc.isenabled()), read_data(*a))[1])
    monkeypatch.setattr(dcp_io.Writer, "write_data", lambda *a: (seen.append(gc.isenabled()), write_data(*a))[1])
    state = _state(4)
    path = str(tmp_path / "ck")
    assert gc.isenabled()
    dcp_io.save(state, path, no_dist=True)
    dcp_io.load(_empty_like(state), path, no_dist=True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        with dcp_io.gc_paused():
            pass
        assert not gc.isenabled()  # already off (--manual-gc): left off
    finally:
        gc.enable()
    inside = []

    def on_a_thread():
        with dcp_io.gc_paused():
            inside.append(gc.isenabled())

    worker = threading.Thread(target=on_a_thread)
    worker.start()
    worker.join()
    assert inside == [True] and gc.isenabled()


def test_write_fault_stops_the_named_directory_half_way(tmp_path):
    """The test hook: a :class:`WriteFault` for one directory fails that save half-way (ENOSPC) and no other."""
    fault = dcp_io.WriteFault("enospc", "ck")
    with pytest.raises(dcp_io.CheckpointError, match="No space left on device"):
        dcp_io.save(_state(), str(tmp_path / "ck"), no_dist=True, fault=fault)
    assert not os.path.exists(tmp_path / "ck" / dcp_io.METADATA_FILE)
    dcp_io.save(_state(), str(tmp_path / "other"), no_dist=True, fault=fault)
    assert os.path.exists(tmp_path / "other" / dcp_io.METADATA_FILE)
    assert not dcp_io.WriteFault("enospc", "ck", rank=1).applies(str(tmp_path / "ck"), 0)
