"""The planner's per-rank bytes against the real run's: for many layouts (dense GPT-2 and Llama, MoE with EP and
ETP, CP, PP and VP, FSDP2, the distributed optimizer, 16-bit, recompute, multi-latent attention with DeepSeek's
MoE (shared experts, sigmoid router with expert bias, dense first layer) and multi-token prediction (with the loss
under TP 2 + SP, and on a standalone MTP stage), MLA over a CP 2 ring, the zbv pipeline whose V puts the loss on
rank 0) the
parameters, gradients and optimizer state that ``setup`` builds on 4 gloo ranks and one ``train_step`` fills
(distinct storages) equal the bytes the planner counts on the rank's meta model exactly, and one step's saved
activations (``saved_tensors_hooks``) are within 10% of its activation prediction (the CPU terms). The bytes of
every collective kind the second step issues (counted on ``comm_log``'s records) equal the planner's count exactly
(``planner/comms.py``; FSDP2's own collectives run inside torch and fp16's first steps skip on overflow, so those
layouts are left out). All layouts run in one worker group."""
import io
import math
from contextlib import contextmanager, redirect_stdout

import pytest

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import run_distributed

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "100", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval",
        "100", "--seed", "3"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-expert-capacity-factor", "1.0",
       "--moe-pad-expert-input-to-capacity", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--position-embedding-type", "rope"]
DEEPSEEK_MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-layer-freq", "[0,1,1,1]", "--swiglu", "--normalization",
                "RMSNorm", "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1"]
TP, PP, CP, DP_OPT = "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size", \
    "--use-distributed-optimizer"
LAYOUTS = {
    "gpt2 dp4 fp32": ["--num-layers", "2"],
    "gpt2 dp4 bf16": ["--num-layers", "2", "--bf16"],
    "gpt2 dp4 bf16 dist-opt": ["--num-layers", "2", "--bf16", DP_OPT],
    "gpt2 dp4 fp16 dist-opt": ["--num-layers", "2", "--fp16", DP_OPT],
    "gpt2 tp4 sp": ["--num-layers", "2", TP, "4", "--sequence-parallel"],
    "gpt2 sgd bf16-grads": ["--num-layers", "2", "--bf16", "--optimizer", "sgd", "--grad-reduce-in-bf16"],
    "llama tp2 dp2 sp bf16": ["--num-layers", "2", *LLAMA, TP, "2", "--sequence-parallel", "--bf16"],
    "llama tp2 selective": ["--num-layers", "2", *LLAMA, TP, "2", "--recompute-granularity", "selective"],
    "llama pp2 dp2 dist-opt": ["--num-layers", "4", *LLAMA, PP, "2", DP_OPT, "--bf16"],
    "llama pp4": ["--num-layers", "4", *LLAMA, PP, "4"],
    "llama pp2 vp2 dp2": ["--num-layers", "4", *LLAMA, PP, "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "gpt2 pp2 tp2 full recompute": ["--num-layers", "4", PP, "2", TP, "2", "--recompute-granularity", "full",
                                    "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "gpt2 pp2 tied dist-opt": ["--num-layers", "2", PP, "2", DP_OPT],
    "llama cp2 dp2": ["--num-layers", "2", *LLAMA, CP, "2", "--attention-dropout", "0"],
    "llama cp2 tp2 bf16": ["--num-layers", "2", *LLAMA, CP, "2", TP, "2", "--bf16", "--attention-dropout", "0"],
    "llama dp4 no-dropout": ["--num-layers", "2", *LLAMA, "--attention-dropout", "0"],
    "llama tp2 sp no-dropout bf16": ["--num-layers", "2", *LLAMA, TP, "2", "--sequence-parallel", "--bf16",
                                     "--attention-dropout", "0"],
    "moe ep4": ["--num-layers", "2", *MOE, "--expert-model-parallel-size", "4"],
    "moe ep2 dp2 bf16 dist-opt": ["--num-layers", "2", *MOE, "--expert-model-parallel-size", "2", "--bf16", DP_OPT],
    "moe tp2 ep2 etp1": ["--num-layers", "2", *MOE, TP, "2", "--sequence-parallel", "--expert-model-parallel-size",
                         "2", "--expert-tensor-parallel-size", "1"],
    "moe llama tp2 etp2": ["--num-layers", "2", *LLAMA, *MOE, TP, "2", "--sequence-parallel"],
    "mla deepseek-moe pp2 ep2": ["--num-layers", "4", *MLA, *DEEPSEEK_MOE, PP, "2", "--expert-model-parallel-size",
                                 "2"],
    "mtp llama pp2 dp2": ["--num-layers", "2", *LLAMA, "--mtp-num-layers", "2", PP, "2"],
    # the depths' TP collectives (look-up, eh_proj, output layer, cross entropy) with the loss
    "mtp llama tp2 pp2 sp": ["--num-layers", "2", *LLAMA, "--mtp-num-layers", "1", PP, "2", TP, "2",
                             "--sequence-parallel"],
    # a standalone MTP stage (Megatron-LM's DeepSeek-V3 layout's shape): the depths, the final norm and an
    # embedding copy on stage 2, two-block messages from it on, each depth's logits and loss on stage 3
    # ... beside a decoder chunk: interleaved chunks of unequal size (the embedding's and the MTP stage on rank 0)
    "mtp llama tp2 pp2 vp2 standalone": ["--num-layers", "2", *LLAMA, "--mtp-num-layers", "1", PP, "2", TP, "2",
                                         "--sequence-parallel", "--pipeline-model-parallel-layout", "Et|t|m|L"],
    "mtp llama pp4 standalone": ["--num-layers", "2", *LLAMA, "--mtp-num-layers", "1", PP, "4",
                                 "--pipeline-model-parallel-layout", "Et|t|m|L"],
    "mla cp2 dp2": ["--num-layers", "2", *MLA, CP, "2", "--cp-comm-type", "p2p", "--attention-dropout", "0"],
    "gpt2 pp2 tp2 sp zbv tied": ["--num-layers", "4", PP, "2", TP, "2", "--sequence-parallel", "--pipeline-schedule",
                                 "zbv"],
    "fsdp dp4 fp32": ["--num-layers", "2", "--use-torch-fsdp2"],
    "fsdp dp4 bf16 llama": ["--num-layers", "2", *LLAMA, "--use-torch-fsdp2", "--bf16"],
    "fsdp tp2 dp2": ["--num-layers", "2", TP, "2", "--use-torch-fsdp2"],
}
WORLD = 4


def _cfg(argv):
    return configs_from_args(parse_args(BASE + argv), WORLD)


def _storages(tensors) -> dict:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _measure_one(argv):
    import torch

    from megatronish.parallel.fsdp import local_shard
    from megatronish.training import pretrain as training
    from megatronish.training.memory import measured_state_bytes

    groups.destroy_model_parallel()
    cfg = _cfg(argv)
    with redirect_stdout(io.StringIO()):
        run, state = training.setup(cfg)
        training.train_step(run, state)
        counted = {}
        with _counting(counted):
            training.train_step(run, state)
    params = [local_shard(p) for c in run.chunks for p in getattr(c, "module", c).parameters()]
    grads = [local_shard(g) for c in run.chunks for p in getattr(c, "module", c).parameters()
             for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    inner = run.optimizer.optimizer
    opt = [p.detach() for g in inner.param_groups for p in g["params"]]
    opt += [t for g in inner.param_groups for p in g["params"] for t in inner.state.get(p, {}).values()
            if torch.is_tensor(t)]
    sp, sg = _storages(params), _storages(grads)
    so = {k: v for k, v in _storages(opt).items() if k not in sp and k not in sg}
    return {"params": sum(sp.values()), "grads": sum(sg.values()), "optimizer": sum(so.values()),
            "total": measured_state_bytes(run.chunks, run.optimizer), "activations": run.memory.measured,
            "collectives": counted}


@contextmanager
def _counting(out: dict):
    """Bytes per collective kind of every call this process records while inside (``planner/comms.py``'s
    convention: an all-gather counts its output, a point-to-point exchange what it sends)."""
    from megatronish.parallel import comm_log
    from megatronish.planner.comms import KIND_OF

    log = comm_log.log()
    record = log.record

    def counting(kind, group, tensors):
        n = len(log._group(group)[1])
        nbytes = 0
        for t in tensors:
            if isinstance(t, str):
                continue
            if len(t) == 3:  # (op, peer, tensor)
                nbytes += t[2].numel() * t[2].element_size() if t[0] == "send to" else 0
            else:
                nbytes += math.prod(t[0]) * t[1].itemsize
        name = KIND_OF.get(kind, kind)
        if name == "all_gather":
            nbytes *= n
        out[name] = out.get(name, 0) + nbytes
        return record(kind, group, tensors)

    log.record = counting
    try:
        yield
    finally:
        del log.record


def _worker(rank, world, names):
    return {name: _measure_one(LAYOUTS[name]) for name in names}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_worker, WORLD, list(LAYOUTS), timeout=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_bytes_are_exact(measured, name):
    from megatronish.planner.state import rank_state_bytes

    cfg = _cfg(LAYOUTS[name])
    for rank in range(WORLD):
        m = measured[rank][name]
        p = rank_state_bytes(cfg, rank)
        got = {"params": p.params, "grads": p.grads, "optimizer": p.optimizer, "total": p.total}
        assert got == {k: m[k] for k in got}, f"rank {rank}: predicted {got}, measured {m}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_activation_bytes_within_ten_percent(measured, name):
    from megatronish.planner.activations import stage_activations

    cfg = _cfg(LAYOUTS[name])
    for rank in range(WORLD):
        got = measured[rank][name]["activations"]
        predicted = stage_activations(cfg, cfg.parallel.coords(rank)["pp"], cpu=True).total
        assert got == pytest.approx(predicted, rel=0.10), f"rank {rank}: measured {got}, predicted {predicted}"


COMM_LAYOUTS = [n for n in LAYOUTS if "fsdp" not in n and "fp16" not in n]


@pytest.mark.parametrize("name", COMM_LAYOUTS)
def test_collective_bytes_are_exact(measured, name):
    from megatronish.planner.comms import bytes_by_kind, rank_collectives

    cfg = _cfg(LAYOUTS[name])
    for rank in range(WORLD):
        got = measured[rank][name]["collectives"]
        predicted = bytes_by_kind(rank_collectives(cfg, rank))
        assert got == predicted, f"rank {rank}: measured {got}, predicted {predicted}"
