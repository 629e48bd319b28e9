"""tensor_archive.write against torch.save: the same bytes for every dtype and shape it takes, torch.save's own
path (False, nothing written) wherever it cannot reproduce them, and DCP-identical shard files either way."""
import io
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from megatronish.checkpoint import dcp_io, tensor_archive
from megatronish.checkpoint.dcp_io import Piece, Sharded


class _Sink:
    def __init__(self):
        self.data = bytearray()
        self.writes = []

    def write(self, b):
        view = memoryview(b).cast("B")
        self.writes.append(view)
        self.data += view
        return len(view)


def _torch_save(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "fp32 2-D, 2 MB": torch.randn(1000, 513, generator=g),
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "fp16 3-D": torch.randn(2, 3, 5, generator=g).half(),
        "fp8 e4m3": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "int64": torch.arange(12).reshape(3, 4),
        "int32 long": torch.arange(100_001, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]),
        "0-dim": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "odd length": torch.arange(77, dtype=torch.uint8),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_same_bytes_as_torch_save(name):
    t = _tensors()[name]
    sink = _Sink()
    assert tensor_archive.write(sink, t)
    assert bytes(sink.data) == _torch_save(t)
    assert torch.equal(torch.load(io.BytesIO(bytes(sink.data)), weights_only=True), t)
    if t.numel() * t.element_size() >= 1 << 16:  # the data goes out as one view of the tensor's memory
        ptr = t.untyped_storage().data_ptr()
        assert any(len(w) == t.numel() * t.element_size() and
                   torch.frombuffer(w, dtype=torch.uint8).data_ptr() == ptr for w in sink.writes)


def test_tensors_that_do_not_fill_their_storage_are_left_to_torch_save():
    base = torch.randn(10, 8)
    for view in (base[2:5], base[:, :3], base.t()):
        sink = _Sink()
        assert not tensor_archive.write(sink, view)
        assert not sink.data


def test_a_format_it_does_not_reproduce_turns_it_off(monkeypatch):
    """Another PyTorch's zip layout (here: torch.save's bytes differ from ours in one byte) is noticed on the probes
    and write() returns False (the shard writer then uses torch.save: see the last test)."""
    real = tensor_archive._reference

    def changed(t):
        raw = bytearray(real(t))
        raw[-1] ^= 1
        return bytes(raw)

    monkeypatch.setattr(tensor_archive, "_FORMATS", {})
    monkeypatch.setattr(tensor_archive, "_reference", changed)
    assert not tensor_archive.write(_Sink(), torch.ones(3))


def test_crc_off_and_zip64_sizes_are_left_to_torch_save(monkeypatch):
    config = pytest.importorskip("torch.utils.serialization").config
    monkeypatch.setattr(config.save, "compute_crc32", False)
    monkeypatch.setattr(tensor_archive, "_FORMATS", {})
    assert not tensor_archive.write(_Sink(), torch.ones(3))
    monkeypatch.undo()
    monkeypatch.setattr(tensor_archive, "_LIMIT", 1000)  # as if 1000 bytes needed zip64 sizes
    assert not tensor_archive.write(_Sink(), torch.ones(300))
    assert tensor_archive.write(_Sink(), torch.ones(30))


def _state():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 1000, generator=g)
    return {"model.big": Sharded.whole(big), "model.bf16": Sharded.whole(torch.randn(64, 48, generator=g).bfloat16()),
            "model.empty": Sharded.whole(torch.zeros(0, 5)), "model.view": Sharded.whole(big[10:20, :3]),
            "model.row": Sharded((6, 4), [Piece(torch.randn(3, 4, generator=g), (3, 0))])}


def _stock(state, path):
    plain = {k: v.pieces[0].tensor.contiguous() for k, v in state.items() if k != "model.row"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**plain, "model.row": state["model.row"]},
                 storage_writer=FileSystemWriter(path, single_file_per_rank=True, thread_count=1),
                 planner=dcp_io.SavePlanner(), no_dist=True)
    with open(os.path.join(path, "__0_0.distcp"), "rb") as f:
        return f.read()


def test_shard_files_without_torch_save(tmp_path, monkeypatch):
    """Every tensor of a shard file is written by tensor_archive (torch.save is not called at all) and the file is
    DCP's byte for byte; with the archive writer off, the same bytes come from torch.save."""
    state = _state()
    want = _stock(state, str(tmp_path / "stock"))
    assert tensor_archive._format() is not None
    with monkeypatch.context() as m:
        m.setattr(torch, "save", lambda *a, **k: pytest.fail("torch.save called"))
        dcp_io.save(state, str(tmp_path / "ours"), no_dist=True)
    with open(tmp_path / "ours" / "__0_0.distcp", "rb") as f:
        assert f.read() == want
    assert dcp_io.read_index(str(tmp_path / "ours")).storage_data == \
        dcp_io.read_index(str(tmp_path / "stock")).storage_data
    monkeypatch.setattr(tensor_archive, "write", lambda out, t: False)
    dcp_io.save(state, str(tmp_path / "fallback"), no_dist=True)
    with open(tmp_path / "fallback" / "__0_0.distcp", "rb") as f:
        assert f.read() == want
