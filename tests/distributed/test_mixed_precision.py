"""Mixed precision through ``pretrain()``.

BF16: the model is built in bf16 (same fp32 initial values, rounded), the optimizer keeps fp32 master weights and
the DDP buffers accumulate fp32 gradients. Over 10 Adam steps the losses at TP 2 (+SP), PP 2, DP 2 and DP 2 with
the distributed optimizer match the one-process bf16 run within BF16_TOL, and the one-process fp32 run within the
looser FP32_TOL. Why those numbers: every bf16 rounding has relative error <= 2**-9 ~ 2e-3; a different layout
changes the order of the (fp32-accumulated) reductions, so individual bf16 values flip by one ulp, and averaged
over the tokens of a loss computed in fp32 from bf16 logits the loss moves by a few 1e-5 relative (measured max
4e-5: TP 2 + SP); the bf16-vs-fp32 gap is the rounding of every weight, activation and gradient (measured
7e-5 to 1e-4 after 10 steps). The tolerances are ~5x the measured values.

A DeepSeek-style multi-latent-attention model (q and kv latents, RoPE; 2 layers, 6 steps) at TP 2 + SP matches its
one-process run in bf16 (BF16_TOL; measured 2.2e-5) and under emulated FP8 (hybrid) within FP8_LAYOUT_TOL: every
linear is cast with the one-process run's scales, the amaxes being max-reduced over TP (without that reduction the
losses move by 4e-5 relative; FP8 against fp32 by 8e-5). FP8 losses may drift a little: an fp32 reduction-order
difference that moves one element across an FP8 rounding boundary changes it by an FP8 step, and the updates carry
that on (measured 1e-7 relative here; 3.5e-6 over 10 steps of 4 layers).

FP16: with a too-large initial loss scale the first steps overflow, are skipped (parameters untouched, LR
schedule not advanced) and back the scale off as the rule says; the log record counts them. FP8: a small model
trains with falling loss under ``--fp8-format hybrid`` and the amax histories are filled.
"""
import json

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

ITERS = 10
BF16_TOL = 2e-4  # relative, bf16 layouts vs the bf16 one-process run (measured max 4e-5)
FP32_TOL = 5e-4  # relative, bf16 vs fp32 (measured ~1e-4)
FP8_LAYOUT_TOL = 1e-5  # relative, FP8 TP 2 + SP vs FP8 at one process (measured 1e-7; without the amax max 4e-5)
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--seed", "5", "--micro-batch-size", "2"]
MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm", "--num-layers", "2", "--train-iters", "6"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _run(argv, world, metrics=None):
    groups.destroy_model_parallel()
    extra = ["--metrics-file", metrics] if metrics else []
    result = pretrain(configs_from_args(parse_args(BASE + argv + extra), world))
    state, ctx = result.state, result.context
    out = {"losses": [loss for _, loss in state.history]}
    out["model_dtypes"] = sorted({str(p.dtype) for m in ctx.models for p in m.parameters()})
    out["main_dtypes"] = sorted({str(s.main.dtype) for s in ctx.optimizer.slots})
    out["grad_dtypes"] = sorted({str(c.grad_buffer.dtype) for c in ctx.chunks})
    out["main_is_copy"] = all(s.main.data_ptr() != s.model.data_ptr() for s in ctx.optimizer.slots)
    out["master_rounds_to_model"] = all(
        torch.equal(s.main.detach().to(s.model.dtype),
                    s.model.detach() if s.whole else s.model.detach().view(-1)[s.lo:s.hi])
        for s in ctx.optimizer.slots)
    if ctx.fp8 is not None:
        out["fp8_amax"] = [float(s.amax_history.max()) for _, s in ctx.fp8.states()]
    return out


def _worker(rank, world, cases):
    return {name: _run(argv, world) for name, argv in cases.items()}


def _rel(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item()


@pytest.fixture(scope="module")
def single():
    return run_distributed(_worker, 1, {"fp32": [], "bf16": ["--bf16"], "fp8": ["--fp8-format", "hybrid"],
                                        "mla-bf16": ["--bf16"] + MLA, "mla-fp8": ["--fp8-format", "hybrid"] + MLA})[0]


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_worker, 2, {
        "dp2": ["--bf16"], "dp2-distopt": ["--bf16", "--use-distributed-optimizer"],
        "pp2": ["--bf16", "--pipeline-model-parallel-size", "2"], "tp2-sp": ["--bf16"] + TP2_SP,
        "mla-tp2-sp": ["--bf16"] + MLA + TP2_SP, "mla-tp2-sp-fp8": ["--fp8-format", "hybrid"] + MLA + TP2_SP})


def test_bf16_single_process(single):
    bf, fp = single["bf16"], single["fp32"]
    assert bf["model_dtypes"] == ["torch.bfloat16"]
    assert bf["main_dtypes"] == ["torch.float32"] and bf["grad_dtypes"] == ["torch.float32"] and bf["main_is_copy"]
    assert bf["master_rounds_to_model"]  # the model holds the rounded fp32 master weights after every step
    assert fp["main_dtypes"] == ["torch.float32"] and not fp["main_is_copy"]  # fp32: no extra copy
    assert bf["losses"][0] == pytest.approx(fp["losses"][0], rel=FP32_TOL)  # same initial values, rounded
    assert _rel(bf["losses"], fp["losses"]) < FP32_TOL, (bf["losses"], fp["losses"])
    assert bf["losses"] != fp["losses"]  # really computed in bf16
    assert bf["losses"][-1] < bf["losses"][0] - 0.05


def test_bf16_layouts_match_single_process(single, two_ranks):
    for name, ref_name in (("dp2", "bf16"), ("dp2-distopt", "bf16"), ("pp2", "bf16"), ("tp2-sp", "bf16"),
                           ("mla-tp2-sp", "mla-bf16")):
        got, ref = two_ranks[0][name], single[ref_name]["losses"]
        assert got["main_dtypes"] == ["torch.float32"] and got["model_dtypes"] == ["torch.bfloat16"], name
        assert got["master_rounds_to_model"], name
        assert _rel(got["losses"], ref) < BF16_TOL, (name, _rel(got["losses"], ref), got["losses"], ref)
        if ref_name == "bf16":
            ref32 = single["fp32"]["losses"]
            assert _rel(got["losses"], ref32) < FP32_TOL, (name, got["losses"], ref32)
        for r in two_ranks[1:]:
            assert r[name]["losses"] == got["losses"]  # every rank reports the same loss
    mla = single["mla-bf16"]["losses"]
    assert mla[-1] < mla[0] - 0.05 and single["mla-bf16"]["model_dtypes"] == ["torch.bfloat16"], mla


def test_mla_fp8_tp2_sp_matches_single_process(single, two_ranks):
    ref, got = single["mla-fp8"], two_ranks[0]["mla-tp2-sp-fp8"]
    # FP8 in use: the query/key-value up-projections, the output projection and the MLP's two linears of each of the
    # 2 layers keep amax histories of their input, weight and output gradient (the replicated down-projections run
    # in high precision)
    assert len(ref["fp8_amax"]) == len(got["fp8_amax"]) == 2 * 5 * 3 and min(got["fp8_amax"]) > 0
    assert _rel(got["losses"], ref["losses"]) < FP8_LAYOUT_TOL, (got["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, ref["losses"]


def test_fp8_hybrid_trains_through_pretrain(single):
    fp8, fp = single["fp8"], single["fp32"]
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.05, fp8["losses"]
    assert fp8["losses"][0] == pytest.approx(fp["losses"][0], rel=1e-3)  # first forward: FP8 error only
    assert _rel(fp8["losses"], fp["losses"]) < 5e-3  # measured 4e-4
    assert fp8["losses"] != fp["losses"]
    assert len(fp8["fp8_amax"]) == 4 * 4 * 3 and min(fp8["fp8_amax"]) > 0  # 4 layers x 4 linears x 3 tensors


def _fp16_worker(rank, world, metrics):
    return _run(["--fp16", "--initial-loss-scale", str(2.0 ** 24), "--train-iters", str(FP16_ITERS)], world, metrics)


FP16_ITERS = 16


def test_fp16_overflow_skips_and_backs_off(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    out = run_distributed(_fp16_worker, 1, metrics)[0]
    records = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in records] == list(range(1, FP16_ITERS + 1))
    skipped = [r["skipped_iterations"] for r in records]
    overflow = [b - a for a, b in zip([0] + skipped, skipped)]
    assert set(overflow) <= {0, 1} and 2 <= sum(overflow) < FP16_ITERS - 3, skipped  # 2**24 overflows fp16
    assert overflow[:2] == [1, 1]
    # the recorded scale follows the rule replayed on the observed overflows (hysteresis 2, window 1000)
    scale, hyst, expected = 2.0 ** 24, 2, []
    for inf in overflow:
        if inf:
            hyst -= 1
            if hyst <= 0:
                scale = max(scale / 2, 1.0)
        expected.append(scale)
    assert [r["loss_scale"] for r in records] == expected
    assert expected[0] == 2.0 ** 24 and expected[1] == 2.0 ** 23  # first overflow absorbed by the hysteresis
    assert [r["grad_norm"] is None for r in records] == [bool(x) for x in overflow]
    # a skipped step does not advance the LR schedule
    first_ok = overflow.index(0)
    assert records[first_ok]["lr"] == pytest.approx(3e-3 / 2, rel=1e-6)  # warm-up step 1 of 2
    for i in range(1, FP16_ITERS):
        if overflow[i]:
            assert records[i]["lr"] == records[i - 1]["lr"]
    assert out["main_dtypes"] == ["torch.float32"] and out["model_dtypes"] == ["torch.float16"]
    assert out["grad_dtypes"] == ["torch.float16"]  # Megatron's fp16 default: no fp32 accumulation
    assert out["master_rounds_to_model"]
    assert out["losses"][-1] < out["losses"][0] - 0.02
