"""Checkpoint storage without processes: exact JSON state, tensor-parallel pieces, resharding through DCP's
chunk overlap (strided splits, padded vocabulary), the offline API, and one clear error per damaged checkpoint."""
import functools
import os
import pickle
import random
import weakref

import numpy as np
import pytest
import torch

from megatronish.checkpoint import dcp_io, layout
from megatronish.checkpoint.dcp_io import CheckpointError, Obj, Sharded
from megatronish.checkpoint.offline import iter_model_tensors, read_checkpoint_meta, write_checkpoint
from megatronish.checkpoint.state import tp_pieces
from megatronish.parallel.init import TensorDesc, split_global

MODEL_CFG = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 97}


# ------------------------------------------------------------------ JSON state is exact
def test_json_state_roundtrip_is_exact():
    random.seed(3)
    np.random.seed(5)
    value = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "bf16": torch.randn(3, 2).to(torch.bfloat16), "scalar": torch.tensor(2.5), "empty": torch.zeros(0),
             "int_keys": {1: "a", 2: (3, 4.5)}, "nan": float("inf"), "nested": [None, True, b"\x00\x01"]}
    back = dcp_io.loads(dcp_io.dumps(value), "test")
    assert back["python"] == value["python"]
    for a, b in zip(back["numpy"], value["numpy"]):
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
    for k in ("torch", "bf16", "scalar", "empty"):
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k])
    assert back["int_keys"] == value["int_keys"] and back["nan"] == value["nan"] and back["nested"] == value["nested"]
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert random.random() == (random.seed(3), random.random())[1]


# ------------------------------------------------------------------ pieces = the rank's slice, global offsets
@pytest.mark.parametrize("shape, dim, stride, tp", [((12, 4), 0, 1, 2), ((16, 4), 0, 2, 2), ((16, 4), 0, 2, 4),
                                                     ((4, 12), 1, 1, 3), ((24,), 0, 2, 3), ((6, 4), None, 1, 2)])
def test_tp_pieces_cover_the_rank_slice(shape, dim, stride, tp):
    full = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape)
    desc = TensorDesc(shape, dim, stride)
    seen = torch.zeros(shape)
    for rank in range(tp):
        local = split_global(desc, full, rank, tp)
        pieces = tp_pieces(local, desc, rank, tp)
        assert len(pieces) == (stride if dim is not None else 1)
        for p in pieces:
            region = full
            for d, (o, s) in enumerate(zip(p.offsets, p.tensor.shape)):
                region = region.narrow(d, o, s)
            assert torch.equal(p.tensor, region)
            view = seen
            for d, (o, s) in enumerate(zip(p.offsets, p.tensor.shape)):
                view = view.narrow(d, o, s)
            view += 1
    assert torch.all(seen == (1 if dim is not None else tp))


def _pieces_of(full, desc, tp):
    """Every rank's pieces of ``full`` (one process plays all ranks)."""
    out = []
    for r in range(tp):
        out += tp_pieces(split_global(desc, full, r, tp).clone(), desc, r, tp)
    return out


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 4), (4, 1), (1, 2)])
def test_reshard_strided_split(tmp_path, src_tp, dst_tp):
    """[gate; up] (stride 2) saved at one TP size loads at another, exactly."""
    desc = TensorDesc((16, 6), 0, 2)
    row = TensorDesc((6, 16), 1, 1)
    full, full_row = torch.randn(16, 6), torch.randn(6, 16)
    dcp_io.save({"fc1": Sharded((16, 6), _pieces_of(full, desc, src_tp)),
                 "fc2": Sharded((6, 16), _pieces_of(full_row, row, src_tp))}, str(tmp_path), no_dist=True)
    for r in range(dst_tp):
        want = split_global(desc, full, r, dst_tp)
        local = torch.zeros_like(want)
        want_row = split_global(row, full_row, r, dst_tp)
        local_row = torch.zeros_like(want_row)
        dcp_io.load({"fc1": Sharded((16, 6), tp_pieces(local, desc, r, dst_tp)),
                     "fc2": Sharded((6, 16), tp_pieces(local_row, row, r, dst_tp))}, str(tmp_path), no_dist=True)
        assert torch.equal(local, want) and torch.equal(local_row, want_row)


def test_padded_vocabulary_rows_resize(tmp_path):
    """Stored with 256 padded rows (TP 2); loads into 128 rows (TP 1) and 384 rows; padding rows are zero."""
    emb = torch.randn(256, 4)
    emb[97:] = 0
    dcp_io.save({"emb": Sharded.whole(emb)}, str(tmp_path), no_dist=True)
    for rows in (128, 384):
        t = torch.full((rows, 4), 7.0)
        dcp_io.load({"emb": Sharded.whole(t, resizable_rows=True)}, str(tmp_path), no_dist=True)
        assert torch.equal(t[:97], emb[:97]) and torch.all(t[97:] == 0)
    with pytest.raises(CheckpointError, match=r"'emb' has global shape \[256, 4\], this run's model needs \[128, 4\]"):
        dcp_io.load({"emb": Sharded.whole(torch.zeros(128, 4))}, str(tmp_path), no_dist=True)


def test_replicated_pieces_written_once(tmp_path):
    """The same (name, offset) from several ranks is stored once (DCP's dedup), via a 2-rank-style plan."""
    from torch.distributed.checkpoint.planner import SavePlan

    planner = dcp_io.SavePlanner()
    plans = []
    for _ in range(2):
        planner.set_up_planner({"w": Sharded.whole(torch.ones(3)), "x": Obj(1)}, is_coordinator=True)
        plans.append(planner.create_local_plan())
    deduped, md = planner.create_global_plan(plans)
    assert sum(len(p.items) for p in deduped) == 2 and isinstance(plans[0], SavePlan)
    assert list(md.state_dict_metadata["w"].size) == [3]


# ------------------------------------------------------------------ offline API
def test_offline_write_read_iterate(tmp_path):
    w = torch.randn(97, 8)
    tensors = {"embedding.word_embeddings.weight": w, "decoder.final_layernorm.weight": torch.ones(8),
               "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(32, 8).to(torch.bfloat16)}
    d = str(tmp_path / "ck")
    it_dir = write_checkpoint(d, 20, tensors, MODEL_CFG, consumed_train_samples=640)
    assert it_dir == os.path.join(d, "iter_0000020") and open(os.path.join(d, layout.TRACKER)).read() == "20"
    meta = read_checkpoint_meta(d)
    assert meta["iteration"] == 20 and meta["consumed_train_samples"] == 640 and not meta["release"]
    assert meta["config"]["model"]["hidden_size"] == 8
    assert meta["tensors"]["embedding.word_embeddings.weight"]["shape"] == (128, 8)  # padded to 128
    assert meta["tensors"]["decoder.layers.0.mlp.linear_fc1.weight"]["dtype"] == torch.bfloat16
    assert meta["code_version"]["megatronish"] and meta["optimizer_tensors"] == {}
    got = dict(iter_model_tensors(it_dir))
    assert list(got) == sorted(tensors)
    assert torch.equal(got["embedding.word_embeddings.weight"][:97], w)
    assert torch.all(got["embedding.word_embeddings.weight"][97:] == 0)
    assert torch.equal(got["decoder.layers.0.mlp.linear_fc1.weight"], tensors["decoder.layers.0.mlp.linear_fc1.weight"])
    names = ["decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    assert [n for n, _ in iter_model_tensors(d, names=names)] == names
    with pytest.raises(CheckpointError, match="no model tensor 'nope'"):
        list(iter_model_tensors(d, names=["nope"]))


def test_offline_release_and_iteration_dir(tmp_path):
    d = str(tmp_path / "ck")
    write_checkpoint(d, None, [("decoder.final_layernorm.weight", torch.ones(8))], {"model": MODEL_CFG})
    assert open(os.path.join(d, layout.TRACKER)).read() == "release"
    meta = read_checkpoint_meta(os.path.join(d, "release"))
    assert meta["release"] and meta["iteration"] == 0
    write_checkpoint(d, 5, {"decoder.final_layernorm.weight": torch.zeros(8)}, MODEL_CFG, update_tracker=False)
    assert open(os.path.join(d, layout.TRACKER)).read() == "release"
    assert read_checkpoint_meta(os.path.join(d, "iter_0000005"))["iteration"] == 5


def _tracked_source(n, shape=(64, 8)):
    """``n`` distinct tensors made on demand; ``peak[0]``: the most whose memory is alive at once (counted as
    each is made)."""
    alive, peak, made = [], [0], {}

    def make(i):
        arr = np.full(shape, float(i), dtype=np.float32)  # the tensor's memory: alive while any view of it is
        t = torch.from_numpy(arr)
        alive.append(weakref.ref(arr))
        peak[0] = max(peak[0], sum(r() is not None for r in alive))
        made[i] = t.clone()  # the reference data, not the tensor handed to the writer
        return t
    return make, peak, made


@pytest.mark.parametrize("form", ["factories", "generator_with_specs"])
def test_offline_write_streams_one_tensor_at_a_time(tmp_path, form):
    n = 12
    make, peak, made = _tracked_source(n)
    names = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(n)]
    if form == "factories":
        write_checkpoint(str(tmp_path), 3, [(nm, (64, 8), torch.float32, functools.partial(make, i))
                                            for i, nm in enumerate(names)], MODEL_CFG)
    else:
        write_checkpoint(str(tmp_path), 3, ((nm, make(i)) for i, nm in enumerate(names)), MODEL_CFG,
                         specs=[(nm, (64, 8), torch.float32) for nm in names])
    assert len(made) == n and peak[0] <= 2  # the tensor being written and at most the previous one
    got = dict(iter_model_tensors(str(tmp_path)))
    assert sorted(got) == sorted(names)
    for i, nm in enumerate(names):
        assert torch.equal(got[nm], made[i])


def test_offline_write_specs_order_padding_and_errors(tmp_path):
    from megatronish.convert.hf_config import ConvertError
    emb, ln = torch.randn(97, 8), torch.randn(8)
    specs = [("decoder.final_layernorm.weight", (8,), torch.float32), ("embedding.word_embeddings.weight", (97, 8),
                                                                         torch.float32)]
    # yielded in another order than the specs: still written correctly; vocabulary rows padded to 128
    write_checkpoint(str(tmp_path / "a"), 1, iter([("embedding.word_embeddings.weight", emb),
                                                   ("decoder.final_layernorm.weight", ln)]), MODEL_CFG, specs=specs)
    meta = read_checkpoint_meta(str(tmp_path / "a"))
    assert meta["tensors"]["embedding.word_embeddings.weight"]["shape"] == (128, 8)
    got = dict(iter_model_tensors(str(tmp_path / "a")))
    assert torch.equal(got["embedding.word_embeddings.weight"][:97], emb) and torch.equal(
        got["decoder.final_layernorm.weight"], ln) and torch.all(got["embedding.word_embeddings.weight"][97:] == 0)

    def failing():
        yield "decoder.final_layernorm.weight", ln
        raise ConvertError("source: missing tensor 'x'")
    with pytest.raises(ConvertError, match="missing tensor 'x'"):  # the source's own error, not wrapped
        write_checkpoint(str(tmp_path / "b"), 1, failing(), MODEL_CFG, specs=specs)
    assert not os.path.exists(os.path.join(tmp_path / "b", layout.TRACKER))
    with pytest.raises(CheckpointError, match=r"'decoder.final_layernorm.weight' came as \[8\] torch.float32; "
                                              r"its spec says \[8\] torch.bfloat16"):
        write_checkpoint(str(tmp_path / "c"), 1, [("decoder.final_layernorm.weight", ln)], MODEL_CFG,
                         specs=[("decoder.final_layernorm.weight", (8,), torch.bfloat16)])
    with pytest.raises(ValueError, match="'decoder.output_layer.weight': a tensor the specs do not list"):
        write_checkpoint(str(tmp_path / "d"), 1, [("decoder.final_layernorm.weight", ln),
                                                  ("decoder.output_layer.weight", ln)], MODEL_CFG, specs=specs[:1])


# ------------------------------------------------------------------ safety: one message each
@pytest.fixture
def ckpt(tmp_path):
    d = str(tmp_path / "ck")
    write_checkpoint(d, 7, {"decoder.final_layernorm.weight": torch.randn(1000)}, MODEL_CFG)
    return d


def _shard(d):
    it = os.path.join(d, "iter_0000007")
    return os.path.join(it, next(f for f in os.listdir(it) if f.endswith(".distcp")))


def test_truncated_shard(ckpt):
    path = _shard(ckpt)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=f"checkpoint shard {path} is truncated"):
        read_checkpoint_meta(ckpt)


def test_missing_shard(ckpt):
    path = _shard(ckpt)
    os.remove(path)
    with pytest.raises(CheckpointError, match=f"checkpoint shard {path} is missing"):
        list(iter_model_tensors(ckpt))


def test_missing_index(ckpt):
    os.remove(os.path.join(ckpt, "iter_0000007", ".metadata"))
    with pytest.raises(CheckpointError, match="is not a complete torch_dist checkpoint: it has no .metadata"):
        read_checkpoint_meta(ckpt)


def test_tracker_pointing_at_nothing(ckpt):
    with open(os.path.join(ckpt, layout.TRACKER), "w") as f:
        f.write("9")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt names iteration 9, but .*"
                                              "iter_0000009 does not exist"):
        read_checkpoint_meta(ckpt)


def test_tracker_without_a_number(ckpt):
    with open(os.path.join(ckpt, layout.TRACKER), "w") as f:
        f.write("latest")
    with pytest.raises(CheckpointError, match="holds 'latest', not an iteration number"):
        read_checkpoint_meta(ckpt)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_index_with_code_is_refused(ckpt):
    with open(os.path.join(ckpt, "iter_0000007", ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(CheckpointError, match=r"refusing to load posix.system|refusing to load os.system"):
        read_checkpoint_meta(ckpt)


def test_damaged_json_entry(ckpt):
    md = dcp_io.read_index(os.path.join(ckpt, "iter_0000007"))
    from torch.distributed.checkpoint.metadata import MetadataIndex
    info = md.storage_data[MetadataIndex("common_state")]
    path = os.path.join(ckpt, "iter_0000007", info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_checkpoint_meta(ckpt)


def test_no_checkpoint_here(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        read_checkpoint_meta(str(tmp_path))
    assert layout.resolve(str(tmp_path / "missing")) is None
