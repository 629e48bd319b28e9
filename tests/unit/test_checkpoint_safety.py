"""Checkpoints cannot run code when loaded, and damaged tensor data never loads silently.

- The package unpickles only through allow-listed loaders: a scan of every module finds no other
  ``pickle.load(s)``, ``Unpickler``, ``torch.load`` without ``weights_only=True`` or ``numpy.load`` without
  ``allow_pickle=False``.
- For each pickle a checkpoint holds (DCP's ``.metadata`` index, a tensor item's ``data.pkl``, Megatron's
  ``common.pt`` / legacy files), a crafted file whose unpickling would create a file fails with one line naming
  the file, and the file is not created.
- A bit flipped at 1,000 offsets spread over a checkpoint's tensor data (derandomized): every load fails with one
  line naming the shard file and the item; with ``verify=False`` the same load passes.
"""
import ast
import io
import pathlib
import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatronish.checkpoint import dcp_io
from megatronish.checkpoint.dcp_io import CheckpointError, Piece, Sharded
from megatronish.checkpoint.megatron_pickle import safe_load

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatronish"
# the one module that unpickles with its own allow-list (DCP's index), and the one that runs torch's weights-only
# unpickler directly (a stored chunk's data.pkl onto the meta device)
SAFE_UNPICKLERS = {"checkpoint/dcp_io/index.py", "checkpoint/dcp_io/archive.py"}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node.func.attr, node
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if isinstance(base, ast.Attribute) and base.attr == "Unpickler":
                    yield "class", "Unpickler", node


def _kw(node, name):
    return next((k.value for k in getattr(node, "keywords", []) if k.arg == name), None)


def test_no_unpickling_outside_the_allow_list():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for owner, attr, node in _calls(ast.parse(path.read_text())):
            bad = (owner == "pickle" and attr in ("load", "loads", "Unpickler")) or attr == "Unpickler" \
                or (owner == "torch" and attr == "load"
                    and not (isinstance(_kw(node, "weights_only"), ast.Constant) and _kw(node, "weights_only").value
                             is True)) \
                or (owner in ("numpy", "np") and attr == "load"
                    and not (isinstance(_kw(node, "allow_pickle"), ast.Constant)
                             and _kw(node, "allow_pickle").value is False))
            if bad and rel not in SAFE_UNPICKLERS:
                found.append(f"{rel}:{node.lineno} {owner}.{attr}")
    assert not found, "unpickling outside the allow-listed loaders: " + ", ".join(found)


class _Bomb:
    """Unpickling it creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _one_line(err, *names):
    text = str(err.value)
    assert "\n" not in text and all(n in text for n in names), text


def _checkpoint(d, shapes=((64, 48), (33,), (16, 8))):
    state = {f"model.w{i}": Sharded(s, [Piece(torch.randn(s, generator=torch.Generator().manual_seed(i)),
                                              (0,) * len(s))]) for i, s in enumerate(shapes)}
    dcp_io.save(state, str(d), no_dist=True)
    return state


def _targets(state):
    return {k: Sharded(v.global_shape, [Piece(torch.zeros_like(v.pieces[0].tensor), v.pieces[0].offsets)])
            for k, v in state.items()}


def test_crafted_index_runs_no_code(tmp_path):
    marker = tmp_path / "ran"
    _checkpoint(tmp_path / "ck")
    index = tmp_path / "ck" / ".metadata"
    index.write_bytes(pickle.dumps(_Bomb(marker)))
    with pytest.raises(CheckpointError) as e:
        dcp_io.read_index(str(tmp_path / "ck"))
    _one_line(e, str(index))
    assert not marker.exists()


@pytest.mark.parametrize("verify", [True, False])
def test_crafted_tensor_item_runs_no_code(tmp_path, verify):
    """The shard's first tensor item replaced by a torch.save archive of the bomb (index offsets rewritten)."""
    marker = tmp_path / "ran"
    d = tmp_path / "ck"
    state = _checkpoint(d, ((8, 4),))
    md = dcp_io.read_index(str(d))
    key = MetadataIndex("model.w0", (0, 0))
    buf = io.BytesIO()
    torch.save(_Bomb(marker), buf)
    evil = buf.getvalue()
    shard = d / md.storage_data[key].relative_path
    raw = shard.read_bytes()
    info = md.storage_data[key]
    shard.write_bytes(raw[:info.offset] + evil + raw[info.offset + info.length:])
    info.length = len(evil)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError) as e:
        dcp_io.load(_targets(state), str(d), no_dist=True, verify=verify)
    _one_line(e, str(shard))
    with pytest.raises(CheckpointError) as e:
        dcp_io.read_tensor(str(d), dcp_io.read_index(str(d)), "model.w0", verify=verify)
    _one_line(e, str(shard), "model.w0")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["common.pt", "mp_rank_00/model_optim_rng.pt"])
def test_crafted_megatron_pickle_runs_no_code(tmp_path, name):
    marker = tmp_path / "ran"
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": _Bomb(marker), "iteration": 3}, str(path))
    with pytest.raises(CheckpointError) as e:
        safe_load(str(path), str(path))
    _one_line(e, str(path))
    assert not marker.exists()


def _data_regions(d, state):
    """``(shard path, item name, start, end)`` of every tensor's data bytes in its shard file."""
    md = dcp_io.read_index(str(d))
    out = []
    for key, entry in state.items():
        idx = MetadataIndex(key, entry.pieces[0].offsets)
        info = md.storage_data[idx]
        shard = d / info.relative_path
        raw = shard.read_bytes()[info.offset:info.offset + info.length]
        data = entry.pieces[0].tensor.numpy().tobytes()
        start = raw.find(data)
        assert start > 0
        out.append((str(shard), dcp_io.item_name(idx), info.offset + start, info.offset + start + len(data)))
    return out


def _locate(regions, pick):
    """The shard, item and file offset of the ``pick``-th data byte of all items together."""
    for path, item, start, end in regions:
        if pick < end - start:
            return path, item, start + pick
        pick -= end - start
    raise IndexError(pick)


def test_a_flipped_bit_anywhere_in_the_tensor_data_fails_the_load(tmp_path):
    d = tmp_path / "ck"
    state = _checkpoint(d)
    regions = _data_regions(d, state)
    total = sum(end - start for _, _, start, end in regions)
    rng = random.Random(1234)
    picks = sorted(rng.randrange(total) for _ in range(1000))  # spread over all items' data
    target = _targets(state)
    for n, pick in enumerate(picks):
        path, item, offset = _locate(regions, pick)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << (n % 8))]))
            f.flush()
            with pytest.raises(CheckpointError) as e:
                dcp_io.load(target, str(d), no_dist=True)
            _one_line(e, path, item, "CRC-32")
            if n % 100 == 0:  # the offline reader checks too, and the check is what refuses it
                with pytest.raises(CheckpointError) as e:
                    dcp_io.read_tensor(str(d), dcp_io.read_index(str(d)), item.split(" at ")[0])
                _one_line(e, path, item)
                dcp_io.load(target, str(d), no_dist=True, verify=False)
            f.seek(offset)
            f.write(bytes([byte]))
    dcp_io.load(target, str(d), no_dist=True)
    assert all(torch.equal(target[k].pieces[0].tensor, state[k].pieces[0].tensor) for k in state)


def test_inspect_verify_names_each_damaged_item(tmp_path, capsys):
    from megatronish.tools.inspect_checkpoint import main

    d = tmp_path / "ck"
    state = _checkpoint(d)
    from megatronish.checkpoint.offline import write_checkpoint

    write_checkpoint(str(tmp_path / "full"), 3, {"w": state["model.w0"].pieces[0].tensor}, {"model": {}})
    full = tmp_path / "full"
    assert main([str(full), "--verify"]) == 0
    assert "no damage found" in capsys.readouterr().out
    iter_dir = next(p for p in full.iterdir() if p.is_dir())
    [(path, item, start, _)] = _data_regions(iter_dir, {"model.w": state["model.w0"]})
    with open(path, "r+b") as f:
        f.seek(start + 7)
        f.write(b"\x00\x01")
    assert main([str(full), "--verify"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and path in err[0] and item in err[0], err
