"""The memory report: Megatron's bytes-per-parameter table, the Korthikanti et al. activation formulas, and the
saved-activation bytes measured per transformer layer with the saved-tensor hooks.

Margins. The formula assumes 16-bit activations and 1-byte dropout masks, so the layers run in bf16. Measured
bytes exceed the formula for three reasons this implementation has on CPU (tensor by tensor, see
``memory.cpu_activation_bytes_per_layer``): CPU dropout keeps 2-byte masks, under SP the QKV/FC1 linears keep the
gathered input instead of re-gathering it in backward, and the CPU SDPA math kernel keeps fp32 copies of q, k, v
and fp32 probabilities/mask/dropped probabilities. The measurement must equal formula + those deviations within
1% (measured: 0.1-0.5%; what is left is LayerNorm mean/rstd, 2 bytes per token each), and, against the pure
formula: within +25% with selective recompute (SP + selective: measured 40 vs 34 units of s*b*h/t), and within 2x
without (the fp32 attention scores: 12 bytes per score where the formula has 5).
"""
import pytest
import torch

from megatronish.config import gpt2
from megatronish.testing import run_distributed
from megatronish.training.memory import (
    SavedActivationCounter,
    activation_bytes,
    activation_bytes_per_layer,
    bytes_per_parameter,
    cpu_activation_bytes_per_layer,
    interleave_factor,
)

S, B, H, A = 128, 2, 64, 4


def test_bytes_per_parameter_table():
    f32, bf, f16 = torch.float32, torch.bfloat16, torch.float16
    assert bytes_per_parameter(f32, f32) == 16
    assert bytes_per_parameter(bf, f32) == 18
    assert bytes_per_parameter(f16, f16) == 20
    for d in (1, 2, 8, 64):
        assert bytes_per_parameter(f32, f32, distributed=True, dp=d) == pytest.approx(8 + 8 / d)
        assert bytes_per_parameter(bf, f32, distributed=True, dp=d) == pytest.approx(6 + 12 / d)
        assert bytes_per_parameter(f16, f16, distributed=True, dp=d) == pytest.approx(4 + 16 / d)
    assert bytes_per_parameter(f32, f32, optimizer="sgd", sgd_momentum=0.9) == 12
    assert bytes_per_parameter(f32, f32, optimizer="sgd", sgd_momentum=0.0) == 8


def test_activation_formulas():
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t=8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True) == pytest.approx(
        sbh / 8 * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True, recompute="selective") == \
        pytest.approx(34 * sbh / 8)
    assert activation_bytes_per_layer(s, b, h, a, t=8, recompute="selective") == pytest.approx(sbh * (10 + 24 / 8))
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True, recompute="full") == 2 * sbh / 8
    # Llama-3-8B-like layer: GQA with 8 groups of 128 (kv = 1024) and a SwiGLU FFN of 14336, term by term in
    # bytes per s*b*h: replicated 10; sharded Q 2 + K 2*kv/h + V 2*kv/h + projection input 2, SwiGLU input
    # (gate and up) 2*2f/h, FC2 input 2f/h.
    kv, f = 1024, 14336
    sharded = 2 + 2 * kv / h + 2 * kv / h + 2 + 4 * f / h + 2 * f / h
    assert activation_bytes_per_layer(s, b, h, a, t=8, ffn_hidden_size=f, kv_hidden_size=kv, swiglu=True) == \
        pytest.approx(sbh * (10 + sharded / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, ffn_hidden_size=4 * h, kv_hidden_size=h) == \
        activation_bytes_per_layer(s, b, h, a)
    assert interleave_factor(4, 1) == 1 and interleave_factor(4, 2) == pytest.approx(1 + 3 / 8)
    # whole first stage: L layers' worth (p microbatches of L/p layers), times the interleave factor
    cfg = gpt2(num_layers=8, hidden_size=h, num_attention_heads=a, vocab_size=1000, seq_length=s)
    per = activation_bytes_per_layer(s, b, h, a, t=2, sequence_parallel=True)
    extra = (8 * s * b + s * b * h / 2) * 4
    assert activation_bytes(cfg, micro_batch_size=b, tp=2, pp=4, sequence_parallel=True, num_microbatches=8) == \
        pytest.approx(per * 8 + extra)
    assert activation_bytes(cfg, micro_batch_size=b, tp=2, pp=4, vp=2, sequence_parallel=True,
                            num_microbatches=8) == pytest.approx((per * 2 + 8 * s * b + s * b * h / 2) * 4 * 1.375)

    # an uneven split: the first rank's own layer count, with its p microbatches in flight
    assert activation_bytes(cfg, micro_batch_size=b, tp=2, pp=4, sequence_parallel=True, num_microbatches=8,
                            stage_layers=(1, 3)) == pytest.approx(per * 1 * 4 + extra)


def test_theoretical_memory_reads_the_uneven_first_stage():
    """``--decoder-first-pipeline-num-layers`` (and a layout string) change the first stage's activations: the
    report reads the rank's layers from the one per-stage source, not ``L / p``."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.training.memory import theoretical_memory

    base = ["--num-layers", "7", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
            "--lr", "1e-3", "--pipeline-model-parallel-size", "2"]
    acts = {}
    for name, extra in [("first 3", ["--decoder-first-pipeline-num-layers", "3"]),
                        ("first 5", ["--decoder-first-pipeline-num-layers", "5"]),
                        ("layout", ["--pipeline-model-parallel-layout", "Et*5|t*2L"])]:
        cfg = configs_from_args(parse_args(base + extra), 2)
        acts[name] = theoretical_memory(cfg, 1000)["activations"]
    m = cfg.model
    per = activation_bytes_per_layer(32, 2, 64, 4, ffn_hidden_size=m.ffn_hidden_size,
                                     kv_hidden_size=m.num_query_groups * m.kv_channels, swiglu=m.swiglu)
    assert acts["first 5"] - acts["first 3"] == pytest.approx(2 * per * 2)  # two more layers, 2 microbatches each
    assert acts["layout"] == pytest.approx(acts["first 5"])


def _report_cfg(extra, world=4, layers=8):
    from megatronish.arguments import configs_from_args, parse_args

    base = ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "1000", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--attention-dropout", "0", "--hidden-dropout", "0"]
    return configs_from_args(parse_args(base + extra), world)


def test_report_walks_each_schedule_on_every_pipeline_rank():
    """The run's report walks its schedule on every pipeline rank (``pipeline_activation_bytes``): for 1F1B its
    first rank is Megatron's closed form, for interleaving too but for which chunks hold the embedding; ZB-H1 and
    ZBV hold their own microbatches (and the split backward's deferred weight-gradient inputs,
    ``deferred_weight_bytes``); a layout's standalone MTP stage holds the depths where they run."""
    from megatronish.training.memory import (
        _activation_terms,
        deferred_weight_bytes,
        pipeline_activation_bytes,
        theoretical_memory,
    )

    def terms(cfg):
        par = cfg.parallel
        return _activation_terms(cfg.model, micro_batch_size=2, tp=par.tp, cp=par.cp,
                                 sequence_parallel=cfg.sequence_parallel, padded_vocab_size=None, scores=True)

    pp4 = ["--pipeline-model-parallel-size", "4", "--global-batch-size", "16"]  # 8 microbatches
    one = _report_cfg(pp4)
    layer, emb, out, depth = terms(one)
    closed = dict(micro_batch_size=2, pp=4, num_microbatches=8)
    peaks = pipeline_activation_bytes(one)
    assert peaks[0] == pytest.approx(activation_bytes(one.model, **closed))  # p microbatches of L/p layers
    assert peaks == pytest.approx([4 * (2 * layer + emb), 3 * 2 * layer, 2 * 2 * layer, 2 * layer + out])
    # interleaved (v 2, one layer a chunk): rank 0 holds 11 chunk-microbatches at its peak, as the closed form's
    # 4 x 1.375 stages, but 8 of them are stage 0's, with the embedding's tensors (the closed form: 5.5)
    inter = _report_cfg(pp4 + ["--num-layers-per-virtual-pipeline-stage", "1"])
    assert activation_bytes(inter.model, vp=2, **closed) == pytest.approx(11 * layer + 5.5 * emb)
    assert pipeline_activation_bytes(inter)[0] == pytest.approx(11 * layer + 8 * emb)
    assert theoretical_memory(inter, 1000)["fullest_pp_rank"] == 0

    # ZB-H1 at p 2, m 4, rank 0: F F B F B W F B W W B W. With H (a microbatch's layers) larger than D (its
    # deferred tensors) the peak is after the second F: 2 H + D (rank 1, the loss's: F B F B W ...: H + 2 D at most)
    zbh1 = _report_cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                        "--pipeline-schedule", "zb-h1"], world=2, layers=2)
    layer, emb, out, _ = terms(zbh1)
    d0, d1 = (deferred_weight_bytes(zbh1, [i], loss_stage=i == 1, itemsize=2) for i in (0, 1))
    h0, h1 = layer + emb, layer + out
    assert d0 < h0 and d1 < h1
    assert pipeline_activation_bytes(zbh1) == pytest.approx([2 * h0 + d0, max(h1 + d1, 2 * d1)])
    # ZBV at p 2, m 4: rank 0 holds stage 0 (the embedding) and stage 3 (the loss). F0 F0 F0 F1 B1 W1 ...: with the
    # loss's chunk the larger, the peak is three forwards of stage 0 and one of stage 3
    zbv = _report_cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                       "--pipeline-schedule", "zbv"], world=2, layers=4)
    layer, emb, out, _ = terms(zbv)
    h0, h3 = layer + emb, layer + out
    assert h3 > h0 and deferred_weight_bytes(zbv, [3], loss_stage=True, itemsize=2) < h3
    assert pipeline_activation_bytes(zbv)[0] == pytest.approx(3 * h0 + h3)
    # rank 1 (stages 1 and 2): F0 F1 F0 F1 B1 ...: four layers' microbatches at its peak
    assert pipeline_activation_bytes(zbv)[1] == pytest.approx(4 * layer)

    # DeepSeek-V3's kind of layout: the MTP depth on its own stage, before the loss's (1F1B: p - r in flight)
    mtp = _report_cfg(pp4 + ["--pipeline-model-parallel-layout", "Et*4|t*4|m|L", "--mtp-num-layers", "1",
                             "--position-embedding-type", "rope"])
    layer, emb, out, depth = terms(mtp)
    assert pipeline_activation_bytes(mtp) == pytest.approx([4 * (4 * layer + emb), 3 * 4 * layer, 2 * depth,
                                                            2 * out])


def _measure(rank, world):
    from megatronish.model.transformer import TransformerLayer
    from megatronish.parallel import groups
    from megatronish.parallel.dims import ParallelDims
    from megatronish.parallel.random import set_random_seed

    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=world))
    set_random_seed(1, 0, ctx.tp_rank)
    t, out = world, {}
    for name, sp, rec in [("no SP", False, None), ("SP", True, None), ("SP + selective", True, "selective"),
                          ("selective", False, "selective")]:
        if t == 1 and sp:
            continue
        cfg = gpt2(num_layers=2, hidden_size=H, num_attention_heads=A, vocab_size=96, seq_length=S,
                   recompute_granularity=rec, attention_dropout=0.1, hidden_dropout=0.1)
        layer = TransformerLayer(cfg, 0, sp and t > 1, torch.bfloat16, parallel=ctx).train()
        x = torch.randn(S // t if sp else S, B, H, dtype=torch.bfloat16, requires_grad=True)
        with SavedActivationCounter(layer.parameters()) as counter:
            y = layer(x)
        during = counter.current
        y.float().sum().backward()
        del y
        out[name] = (counter.peak, during, counter.current)
    return out


@pytest.mark.parametrize("t", [1, 2])
def test_measured_saved_activations_per_layer(t, capsys):
    measured = run_distributed(_measure, t)[0]
    rows = []
    for name, (peak, during, after) in measured.items():
        sp, rec = name.startswith("SP"), "selective" if "selective" in name else None
        formula = activation_bytes_per_layer(S, B, H, A, t=t, sequence_parallel=sp, recompute=rec)
        adjusted = cpu_activation_bytes_per_layer(S, B, H, A, t=t, sequence_parallel=sp, recompute=rec)
        rows.append(f"t={t} {name:15s} measured {peak:9d} B  formula {formula:9.0f} B  ratio {peak / formula:.3f}"
                    f"  (with CPU deviations {adjusted:9.0f} B, ratio {peak / adjusted:.3f})")
        assert peak == during and after == 0  # peak right after the forward; everything released by backward
        assert peak == pytest.approx(adjusted, rel=0.01), rows[-1]
        assert formula <= peak <= (1.25 if rec else 2.0) * formula, rows[-1]
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_report_leaves_out_the_scores_a_flash_type_core_does_not_keep():
    """The report's activations drop Korthikanti's ``5 a s / h`` where the attention core keeps no score matrix:
    the term is exactly the difference, and the core's kind follows the backend and the device."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.model.attention import attention_core_kind
    from megatronish.training.memory import theoretical_memory

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--lr", "1e-3"]
    acts, kinds = {}, {}
    for drop in ("0", "0.1"):
        for backend in ("auto", "unfused", "local"):
            cfg = configs_from_args(parse_args(base + ["--attention-dropout", drop, "--attention-backend", backend]),
                                    1)
            kinds[drop, backend] = (attention_core_kind(cfg.model, 1, "cpu"), attention_core_kind(cfg.model, 1, "cuda"),
                                    attention_core_kind(cfg.model, 2, "cpu"))
            acts[drop, backend] = theoretical_memory(cfg, 1000)["activations"]
    assert kinds["0", "auto"] == ("flash", "flash", "flash") and kinds["0.1", "auto"] == ("math", "flash", "flash")
    assert kinds["0", "unfused"][:2] == ("math", "math") and kinds["0.1", "local"][:2] == ("local", "local")
    scores = 5 * 4 * 32 / 64 * 32 * 2 * 64 * 2  # 5 a s / h * s b h, two layers (one stage, one microbatch)
    assert acts["0.1", "auto"] - acts["0", "auto"] == pytest.approx(scores)
    assert acts["0", "unfused"] == acts["0.1", "auto"] == acts["0", "local"]


def test_report_counts_multi_latent_attention_tensors():
    """With ``--multi-latent-attention`` the report's per-layer activations hold MLA's query ``a (d_nope + d_rope)``,
    key ``a (d_nope + d_rope)``, key/value up-projection output ``a (d_nope + d_v)`` and projection input
    ``a d_v`` (16-bit, over TP) in place of the formula's ``h, kv, kv, h``, plus the replicated latents: the query
    latent and its norm's output, the key/value down-projection's output and the key/value norm's output."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.training.memory import activation_bytes

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--lr", "1e-3", "--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    mla = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
           "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--qk-layernorm"]
    got = {}
    for name, extra in [("gqa", []), ("mla", mla)]:
        m = configs_from_args(parse_args(base + extra), 1).model
        got[name] = activation_bytes(m, micro_batch_size=2, tp=2, sequence_parallel=True)
    s, b, h, a, t = 32, 2, 64, 4, 2
    attention = 2 * (a * 20 + a * 20 + a * 22 + a * 10 - 2 * h - 2 * h) * s * b / t
    latents = (2 * 24 * 2 + 2 * (16 + 8) + 2 * 16) * s * b / t  # replicated, over TP under SP
    assert got["mla"] - got["gqa"] == pytest.approx(2 * (attention + latents))  # two layers
