"""MoE checkpoints: expert weights are stored once, by global expert index, so a checkpoint saved at one expert
layout loads at any other (EP, expert-TP, TP, PP, the distributed optimizer, one process) and training continues
with the original losses; resuming in the same layout is bitwise exact, router expert bias included."""
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint import CheckpointError, dcp_io
from megatronish.checkpoint.offline import iter_model_tensors, read_checkpoint_meta
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--optimizer", "sgd", "--lr", "0.3", "--clip-grad", "0.5",
        "--lr-decay-style", "constant", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
        "--log-interval", "100", "--seed", "5", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--num-experts", "4",
        "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
        "--moe-shared-expert-intermediate-size", "16", "--moe-token-dispatcher-type", "alltoall"]
SAVE_AT, END = 3, 5
SOURCES = {  # world 4
    "ep2_tp2_sp": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep4_distopt": ["--expert-model-parallel-size", "4", "--use-distributed-optimizer"],
    "ep2_pp2": ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
}
TARGETS_2 = {"tp2_etp1_ep2": ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel", "--expert-tensor-parallel-size", "1"]}


def _losses(argv, world):
    groups.destroy_model_parallel()
    return [loss for _, loss in pretrain(configs_from_args(parse_args(BASE + argv), world)).state.history]


def _src(root, name):
    return os.path.join(root, name, f"iter_{SAVE_AT:07d}")


def _worker(rank, world, root, stage):
    argv = ["--train-iters", str(END)]
    refs, got = {}, {}
    if stage == "save":
        for name, flags in SOURCES.items():
            d = os.path.join(root, name)
            refs[name] = _losses(flags + argv + ["--save", d, "--save-interval", str(SAVE_AT)], world)
            got[(name, name)] = _losses(flags + argv + ["--load", _src(root, name)], world)  # same layout: bitwise
        for name in SOURCES:
            for target, flags in SOURCES.items():
                if target != name:
                    got[(name, target)] = _losses(flags + argv + ["--load", _src(root, name)], world)
    else:
        targets = TARGETS_2 if world == 2 else {"single": []}
        for name in SOURCES:
            for target, flags in targets.items():
                got[(name, target)] = _losses(flags + argv + ["--load", _src(root, name)], world)
        if world == 1:  # a different expert count: one error naming the flag
            try:
                _losses(argv + ["--load", _src(root, "ep2_pp2"), "--num-experts", "8"], world)
            except CheckpointError as e:
                refs["error"] = str(e)
    return refs, got


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    refs, got = run_distributed(_worker, 4, root, "save", timeout=600)[0]
    for world in (2, 1):
        more, loaded = run_distributed(_worker, world, root, "load", timeout=600)[0]
        got.update(loaded)
        refs.update(more)
    return root, refs, got


def test_expert_count_mismatch_is_one_error(results):
    error = results[1].get("error")
    assert error is not None and error.startswith("--num-experts: checkpoint") and "num_experts=4" in error, error


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_reshard_continues_the_original_run(results, source):
    _, refs, got = results
    targets = sorted(t for (s, t) in got if s == source)
    assert targets == sorted(list(SOURCES) + list(TARGETS_2) + ["single"])
    want = torch.tensor(refs[source][SAVE_AT:])
    for target in targets:
        have = torch.tensor(got[(source, target)])
        if target == source:
            assert torch.equal(have, want), f"{source}: same-layout resume must be bitwise exact: {have} {want}"
        torch.testing.assert_close(have, want, rtol=1e-5, atol=0, msg=lambda m: f"{source} -> {target}: {m}")


def test_expert_tensors_stored_once_by_global_index(results):
    root = results[0]
    meta = read_checkpoint_meta(_src(root, "ep2_tp2_sp"))
    shapes = {k: v["shape"] for k, v in meta["tensors"].items()}
    assert shapes["decoder.layers.0.mlp.experts.linear_fc1.weight"] == (4, 32, 32)  # [E, 2F, h]
    assert shapes["decoder.layers.0.mlp.experts.linear_fc2.weight"] == (4, 32, 16)  # [E, h, F]
    assert shapes["decoder.layers.1.mlp.router.expert_bias"] == (4,)
    md = dcp_io.read_index(_src(root, "ep2_tp2_sp"))
    chunks = {}
    for index in md.storage_data:
        chunks[index.fqn] = chunks.get(index.fqn, 0) + 1
    # EP 2 x expert-TP 2: four ranks, fc1 split in [gate; up] blocks -> 2 pieces each; expert-DP 1
    assert chunks["model.decoder.layers.0.mlp.experts.linear_fc1.weight"] == 8
    assert chunks["model.decoder.layers.0.mlp.experts.linear_fc2.weight"] == 4
    assert chunks["model.decoder.layers.0.mlp.router.expert_bias"] == 1  # replicated: stored once
    # the aux-loss-free bias has moved and is stored
    bias = dict(iter_model_tensors(_src(root, "ep2_pp2"), ["decoder.layers.0.mlp.router.expert_bias"]))
    assert bias["decoder.layers.0.mlp.router.expert_bias"].abs().sum() > 0
