"""Multi-latent attention (with YaRN) and DeepSeek-V3's MoE layer train in every layout exactly as one process.

Each case runs 3 iterations through the training step and compares with a one-process run of the same model
(same seed, no weight copying): the losses and every parameter's reduced gradient of every iteration (assembled
from the ranks' slices; replicas must agree, so a missing reduction of a replicated down-projection shows), fp32,
rtol 1e-5. SGD with an active gradient clip, so a wrong reduction shows up again in the next iteration.

Resharding on resume: a DeepSeek-MoE model's checkpoint saved after iteration 2 at EP 2 x TP 2 + SP with the
distributed optimizer, and a dense MLA model's saved at TP 2 + SP (Adam, so the moments travel too), resume in
other layouts; iterations 3 and 4 have the losses of the uninterrupted run (one process, rtol 1e-5), which the
saving run's first 2 iterations share.
"""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import assert_parity, global_tensors, run_distributed
from megatronish.training import pretrain as training

ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", str(ITERS), "--optimizer", "sgd", "--lr", "0.3",
        "--lr-decay-style", "constant", "--clip-grad", "0.5", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "7", "--disable-bias-linear", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
        "--v-head-dim", "6", "--qk-layernorm"]
# q latent, YaRN (MLA's default RoPE) with a softmax mscale and an attention factor
YARN = ["--q-lora-rank", "16", "--rotary-scaling-factor", "4", "--mscale-all-dim", "0.7",
        "--yarn-original-max-position-embeddings", "8"]
MODEL = {  # variant -> its flags
    "mla-yarn": YARN,
    "mla-full-q-rope": ["--rope-type", "rope"],
    # the interleaved pipeline's 2 stages x 2 virtual stages of 1 layer (the others train 2 layers: the suite's time)
    "mla-yarn-4-layers": ["--num-layers", "4"] + YARN,
    # DeepSeek-V3's MoE: the first layer dense with its own FFN size, sigmoid scores with the selection-only
    # expert bias, group-limited top-k, the routed scaling factor, a shared expert
    "mla-deepseek-moe": ["--q-lora-rank", "16", "--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*1)",
                         "--ffn-hidden-size", "24", "--moe-ffn-hidden-size", "8", "--moe-router-topk", "2",
                         "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                         "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "2",
                         "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
                         "--moe-shared-expert-intermediate-size", "16", "--moe-router-load-balancing-type",
                         "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"],
}
TP2, SP = ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2, EP2 = ["--context-parallel-size", "2"], ["--expert-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
CASES = {  # name: (world, layout flags, model variant)
    "tp2-sp": (2, TP2 + SP, "mla-yarn"),
    "tp2": (2, TP2, "mla-yarn"),
    "tp2-sp-full-q": (2, TP2 + SP, "mla-full-q-rope"),
    "tp2-sp-recompute-full": (2, TP2 + SP + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1"], "mla-yarn"),
    "tp2-sp-recompute-selective": (2, TP2 + SP + ["--recompute-granularity", "selective"], "mla-yarn"),
    # the up-projections and RoPE recomputed from the kept latents (their all-gathers again in backward), with
    # the norms' outputs and the dense MLP (its fc1's all-gather again in backward)
    "tp2-sp-recompute-modules": (2, TP2 + SP + ["--recompute-granularity", "selective", "--recompute-modules",
                                                "mla_up_proj", "core_attn", "layernorm", "mlp"], "mla-yarn"),
    "pp2": (2, PP2, "mla-yarn"),
    "cp2-p2p": (2, CP2, "mla-yarn"),
    # Ulysses: the padded keys/values (d_nope + d_rope = 12, d_v = 6) scattered by heads
    "cp2-a2a": (2, CP2 + ["--cp-comm-type", "a2a"], "mla-yarn"),
    "dp2-distopt": (2, ["--use-distributed-optimizer"], "mla-yarn"),
    "dp2-fsdp2": (2, ["--use-torch-fsdp2"], "mla-yarn"),
    "pp2-vp2": (4, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], "mla-yarn-4-layers"),
    # the split backward: the down- and up-projections' weight GEMMs wait for W, the latent norms' in B
    "pp2-zbv": (2, PP2 + ["--pipeline-schedule", "zbv"], "mla-yarn-4-layers"),
    "cp2-allgather-tp2": (4, TP2 + CP2 + ["--cp-comm-type", "allgather"], "mla-yarn"),
    # hierarchical: a2a inside pairs of adjacent CP ranks, the ring across the two pairs
    "cp4-a2a-p2p": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                        "--hierarchical-context-parallel-sizes", "2", "2"], "mla-yarn"),
    "ep2-tp2-sp": (4, TP2 + SP + EP2, "mla-deepseek-moe"),
    "ep2-tp2-sp-distopt": (4, TP2 + SP + EP2 + DISTOPT, "mla-deepseek-moe"),
}
MOE_SAVE = TP2 + SP + EP2 + DISTOPT
RESUME = {  # checkpoint: (model variant, world and layout that save it, {layout resuming it: (world, flags)})
    "deepseek-moe": ("mla-deepseek-moe", 4, MOE_SAVE, {
        "dp2": (2, []), "pp2": (2, PP2), "ep2-distopt": (2, EP2 + DISTOPT)}),
    # CP and FSDP2 do not take --num-experts yet: the dense model's checkpoint covers them
    "mla-yarn": ("mla-yarn", 2, TP2 + SP, {"cp2": (2, CP2), "dp2-fsdp2": (2, ["--use-torch-fsdp2"])}),
}


def _run(argv, world):
    """Losses and the reduced gradients of every iteration (numpy: they travel through a pipe)."""
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv), world)
    run, state = training.setup(cfg)
    grads, step = [], run.optimizer.step

    def step_and_record():  # before clipping and the update
        grads.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel, grads=True,
                                                               optimizer=run.optimizer).items()})
        return step()

    run.optimizer.step = step_and_record
    losses = [training.train_step(run, state).loss for _ in range(ITERS)]
    return {"losses": losses, "grads": grads}


def _pretrain_losses(variant, flags, world):
    groups.destroy_model_parallel()
    argv = BASE + MODEL[variant] + ["--optimizer", "adam", "--lr", "1e-2", "--train-iters", "4"] + flags
    return [loss for _, loss in training.pretrain(configs_from_args(parse_args(argv), world)).state.history]


def _checkpoint_losses(world, root):
    """One process: the uninterrupted 4 iterations of each model of RESUME. Else the checkpoints this world saves
    (after iteration 2: the saving run's 2 losses), then iterations 3 and 4 of every layout of this world resuming
    one (worlds run in the order 4, 2, 1). Iteration 3's loss is the loaded weights' (and expert biases');
    iteration 4's follows the first update after loading, so it also depends on the loaded Adam moments and step."""
    out = {}
    for ckpt, (variant, save_world, save_flags, layouts) in RESUME.items():
        path = f"{root}/{ckpt}"
        if world == 1:
            out[(ckpt, "uninterrupted")] = _pretrain_losses(variant, [], 1)
        if save_world == world:  # saves when it exits
            out[(ckpt, "saved")] = _pretrain_losses(variant, save_flags + ["--save", path, "--exit-interval", "2"],
                                                    world)
        for name, (w, flags) in layouts.items():
            if w == world:
                out[(ckpt, name)] = _pretrain_losses(variant, flags + ["--load", path], world)
    return out


def _worker(rank, world, cases, root):
    out = {name: _run(argv, world) for name, argv in cases.items()}
    out["checkpoint"] = _checkpoint_losses(world, root)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mla_ckpt"))
    refs, got, resumed = {}, {}, {}
    for world in (4, 2, 1):  # the checkpoints' savers first
        cases = MODEL if world == 1 else \
            {name: flags + MODEL[variant] for name, (w, flags, variant) in CASES.items() if w == world}
        out = run_distributed(_worker, world, cases, root, timeout=600)[0]
        resumed.update(out.pop("checkpoint"))
        (refs if world == 1 else got).update(out)
    return refs, got, resumed


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_equals_one_process(results, name):
    refs, got, _ = results
    ref, out = refs[CASES[name][2]], got[name]
    assert_parity(out["losses"], ref["losses"], f"{name} losses")
    assert len(out["grads"]) == len(ref["grads"]) == ITERS
    for it, (grads, ref_grads) in enumerate(zip(out["grads"], ref["grads"])):
        assert sorted(grads) == sorted(ref_grads), f"{name}: parameter names differ"
        for param, want in ref_grads.items():  # (the vocabulary pads to 128 at TP 1 and 2 alike)
            assert_parity(grads[param], want, f"{name} iteration {it + 1} gradient of {param}")


def test_reference_learns_and_every_mla_weight_gets_gradient(results):
    refs, _, _ = results
    for variant, ref in refs.items():
        assert ref["losses"][-1] < ref["losses"][0], f"{variant}: {ref['losses']}"
        g = ref["grads"][0]
        attention = [n for n in g if ".self_attention." in n]
        assert all(abs(g[n]).sum() > 0 for n in attention), variant
    names = set(refs["mla-yarn-4-layers"]["grads"][0])
    for leaf in ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj", "linear_kv_down_proj", "kv_layernorm",
                 "linear_kv_up_proj", "linear_proj"):
        assert f"decoder.layers.3.self_attention.{leaf}.weight" in names
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in refs["mla-full-q-rope"]["grads"][0]
    moe = refs["mla-deepseek-moe"]["grads"][0]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in moe and moe["decoder.layers.0.mlp.linear_fc1.weight"].shape \
        == (48, 32)  # the dense first layer: SwiGLU of --ffn-hidden-size 24
    assert moe["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 16, 32)  # --moe-ffn-hidden-size 8


RESUMED = sorted((ckpt, name) for ckpt, spec in RESUME.items() for name in spec[3])


@pytest.mark.parametrize("ckpt,layout", RESUMED, ids=[f"{c}-to-{n}" for c, n in RESUMED])
def test_checkpoint_resumes_with_the_uninterrupted_losses(results, ckpt, layout):
    _, _, resumed = results
    want, saved, got = resumed[(ckpt, "uninterrupted")], resumed[(ckpt, "saved")], resumed[(ckpt, layout)]
    assert len(want) == 4 and len(saved) == len(got) == 2, (want, saved, got)  # iterations 1-2, then 3-4
    torch.testing.assert_close(torch.tensor(saved), torch.tensor(want[:2]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[2:]), rtol=1e-5, atol=0)
