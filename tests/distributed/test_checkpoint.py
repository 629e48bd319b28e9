"""Checkpoints through ``pretrain(cfg)``: exact resume in the same layout (bitwise, dropout on), asynchronous
saves equal synchronous ones, exit conditions save, every layout loads every other (reshard matrix), and a
checkpoint that does not fit the run gives one clear error."""
import dataclasses
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import CheckpointError, dcp_io
from megatronish.checkpoint.offline import iter_model_tensors, read_checkpoint_meta
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--swiglu", "--eval-iters", "0", "--log-interval", "1000", "--seed", "7"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
DIST_OPT = ["--use-distributed-optimizer"]

PP2_VP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
TP2 = ["--tensor-model-parallel-size", "2"]


def _run(argv, world, edit=None):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    return pretrain(edit(cfg) if edit else cfg)


def _losses(argv, world, edit=None):
    return [loss for _, loss in _run(argv, world, edit).state.history]


# ------------------------------------------------------------------ exact resume, async, exit conditions
# 2 layers where the layout does not need 4 (2 stages x 2 virtual stages of 1): the suite's time. bf16 + FP8: the
# fp32 master copies and the FP8 amax history travel too
TWO_LAYERS = ["--num-layers", "2"]
RESUME_CASES = {"dp2": TWO_LAYERS, "pp2_vp2": PP2_VP2, "dp2_distributed_optimizer": TWO_LAYERS + DIST_OPT,
                "dp2_bf16_fp8": TWO_LAYERS + ["--bf16", "--fp8-format", "hybrid"]}


def _record_read_ahead(root, calls):
    """Wraps ``dcp_io.read_ahead_own_shard`` (in this rank's process) to note (iteration directory under ``root``,
    rank, bytes asked for) of each call in ``calls``."""
    real = dcp_io.read_ahead_own_shard

    def record(iter_dir, md, rank, wanted):
        asked = real(iter_dir, md, rank, wanted)
        calls.append((os.path.relpath(iter_dir, root), rank, asked))
        return asked

    dcp_io.read_ahead_own_shard = record


def _resume_worker(rank, world, root):
    out = {}
    out["read_ahead"] = []
    _record_read_ahead(root, out["read_ahead"])
    for name, case in RESUME_CASES.items():
        d = os.path.join(root, name)
        argv = case + DROPOUT + ["--train-iters", "10"]
        straight = _losses(argv, world)
        first = _run(argv + ["--exit-interval", "5", "--save", d], world).state
        resumed = _losses(argv + ["--load", d], world)
        out[name] = (straight, [loss for _, loss in first.history], first.exit_reason, resumed)
    # asynchronous saves: same training, and the same files as the synchronous save
    d = os.path.join(root, "async")
    argv = RESUME_CASES["dp2"] + DROPOUT + ["--train-iters", "10"]
    out["async"] = _losses(argv + ["--save", d, "--save-interval", "5", "--async-save"], world)
    out["async_resumed"] = _losses(argv + ["--load", os.path.join(d, "iter_0000005")], world)
    # the snapshot's copies run during the next forward and backward: sharded optimizer state, fp32 master copies
    # of bf16 weights, FP8 histories (changed by the forward, copied at the save call)
    for name in ("dp2_distributed_optimizer", "dp2_bf16_fp8"):
        d = os.path.join(root, "async_" + name)
        case = RESUME_CASES[name] + DROPOUT + ["--train-iters", "10"]
        out["async_" + name] = (_losses(case + ["--save", d, "--save-interval", "5", "--async-save"], world),
                                _losses(case + ["--load", os.path.join(d, "iter_0000005")], world))
    # a background write that fails: every rank raises at the next iteration, the tracker is not written
    real_save = dcp_io.save

    def failing_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    dcp_io.save = failing_save
    try:
        _run(argv + ["--save", os.path.join(root, "failing"), "--save-interval", "2", "--async-save"], world)
        out["async_error"] = None
    except CheckpointError as e:
        out["async_error"] = str(e)
    finally:
        dcp_io.save = real_save
    # --exit-duration-in-mins: every rank decides together after the first iteration
    state = _run(argv + ["--save", os.path.join(root, "duration")], world,
                 edit=lambda cfg: dataclasses.replace(
                     cfg, checkpoint=dataclasses.replace(cfg.checkpoint, exit_duration_in_mins=1e-9))).state
    out["duration"] = (state.iteration, state.exit_reason)
    return out


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    results = run_distributed(_resume_worker, 2, root, timeout=300)
    return root, results[0], [call for r in results for call in r["read_ahead"]]


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_exact_resume_same_layout(resume, case):
    straight, first, reason, resumed = resume[1][case]
    assert len(straight) == 10 and reason == "interval" and len(first) == 5
    assert first + resumed == straight  # bitwise: model, optimizer, schedule, RNG (dropout on), data position


def _own_records_bytes(iter_dir, rank, kinds):
    md = dcp_io.read_index(iter_dir)
    return sum(info.length for index, info in md.storage_data.items()
               if info.relative_path == f"__{rank}_0.distcp" and index.fqn.startswith(kinds))


def test_same_layout_loads_read_ahead_their_own_shard(resume):
    """A load into the layout that saved the checkpoint asks the kernel early for the model, optimizer (and FP8)
    records of the rank's own shard file, all of them (each is under the read-ahead window)."""
    root, _, every_rank = resume
    calls = {}
    for iter_dir, rank, asked in every_rank:
        calls.setdefault(iter_dir, {})[rank] = asked
    for name in RESUME_CASES:
        kinds = ("model.", "optimizer.") + (("fp8.",) if "fp8" in name else ())
        want = {r: _own_records_bytes(os.path.join(root, name, "iter_0000005"), r, kinds) for r in range(2)}
        assert calls[os.path.join(name, "iter_0000005")] == want, name
        assert all(want.values()), want


def test_async_save_equals_sync(resume):
    root, out, _ = resume
    straight = out["dp2"][0]
    assert out["async"] == straight
    assert out["async_resumed"] == straight[5:]
    assert open(os.path.join(root, "async", "latest_checkpointed_iteration.txt")).read() == "10"
    sync_dir, async_dir = os.path.join(root, "dp2", "iter_0000005"), os.path.join(root, "async", "iter_0000005")
    for (name, a), (_, b) in zip(iter_model_tensors(sync_dir), iter_model_tensors(async_dir)):
        assert torch.equal(a, b), name
    ms, ma = dcp_io.read_index(sync_dir), dcp_io.read_index(async_dir)
    opt = [k for k in ms.state_dict_metadata if k.startswith("optimizer.")]
    assert opt and sorted(opt) == sorted(k for k in ma.state_dict_metadata if k.startswith("optimizer."))
    for k in opt:
        assert torch.equal(dcp_io.read_tensor(sync_dir, ms, k), dcp_io.read_tensor(async_dir, ma, k)), k


@pytest.mark.parametrize("case", ["dp2_distributed_optimizer", "dp2_bf16_fp8"])
def test_async_save_resumes_exactly(resume, case):
    straight = resume[1][case][0]
    trained, resumed = resume[1]["async_" + case]
    assert trained == straight and resumed == straight[5:]


def test_async_save_error_surfaces_on_every_rank(resume):
    root, out, _ = resume
    assert out["async_error"].startswith(f"--save {os.path.join(root, 'failing')}: saving iteration 2 failed: "
                                         "asynchronous save: ") and "No space left on device" in out["async_error"]
    assert "no complete checkpoint in" in out["async_error"]
    assert not os.path.exists(os.path.join(root, "failing", "latest_checkpointed_iteration.txt"))


def test_exit_duration_saves_and_stops(resume):
    root, out, _ = resume
    assert out["duration"] == (1, "duration")
    assert read_checkpoint_meta(os.path.join(root, "duration"))["iteration"] == 1


# ------------------------------------------------------------------ reshard matrix
SOURCES = {"tp2_pp2_sp": TP2 + ["--pipeline-model-parallel-size", "2", "--sequence-parallel"],
           "pp2_vp2_dp2": PP2_VP2, "tp2_dp2_distopt": TP2 + DIST_OPT}
SAVE_AT, END = 5, 8


def _source_dir(root, name):
    return os.path.join(root, name, f"iter_{SAVE_AT:07d}")


def _reshard_worker(rank, world, root):
    argv = NO_DROPOUT + ["--train-iters", str(END)]
    refs, got = {}, {}
    calls = []
    _record_read_ahead(root, calls)
    if world == 4:
        for name, src in SOURCES.items():  # the original layout: save at 5, continue to 8
            refs[name] = _losses(src + argv + ["--save", os.path.join(root, name), "--save-interval", str(SAVE_AT)],
                                 world)[SAVE_AT:]
    targets = SOURCES if world == 4 else {"single": []}
    for name in SOURCES:
        for target, tgt in targets.items():
            if target != name:
                got[(name, target)] = _losses(tgt + argv + ["--load", _source_dir(root, name)], world)
    return refs, got, calls


def _bad_checkpoints_worker(rank, world, root):
    """Each checkpoint that does not fit the run: one message (world 1)."""
    src = os.path.join(root, "tp2_pp2_sp")
    errors = {}

    def error_of(argv, edit=None):
        try:
            _run(NO_DROPOUT + ["--train-iters", "6"] + argv, world, edit)
        except CheckpointError as e:
            return str(e)
        return None

    errors["hidden"] = error_of(["--load", src, "--hidden-size", "64"])
    errors["layers"] = error_of(["--load", src, "--num-layers", "2"])
    errors["sgd"] = error_of(["--load", src, "--optimizer", "sgd"])
    errors["missing"] = error_of(["--load", os.path.join(root, "nothing"), "--exit-on-missing-checkpoint"])
    no_optim = os.path.join(root, "no_optim")
    _run(NO_DROPOUT + ["--train-iters", "3", "--save", no_optim, "--no-save-optim"], world)
    errors["no_optim"] = error_of(["--load", no_optim])
    ok = {"no_load_optim": len(_losses(NO_DROPOUT + ["--train-iters", "4", "--load", no_optim, "--no-load-optim"],
                                       world)),
          "finetune": len(_losses(NO_DROPOUT + ["--train-iters", "4", "--load", src, "--finetune"], world)),
          "fresh": len(_losses(NO_DROPOUT + ["--train-iters", "3", "--load", os.path.join(root, "nothing")], world))}
    # an fp32 checkpoint into a bf16 run: the fp32 master copies start from the stored fp32 weights (bitwise),
    # the bf16 model from their rounding; then it trains on
    src_dir = _source_dir(root, "tp2_pp2_sp")
    loaded = _run(NO_DROPOUT + ["--train-iters", str(END), "--skip-train", "--bf16", "--load", src_dir], world)
    opt = loaded.context.optimizer
    md = dcp_io.read_index(src_dir)
    masters = {}
    for m in loaded.context.models:
        for name, p in m.named_global_parameters():
            slot = next(sl for sl in opt.slots if sl.model is p)
            stored = dcp_io.read_tensor(src_dir, md, "model." + name)
            rows = min(stored.shape[0], p.shape[0])
            masters[name] = (torch.equal(slot.main.view_as(p)[:rows], stored[:rows]),
                             torch.equal(p.detach()[:rows], stored[:rows].to(torch.bfloat16)), p.dtype)
    ok["bf16_masters"] = masters
    ok["bf16_from_fp32"] = _losses(NO_DROPOUT + ["--train-iters", str(END), "--bf16", "--load", src_dir], world)
    return errors, ok


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    refs, got, calls = run_distributed(_reshard_worker, 4, root, timeout=300)[0]
    _, single, single_calls = run_distributed(_reshard_worker, 1, root, timeout=300)[0]
    got.update(single)
    bad = run_distributed(_bad_checkpoints_worker, 1, root, timeout=300)[0]
    return root, refs, got, bad, calls + single_calls


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_reshard_matrix(reshard, source):
    """A checkpoint saved at one layout, loaded at each other one and in one process, continues with the
    losses of the original layout."""
    _, refs, got, _, _ = reshard
    targets = [t for (s, t) in got if s == source]
    assert sorted(targets) == sorted([t for t in SOURCES if t != source] + ["single"])
    for target in targets:
        torch.testing.assert_close(torch.tensor(got[(source, target)]), torch.tensor(refs[source]), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{source} -> {target}: {m}")


def test_loads_into_another_layout_do_not_read_ahead_a_shard(reshard):
    """Every load of the reshard matrix goes into another layout: no rank guesses its reads before planning."""
    assert reshard[4] == []


def test_reshard_stores_global_tensors_once(reshard):
    """Global shapes whatever the layout; replicated tensors (TP-replicated norms, the tied output copy) once."""
    root = reshard[0]
    metas = {name: read_checkpoint_meta(_source_dir(root, name)) for name in SOURCES}
    shapes = {name: {k: v["shape"] for k, v in m["tensors"].items()} for name, m in metas.items()}
    assert shapes["pp2_vp2_dp2"]["embedding.word_embeddings.weight"] == (128, 32)  # padded for TP 1
    assert shapes["tp2_pp2_sp"]["embedding.word_embeddings.weight"] == (256, 32)  # padded for TP 2
    assert shapes["tp2_pp2_sp"]["decoder.layers.3.mlp.linear_fc1.weight"] == (128, 32)  # [gate; up]
    assert "output_layer.weight" not in shapes["tp2_pp2_sp"]  # tied: the last stage's copy is the embedding
    for name, per_key in (("pp2_vp2_dp2", {}), ("tp2_pp2_sp", {"model.decoder.layers.3.mlp.linear_fc1.weight": 4,
                                                                "model.decoder.layers.3.mlp.linear_fc2.weight": 2,
                                                                "model.embedding.word_embeddings.weight": 2})):
        md = dcp_io.read_index(_source_dir(root, name))
        chunks = {}
        for index in md.storage_data:
            if index.offset is not None:
                chunks[index.fqn] = chunks.get(index.fqn, 0) + 1
        assert chunks["model.decoder.final_layernorm.weight"] == 1  # replicated over DP / TP ranks: stored once
        assert chunks["model.embedding.word_embeddings.weight"] == per_key.get(
            "model.embedding.word_embeddings.weight", 1)  # the tied copy on the last stage is not stored again
        for key, n in per_key.items():  # TP 2: two blocks per rank for [gate; up]
            assert chunks[key] == n and chunks["optimizer." + key[len("model."):] + ".exp_avg"] == n, key
        if not per_key:
            assert set(chunks.values()) == {1}


def test_bad_checkpoint_messages(reshard):
    errors, ok = reshard[3]
    assert errors["hidden"].startswith("--hidden-size: checkpoint") and "hidden_size=32, this run has 64" in \
        errors["hidden"]
    assert errors["layers"].startswith("--num-layers: checkpoint")
    assert "no optimizer state 'momentum_buffer'" in errors["sgd"] and "--no-load-optim" in errors["sgd"]
    assert errors["missing"].startswith("--exit-on-missing-checkpoint: no checkpoint under --load")
    assert "has no optimizer state (saved with --no-save-optim" in errors["no_optim"]
    bf16, masters = ok.pop("bf16_from_fp32"), ok.pop("bf16_masters")
    assert ok == {"no_load_optim": 1, "finetune": 4, "fresh": 3}  # resumed at 3; finetune restarts at 0
    assert masters and all(m == (True, True, torch.bfloat16) for m in masters.values()), masters
    # bf16 vs fp32 from the same weights: the rounding of every weight, activation and gradient, as measured in
    # test_mixed_precision.py (FP32_TOL 5e-4)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(reshard[1]["tp2_pp2_sp"]), rtol=5e-4, atol=0)
    assert bf16 != reshard[1]["tp2_pp2_sp"]  # really trained in bf16


# ------------------------------------------------------------------ FP8 scaling state
def _fp8_worker(rank, world, root):
    import zlib

    from megatronish.checkpoint.manager import Checkpointer
    from megatronish.model.build import build_model_chunks
    from megatronish.precision.fp8 import Fp8Recipe, enable_fp8
    from megatronish.training.pretrain import TrainState

    groups.destroy_model_parallel()
    flags = NO_DROPOUT + ["--train-iters", "4"] + (TP2 + ["--save", root] if world == 2 else ["--load", root])
    cfg = configs_from_args(parse_args(BASE + flags), world)
    ctx = groups.initialize_model_parallel(cfg.parallel)
    models = build_model_chunks(cfg.model, ctx)
    manager = enable_fp8(models[0], Fp8Recipe(fp8_amax_history_len=3))
    ck = Checkpointer(cfg, models, None, None, parallel=ctx, fp8=manager)
    if world == 2:
        for key, s in manager.states():  # the same on every rank, as after the amax all-reduce
            base = zlib.crc32(key.encode()) % 1000
            s.amax_history = torch.arange(3.0) + base
            s.scale = torch.tensor(1.0 / (base + 1))
        ck.save(TrainState(iteration=3))
        ck.finish(TrainState(iteration=3))
    else:
        ck.load(TrainState())
    return {k: v.tolist() for k, v in manager.state_dict().items() if k != "recipe"}  # plain values to the parent


def test_fp8_scaling_state_survives_a_layout_change(tmp_path):
    saved = run_distributed(_fp8_worker, 2, str(tmp_path))[0]
    loaded = run_distributed(_fp8_worker, 1, str(tmp_path))[0]
    assert len(saved) == 4 * 4 * 3 * 2  # layers x linears x (input, weight, grad_output) x (history, scale)
    assert saved == loaded


# ------------------------------------------------------------------ offline-written checkpoints (conversion)
def _offline_worker(rank, world, root):
    from megatronish.checkpoint.offline import write_checkpoint
    from megatronish.model.build import build_model_chunks

    argv = NO_DROPOUT + ["--train-iters", "3", "--finetune", "--load", root]
    if world == 1:  # write global tensors as a converter would: here the initial weights, scaled
        groups.destroy_model_parallel()
        cfg = configs_from_args(parse_args(BASE + NO_DROPOUT + ["--train-iters", "3"]), 1)
        ctx = groups.initialize_model_parallel(cfg.parallel)
        (model,) = build_model_chunks(cfg.model, ctx)
        model.init_parameters(123)
        tensors = {name: p.detach()[: cfg.model.vocab_size] * 1.5 if name.startswith("embedding.word") else
                   p.detach() * 1.5 for name, p in model.named_global_parameters()}
        write_checkpoint(root, None, tensors, cfg.model)
        return _losses(argv, world), _losses(NO_DROPOUT + ["--train-iters", "3"], world)
    return _losses(argv + TP2, world)


def test_offline_checkpoint_loads_at_any_layout(tmp_path):
    """A checkpoint written by the offline API (unpadded vocabulary, no optimizer) loads with --finetune in one
    process and at TP 2 with the same losses, which are not the fresh model's."""
    single, fresh = run_distributed(_offline_worker, 1, str(tmp_path))[0]
    tp2 = run_distributed(_offline_worker, 2, str(tmp_path))[0]
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(single), rtol=1e-5, atol=0)
    assert abs(single[0] - fresh[0]) > 1e-3
