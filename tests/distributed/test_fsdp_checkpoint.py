"""FSDP2 checkpoints are the same global tensors as every other layout's: a run saved under FSDP2 at DP 4 resumes
under TP 2 x DP 2 with the distributed optimizer, whose checkpoint resumes under FSDP2 at DP 2, and every resume
continues the uninterrupted run's losses (fp32, rtol 1e-5). The FSDP2 checkpoint holds every tensor (model and
optimizer state) under its global name and shape, with the values of a DDP run's checkpoint at the same
iteration; resuming FSDP2 in its own layout is bitwise exact."""
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import dcp_io
from megatronish.checkpoint.offline import read_checkpoint_meta
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--optimizer", "sgd", "--lr", "0.3", "--clip-grad", "0.5",
        "--lr-decay-style", "constant", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
        "--log-interval", "100", "--seed", "5", "--swiglu", "--untie-embeddings-and-output-weights",
        "--train-iters", "6"]
FSDP = ["--use-torch-fsdp2"]
TP2_DISTOPT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]


def _losses(argv, world):
    groups.destroy_model_parallel()
    return [loss for _, loss in pretrain(configs_from_args(parse_args(BASE + argv), world)).state.history]


def _dir(root, name, it):
    return os.path.join(root, name, f"iter_{it:07d}")


def _worker(rank, world, root):
    out = {}
    if world == 4:
        out["ref"] = _losses(["--save", os.path.join(root, "ddp"), "--save-interval", "2"], world)
        out["fsdp4"] = _losses(FSDP + ["--save", os.path.join(root, "fsdp4"), "--save-interval", "2"], world)
        out["fsdp4->fsdp4"] = _losses(FSDP + ["--load", _dir(root, "fsdp4", 2)], world)
        out["fsdp4->tp2dp2"] = _losses(TP2_DISTOPT + ["--load", _dir(root, "fsdp4", 2), "--save",
                                                      os.path.join(root, "tp2dp2"), "--save-interval", "4"], world)
    else:
        out["tp2dp2->fsdp2"] = _losses(FSDP + ["--load", _dir(root, "tp2dp2", 4)], world)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    got = run_distributed(_worker, 4, root, timeout=600)[0]
    got.update(run_distributed(_worker, 2, root, timeout=600)[0])
    return root, got


def _close(have, want, what):
    torch.testing.assert_close(torch.tensor(have), torch.tensor(want), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")


def test_chain_continues_the_uninterrupted_run(results):
    _, got = results
    ref = got["ref"]
    _close(got["fsdp4"], ref, "FSDP2 DP 4 uninterrupted")
    assert got["fsdp4->fsdp4"] == got["fsdp4"][2:], "same-layout FSDP2 resume must be bitwise exact"
    _close(got["fsdp4->tp2dp2"], ref[2:], "FSDP2 DP 4 -> TP 2 x DP 2 distributed optimizer")
    _close(got["tp2dp2->fsdp2"], ref[4:], "TP 2 x DP 2 distributed optimizer -> FSDP2 DP 2")


def test_fsdp_checkpoint_holds_the_global_tensors(results):
    root, _ = results
    fsdp, ddp = _dir(root, "fsdp4", 2), _dir(root, "ddp", 2)
    a, b = read_checkpoint_meta(fsdp)["tensors"], read_checkpoint_meta(ddp)["tensors"]
    assert {k: v["shape"] for k, v in a.items()} == {k: v["shape"] for k, v in b.items()}
    md_a, md_b = dcp_io.read_index(fsdp), dcp_io.read_index(ddp)
    keys = sorted(k for k in md_b.state_dict_metadata if k.startswith(("model.", "optimizer.")))
    assert keys == sorted(k for k in md_a.state_dict_metadata if k.startswith(("model.", "optimizer.")))
    assert any(k.endswith(".momentum_buffer") for k in keys)
    for key in keys:
        x, y = dcp_io.read_tensor(fsdp, md_a, key), dcp_io.read_tensor(ddp, md_b, key)
        assert x.shape == y.shape, key
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * float(y.abs().max()), msg=lambda m: f"{key}: {m}")
    # FSDP2 wrote row shards of the linear weights (4 DP pieces each), DDP one piece
    pieces = {}
    for index in md_a.storage_data:
        pieces[index.fqn] = pieces.get(index.fqn, 0) + 1
    assert pieces["model.decoder.layers.0.mlp.linear_fc1.weight"] == 4
