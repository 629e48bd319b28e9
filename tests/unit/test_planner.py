"""``megatronish-plan``: every problem of a layout at once (the real launch's validation with the given world
size), the plan's memory per stage (state bytes equal the meta model's count, stages differ as the layout says),
``--hardware-file`` overrides, and the step-time model's pieces."""
import json

import pytest

from megatronish.planner.cli import main, plan_from_argv
from megatronish.planner.hardware import GPUS, load_hardware

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--train-iters", "10", "--lr", "1e-4", "--bf16"]


def test_every_problem_at_once(capsys):
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--world-size", "8", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                     "--fp16"])
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 2 and "--num-attention-heads 3" in lines[0] and "--fp16 and --bf16" in lines[1], lines


def test_plan_json_and_stages(capsys):
    main(BASE + ["--world-size", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--use-distributed-optimizer", "--json"])
    plan = json.loads(capsys.readouterr().out)
    first, last = plan["stages"]
    assert plan["layout"]["dp"] == 2 and first["in_flight"] == 2 and last["in_flight"] == 1
    assert first["activations"] > last["activations"] - last["activations_output"]
    assert plan["time"]["step_s"] > 0 and 0 < plan["time"]["mfu"] < 1
    assert plan["time"]["comm_bytes"]["reduce_scatter"] > 0 and "p2p" in plan["time"]["comm_bytes"]


def test_hardware_file_overrides(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('base = "H100-SXM"\nhbm_gib = 96\nhbm_tbps = 2.4\n[peak_tflops]\nbf16 = 800\n')
    hw = load_hardware("A100-80G", 4, str(f))
    assert (hw.hbm_gib, hw.hbm_tbps, hw.peak("bf16"), hw.gpus_per_node) == (96, 2.4, 800e12, 4)
    assert hw.peak("fp8") == GPUS["H100-SXM"].peak("fp8")


def test_plot_and_cpu_probe(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    plan, _ = plan_from_argv(BASE + ["--world-size", "2", "--gpu", "cpu-this-machine", "--plot", str(out)])
    from megatronish.planner.plan import plot_plan

    assert plot_plan(plan, str(out)) and out.stat().st_size > 0
    assert plan["hardware"]["peak_bf16_tflops"] > 0


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
     "--use-distributed-optimizer"],
    ["--swiglu", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "4"],
    ["--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "2", "--sequence-parallel",
     "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-ffn-hidden-size", "32"],
])
def test_search_counts_parameters_as_the_meta_model(extra):
    """--search's analytic count equals the meta-device count of every stage's first and last rank."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.search import ParamTable, analytic_state
    from megatronish.planner.state import rank_state_bytes, stage_ranks

    cfg = configs_from_args(build_parser().parse_args(BASE + extra), 8)
    table = ParamTable(cfg)
    for stage, ranks in enumerate(stage_ranks(cfg.parallel)):
        for r in ranks:
            exact = rank_state_bytes(cfg, r)
            approx = analytic_state(cfg, table, stage)
            assert approx.num_params == exact.num_params, (stage, r)
            assert approx.total == pytest.approx(exact.total, rel=0.02), (stage, r)


def test_search_ranks_valid_layouts(capsys):
    main(BASE + ["--world-size", "8", "--search", "--search-top-k", "3"])
    out = capsys.readouterr().out
    assert "layouts enumerated" in out and out.count("against 1.:") >= 2 and "the given layout (TP1 PP1" in out
    assert sum(x[:2] in ("1.", "2.", "3.") for x in out.splitlines()) == 3


def test_search_with_a_stacks_choices_and_the_published_layout():
    """A layout is its degrees and micro-batch size, ranked at its best variant; torchtitan's choices: FSDP2 (no
    state sharding at DP 1), the DP rank's batch as one microbatch (under PP split into at least one microbatch
    per stage), its per-op selective policy, loss and pipeline runtime in the screened peak, which equals the plan's
    (meta-model state, the same activations and FSDP2 terms) within the analytic count's 2%; :func:`place` finds
    a run's layout at its rank in the distinct ranking."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.errors import ConfigError
    from megatronish.planner.plan import plan_inputs
    from megatronish.planner.search import (
        LAYOUT_FIELDS,
        MEGATRON,
        TORCHTITAN,
        ParamTable,
        candidates,
        describe,
        evaluate,
        format_search,
        layout_key,
        place,
        search,
    )

    llama = ["--swiglu", "--ffn-hidden-size", "128", "--normalization", "RMSNorm", "--position-embedding-type",
             "rope", "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0"]
    cfg = configs_from_args(build_parser().parse_args(BASE + llama + ["--use-torch-fsdp2", "--recompute-granularity",
                                                                      "selective"]), 8)
    hw = load_hardware("H100-SXM")
    tt = list(candidates(cfg, hw, TORCHTITAN))
    assert tt and len(tt) < len(list(candidates(cfg, hw, MEGATRON)))
    for c in tt:
        par, mbs = c.parallel, c.train.micro_batch_size
        per_rank, stages = 16 // par.dp, par.pp * par.vp
        assert c.fsdp_active == (par.dp * par.cp > 1) and not c.optim.use_distributed_optimizer
        assert (c.num_microbatches == 1) if par.pp == 1 else (c.num_microbatches >= stages and mbs * c.num_microbatches
                                                              == per_rank)
    table = ParamTable(cfg)
    for c in [x for x in tt if x.model.recompute.recompute_granularity == "selective"][:6]:
        got = evaluate(c, hw, table, TORCHTITAN, fit_only=False)["peak_bytes"]
        kw = dict(TORCHTITAN.activations, pipelining_outputs=c.parallel.pp > 1)
        stages = plan_inputs(c, hw, unsharded_grads=c.parallel.pp > 1, **kw)[0]
        assert got == pytest.approx(max(s["total"] for s in stages), rel=0.02), describe(c)
    res = search(cfg, hw, 3, TORCHTITAN)
    keys = [layout_key(r["cfg"]) for r in res["top"]]
    assert len(set(keys)) == 3 and [r["time"]["tokens_per_s_per_gpu"] for r in res["top"]] == \
        sorted((r["time"]["tokens_per_s_per_gpu"] for r in res["top"]), reverse=True)
    for i, r in enumerate(res["top"]):
        assert place(res, r["cfg"]) == (i + 1, r)
        best = max((x for x in res["ranked"] if layout_key(x["cfg"]) == keys[i]),
                   key=lambda x: x["time"]["tokens_per_s_per_gpu"])
        assert best["time"]["tokens_per_s_per_gpu"] == r["time"]["tokens_per_s_per_gpu"]
    _, entry = place(res, cfg, ("tp", "pp"))  # the run's TP 1 PP 1 at any CP, DP and micro-batch size
    assert entry is next(r for r in res["_layouts"] if layout_key(r["cfg"], ("tp", "pp")) == (1, 1))
    assert layout_key(cfg) == (1, 1, 1, 1, 1, 1, 8, 1) and LAYOUT_FIELDS[-1] == "mbs"
    # micro-batch 1 at DP 8 of a 16-sequence batch accumulates 2 microbatches: not among torchtitan's layouts
    text = format_search(res, hw, [("the run", cfg, LAYOUT_FIELDS), ("its degrees", cfg, ("tp", "pp", "dp"))])
    assert "the run (TP1 PP1 VP1 CP1 DP8 MBS1): not a layout of torchtitan's choices" in text
    assert f"its degrees (TP1 PP1 DP8): rank {place(res, cfg, ('tp', 'pp', 'dp'))[0]} of" in text
    moe = configs_from_args(build_parser().parse_args(BASE + ["--num-experts", "4", "--disable-bias-linear"]), 8)
    with pytest.raises(ConfigError, match="--search-stack torchtitan"):
        search(moe, hw, 3, TORCHTITAN)



@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_in_flight_and_bubble_follow_the_action_lists(schedule):
    """Each rank's most microbatches (zbv: chunk-microbatches) between a forward and its input-gradient step, and
    the bubble with equal step times, as the zero-bubble action lists have them (zb-h1's in-flight is 1F1B's)."""
    from megatronish.parallel.pipeline.zero_bubble import schedule_actions, simulate, stage_of
    from megatronish.planner.activations import in_flight
    from megatronish.planner.perf import bubble_fraction

    v = 2 if schedule == "zbv" else 1
    for p in (2, 3, 4, 5):
        for m in (1, 2, 3, p, p + 1, 2 * p + 1, 3 * p):
            lists = schedule_actions(schedule, p, m)
            for r, actions in enumerate(lists):
                alive = peak = 0
                for a in actions:
                    alive += (a.op == "F") - (a.op == "B")
                    peak = max(peak, alive)
                assert in_flight(p, v, r, m, schedule) == peak, (p, m, r)
                if schedule == "zb-h1":
                    assert in_flight(p, 1, r, m) == peak  # 1F1B's
            if m % p == 0 and (schedule == "zb-h1" or m >= 2 * p):  # the paper's closed form (ZB-V's for m >= 2p)
                sim = simulate(lists, lambda r, c: stage_of(schedule, p, r, c), p * v, {"F": 1, "B": 1, "W": 1})
                closed = (p - 1) / m / (3 if schedule == "zb-h1" else 6)
                assert bubble_fraction(p, v, m, schedule) == pytest.approx(closed, rel=1e-9) \
                    and sim["bubble"] == pytest.approx(closed, rel=1e-9), (p, m)


def test_uneven_stages_and_the_loss_stage_in_memory_and_time():
    """Per-stage layer counts come from ParallelDims (uneven first and last stages); the slowest stage sets the
    step's compute; under zbv the loss (and the MTP depths) sit on rank 0."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.activations import _layer, stage_activations
    from megatronish.planner.perf import stage_imbalance

    flags = BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
                    "1", "--decoder-last-pipeline-num-layers", "3", "--position-embedding-type", "rope"]
    cfg = configs_from_args(build_parser().parse_args(flags), 4)
    one = _layer(cfg, moe=False, cpu=False, recompute=None)
    for stage, n in enumerate((1, 2, 2, 3)):
        act = stage_activations(cfg, stage)
        assert act.layers == pytest.approx(n * one * act.in_flight, rel=1e-12)
        assert act.in_flight == min(cfg.num_microbatches, 4 - stage)
    share = 0.1
    work = [n * (1 - share) / 8 for n in (1, 2, 2, 3)]
    work[3] += share
    assert stage_imbalance(cfg, share) == pytest.approx(max(work) * 4 / sum(work), rel=1e-12)
    zbv = configs_from_args(build_parser().parse_args(
        BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                "--position-embedding-type", "rope", "--mtp-num-layers", "1"]), 2)
    first, other = stage_activations(zbv, 0), stage_activations(zbv, 1)
    assert first.output > 0 and other.output == 0 and first.embedding > 0
    assert first.in_flight == min(2 * zbv.num_microbatches, zbv.num_microbatches + 1, 4)


def test_mla_and_mtp_in_the_flops():
    """The time model's FLOPs are the training log's (MLA's and the MTP depths' terms, counted once) and its
    attention core uses MLA's head sizes over the layers and the depths."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.hardware import load_hardware
    from megatronish.planner.perf import attention_core_flops
    from megatronish.planner.plan import make_plan
    from megatronish.training.flops import num_floating_point_operations

    mla = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
           "--v-head-dim", "12", "--position-embedding-type", "rope", "--mtp-num-layers", "2"]
    cfg = configs_from_args(build_parser().parse_args(BASE + mla), 1)
    m, B = cfg.model, 4
    s, a = m.seq_length, m.num_attention_heads
    assert attention_core_flops(m, B) == 6.0 * B * s * s * a * (16 + 8 + 12) * (4 + 2)
    plan = make_plan(cfg, load_hardware("H100-SXM"))
    assert plan["time"]["flops_per_step"] == num_floating_point_operations(m, cfg.train.global_batch_size)


def _gpt_units(h: int, vocab_padded: int, seq: int, layers: int) -> list[int]:
    """A GPT's FSDP units by hand (biases, LayerNorm, learned positions, FFN 4h, untied output): the embedding
    (tokens and positions), each layer (two LayerNorms 2h each, QKV 3h x h + 3h, projection h x h + h, FC1
    4h x h + 4h, FC2 4h x h + h), the output layer, the root (the final LayerNorm)."""
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return [vocab_padded * h + seq * h] + [layer] * layers + [vocab_padded * h, 2 * h]


@pytest.mark.parametrize("world, extra", [
    (2, []), (2, ["fp32"]), (2, ["--fsdp-prefetch-layers", "2"]), (4, ["--pipeline-model-parallel-size", "2"])])
def test_fsdp_buffers_in_flight_are_a_term_of_the_peak(world, extra):
    """FSDP2's gathered units and one unit's unsharded gradient, against a hand count of the units: resharding
    after forward (no PP) the largest 1 + prefetch consecutive units in 16 bits, under PP the stage's every unit;
    plus the largest unit's 16-bit gradient and its fp32 copy for the reduce-scatter (bf16 reduces in fp32; an
    fp32 model has one fp32 gradient). The peak adds the term; the state bytes stay the exact count."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.hardware import load_hardware
    from megatronish.planner.plan import make_plan
    from megatronish.planner.report import rank0_prediction
    from megatronish.planner.search import ParamTable, analytic_fsdp_units
    from megatronish.planner.state import build_meta_chunks, fsdp_in_flight_bytes, fsdp_unit_numels

    fp32 = extra == ["fp32"]
    flags = [f for f in BASE if not (fp32 and f == "--bf16")] + ["--use-torch-fsdp2",
                                                                  "--untie-embeddings-and-output-weights"]
    cfg = configs_from_args(build_parser().parse_args(flags + ([] if fp32 else extra)), world)
    units = _gpt_units(64, 1024, 32, 4)
    pp = cfg.parallel.pp
    stage_units = units if pp == 1 else units[:3]  # PP 2: the embedding and layers 0-1 on stage 0
    _, models = build_meta_chunks(cfg, 0)
    assert fsdp_unit_numels(models) == stage_units
    assert analytic_fsdp_units(cfg, ParamTable(cfg), 0) == (stage_units[:-1] if pp == 1 else stage_units)  # no root
    e, red = (4, 0) if fp32 else (2, 4)
    window = 3 if "--fsdp-prefetch-layers" in extra else 2
    gathered = sum(units[:3]) if pp > 1 else max(sum(units[i:i + window]) for i in range(len(units)))
    expected = gathered * e + max(stage_units) * (e + red)
    assert fsdp_in_flight_bytes(cfg, stage_units) == expected
    if pp > 1:  # gradients kept unsharded in fp32 until the last microbatch, beside the largest unit's 16-bit one
        assert fsdp_in_flight_bytes(cfg, stage_units, unsharded_grads=True) == \
            gathered * 2 + sum(stage_units) * 4 + max(stage_units) * 2
    plan = make_plan(cfg, load_hardware("H100-SXM"))
    s0 = plan["stages"][0]
    assert s0["fsdp_in_flight"] == expected
    assert s0["total"] == s0["params"] + s0["grads"] + s0["optimizer"] + s0["activations"] + expected
    rank0 = rank0_prediction(cfg, cpu=False)  # --report-plan's rank-0 peak carries the same term
    assert rank0["fsdp_in_flight"] == expected
    assert rank0["peak"] == rank0["params"] + rank0["grads"] + rank0["optimizer"] + rank0["activations"] + expected
    ddp = configs_from_args(build_parser().parse_args(BASE), world)
    assert fsdp_in_flight_bytes(ddp, stage_units) == 0


def test_overlap_terms_of_the_step_time():
    """Asynchronous TP hides the forward passes' TP collectives (half of them, a third under full recompute);
    FSDP2 exposes its first gather and last reduce-scatter (one unit's share of the traffic each, of a stage's
    layers + 2 units) and hides the rest up to the compute; a hardware file's efficiencies are the step-time
    model's, as if passed by name."""
    import dataclasses

    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.perf import fsdp_exposed, step_time, tp_forward_share
    from megatronish.planner.state import rank_state_bytes

    parse = build_parser().parse_args
    assert tp_forward_share(configs_from_args(parse(BASE), 1)) == 0.5
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    assert tp_forward_share(configs_from_args(parse(BASE + full), 1)) == pytest.approx(1 / 3)
    cfg = configs_from_args(parse(BASE + ["--use-torch-fsdp2"]), 2)
    assert fsdp_exposed(cfg, 0.6, 100.0) == pytest.approx((2 * 0.6 / 6, 0.6 - 2 * 0.6 / 6))  # 4 layers + 2
    assert fsdp_exposed(cfg, 60.0, 10.0) == pytest.approx((50.0, 10.0))  # more than the compute: the rest shows
    hw = load_hardware("H100-SXM")
    state = rank_state_bytes(cfg, 0)
    own = dataclasses.replace(hw, efficiencies={"GEMM_EFFICIENCY": 0.3})
    assert step_time(cfg, own, state)["step_s"] == \
        pytest.approx(step_time(cfg, hw, state, efficiencies={"GEMM_EFFICIENCY": 0.3})["step_s"], rel=1e-12)
    assert step_time(cfg, own, state)["step_s"] > step_time(cfg, hw, state)["step_s"]


def test_hardware_file_efficiencies(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('base = "H100-SXM"\n[efficiencies]\nGEMM_EFFICIENCY = 0.6\n')
    assert load_hardware("H100-SXM", hardware_file=str(f)).efficiencies == {"GEMM_EFFICIENCY": 0.6}
    f.write_text('[efficiencies]\nGEMM = 0.6\n')
    from megatronish.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown efficiencies GEMM"):
        load_hardware("H100-SXM", hardware_file=str(f))


def test_deferred_weight_gradients_in_the_zero_bubble_peak():
    """Between a chunk-microbatch's B and its W the split backward keeps each tensor-parallel linear's input and
    output gradient (per token and layer: QKV h and (h + 2kv)/t, projection h/t and h, FC1 h and 2f/t with SwiGLU,
    FC2 f/t and h; the loss stage's output layer h and V/t); the zero-bubble peak walks the action list: zb-h1 at
    PP 2 and 4 microbatches (rank 0 ``F0 F1 B0 F2``, rank 1 ``F0 B0 F1``) peaks at 1F1B's activations plus one
    microbatch's deferred bytes."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.parallel.pipeline.walk import walk_peak
    from megatronish.planner.activations import stage_activations
    from megatronish.training.memory import deferred_weight_bytes

    flags = BASE + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--swiglu",
                    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
                    "--global-batch-size", "4"]
    zb = configs_from_args(build_parser().parse_args(flags + ["--pipeline-schedule", "zb-h1"]), 4)
    one = configs_from_args(build_parser().parse_args(flags), 4)
    s, b, h, t, kv, f, vocab = 32, 1, 64, 2, 2 * 16, 96, zb.model.padded_vocab_size(2)
    layer = s * b * (h + (h + 2 * kv) / t + h / t + h + h + 2 * f / t + f / t + h) * 2  # bf16
    assert deferred_weight_bytes(zb, range(2)) == 2 * layer
    assert deferred_weight_bytes(zb, range(2), loss_stage=True) == 2 * layer + s * b * (h + vocab / t) * 2
    for rank in (0, 1):
        split, plain = stage_activations(zb, rank), stage_activations(one, rank)
        assert split.deferred == deferred_weight_bytes(zb, range(2 * rank, 2 * rank + 2), loss_stage=rank == 1)
        assert (split.layers, split.embedding, split.output, split.in_flight) == \
            (plain.layers, plain.embedding, plain.output, plain.in_flight)
        assert split.total == pytest.approx(plain.total + split.deferred, rel=1e-12)
    # the walk: F F B F W with 10 bytes held per forward and 4 kept for W peaks at two forwards and one W waiting
    assert walk_peak([("F", 0), ("F", 0), ("B", 0), ("F", 0), ("W", 0)], [10.0], [4.0]) == ([2], [1], 2)
    # with more deferred than held (not a real stage) the peak is the moment of the most waiting W
    assert walk_peak([("F", 0), ("B", 0), ("F", 0), ("B", 0), ("W", 0)], [1.0], [5.0]) == ([0], [2], 1)


def test_attention_core_follows_the_backend():
    """On a GPU the fused backends (auto, flash, fused) keep the fp32 log-sum-exp and no score matrix, the unfused
    ones (local, unfused) Korthikanti's ``5 a s^2 b`` bytes (``2 a s^2 b`` without attention dropout); on CPU
    SDPA takes its flash kernel only without dropout and with one head size (not MLA's), and context
    parallelism's block kernels are flash kernels everywhere."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.activations import attention_core_path, stage_activations

    def cfg(*extra):
        return configs_from_args(build_parser().parse_args(BASE + ["--position-embedding-type", "rope", *extra]), 2)

    def layers(backend, dropout):
        gqa = ["--group-query-attention", "--num-query-groups", "2"]
        return stage_activations(cfg(*gqa, "--attention-backend", backend, "--attention-dropout", dropout), 0).layers

    s, b, a, h, kv, n = 32, 1, 4, 64, 32, 4
    # per layer, bf16: the query and key rotated apart from the fused QKV output the value is a view of
    lse_and_copies = 4 * a * s * b + 2 * (h + kv) * s * b
    for dropout, score_bytes in (("0.1", 5), ("0", 2)):
        fused = {backend: layers(backend, dropout) for backend in ("auto", "flash", "fused")}
        assert len(set(fused.values())) == 1
        assert layers("local", dropout) == layers("unfused", dropout)
        assert layers("local", dropout) - fused["auto"] == pytest.approx(
            n * (score_bytes * a * s * s * b - lse_and_copies), rel=1e-12)
    mla = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
           "--v-head-dim", "16"]
    paths = {("0",): "flash", ("0.1",): "math", ("0", "--attention-backend", "unfused"): "math",
             ("0", "--attention-backend", "local"): "local", ("0", *mla): "math",
             ("0", *mla, "--context-parallel-size", "2"): "flash", ("0", "--attention-backend", "flash"): "flash"}
    for (dropout, *extra), path in paths.items():
        c = cfg("--attention-dropout", dropout, *extra)
        assert attention_core_path(c, cpu=True) == path, extra
        assert attention_core_path(c, cpu=False) == ("local" if "local" in extra else
                                                      "math" if "unfused" in extra else "flash"), extra


def test_torchtitan_loss_and_per_op_selective_terms():
    """torchtitan's activations against hand counts (bf16, s 32, b 1, h 64, 4 heads, 2 query groups of 16, SwiGLU
    FFN 128, vocab 1000 padded to 1024): its per-op selective policy keeps per token and layer the block's input,
    the outputs of wq, wv, w1 and w2 (every other GEMM of wq wk wv wo w1 w3 w2; the row-parallel w2's is the
    full-width partial sum), SDPA's output and fp32 log-sum-exp, and under TP 2 + SP the two reduce-scatters'
    outputs; its loss holds 3 fp32 [tokens, V / t] tensors (4 under TP's loss_parallel) where ours holds 1;
    under torch.distributed.pipelining the loss stage adds each microbatch's fp32 logits."""
    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.planner.activations import stage_activations

    llama = ["--swiglu", "--ffn-hidden-size", "128", "--group-query-attention", "--num-query-groups", "2",
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--recompute-granularity", "selective"]

    def cfg(world, *extra):
        return configs_from_args(build_parser().parse_args(BASE + llama + list(extra)), world)

    s, b, h, kv, f, a, n = 32, 1, 64, 32, 128, 4, 4
    one = cfg(1)
    per_token = 2 * (h + h + kv + f + h + h) + 4 * a
    assert stage_activations(one, 0, selective="per-op").layers == n * per_token * s * b
    tp = cfg(2, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    per_token_tp = 2 * (h / 2 + h / 2 + kv / 2 + f / 2 + h + h / 2 + 2 * h / 2) + 4 * a / 2
    assert stage_activations(tp, 0, selective="per-op").layers == pytest.approx(n * per_token_tp * s * b)
    for c, vocab, copies in ((one, 1024, 3), (tp, 512, 4)):
        ours, theirs = stage_activations(c, 0), stage_activations(c, 0, loss="torchtitan")
        assert theirs.output - ours.output == (copies - 1) * 4 * s * b * vocab
    pp = cfg(2, "--pipeline-model-parallel-size", "2")  # 16 microbatches
    kept = [stage_activations(pp, r, loss="torchtitan", pipelining_outputs=True).kept_outputs for r in (0, 1)]
    assert kept == [0.0, 16 * 4 * s * b * 1024]
    with pytest.raises(ValueError):
        stage_activations(one, 0, selective="every-other-layer")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_pipeline_sends_and_the_loss_stage_follow_the_placement(schedule):
    """Each rank's sends per microbatch equal the SEND actions of the schedule's own action lists (in a V none
    between rank p-1's two chunks); the loss stage's collectives (the cross entropy's TP all-reduces, the loss's
    data-parallel all-reduce) are on the rank holding the last stage: p-1, or 0 in a V."""
    import dataclasses

    from megatronish.arguments import build_parser, configs_from_args
    from megatronish.parallel.pipeline.zero_bubble import schedule_actions
    from megatronish.planner.comms import GroupSizes, pipeline_sends, step_collectives

    for p in (2, 3, 4):
        m = 2 * p
        vp = 2 if schedule != "zb-h1" else 1
        flags = BASE + ["--num-layers", str(2 * p), "--pipeline-model-parallel-size", str(p),
                        "--tensor-model-parallel-size", "2", "--pipeline-schedule", schedule,
                        "--global-batch-size", str(2 * m)]
        cfg = configs_from_args(build_parser().parse_args(flags), 4 * p)
        par = cfg.parallel
        assert par.vp == vp and cfg.num_microbatches == m
        for r, actions in enumerate(schedule_actions(schedule, p, m)):
            assert m * pipeline_sends(par, r) == sum(a.op == "SEND" for a in actions), (p, r)
        loss_rank = 0 if vp == 2 else p - 1
        for r in range(p):
            colls = step_collectives(cfg, par.rank_of(pp=r), None, GroupSizes(par, par.rank_of(pp=r)))
            loss = [c for c in colls if (c.group, c.kind, c.nbytes) in (("tp", "all_reduce", 32 * 4),
                                                                         ("dp_cp", "all_reduce", 8))]
            assert len(loss) == (2 if r == loss_rank else 0), (p, r, loss)
        plain = dataclasses.replace(par, pipeline_schedule=None, vp=1)
        assert [pipeline_sends(plain, r) for r in range(p)] == [1] + [2] * (p - 2) + [1]


def _final_norm_saved(rank, world, argv):
    """Bytes the final norm saves for its backward in one forward on this rank (distinct storages, parameters
    excluded), the rank's model built from ``argv`` at TP ``world``."""
    import torch

    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.model.build import build_model_chunks
    from megatronish.parallel import groups
    from megatronish.parallel.random import set_random_seed

    cfg = configs_from_args(parse_args(argv), world)
    ctx = groups.initialize_model_parallel(cfg.parallel)
    set_random_seed(1, tp_rank=ctx.tp_rank)
    model = build_model_chunks(cfg.model, ctx, sequence_parallel=cfg.sequence_parallel)[0]
    model.init_parameters(1)
    norm, params = model.decoder.final_layernorm, {p.data_ptr() for p in model.parameters()}
    inside, saved = [False], {}
    norm.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    norm.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        if inside[0] and t.data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    groups.destroy_model_parallel()
    return sum(saved.values())


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_final_norm_input_follows_sequence_parallelism(norm):
    """The final norm's saved bytes on each rank against :func:`final_norm_bytes` (CPU terms): at TP 2 with SP the
    norm sees ``s/t`` tokens, without SP all ``s`` (LayerNorm's per-token mean and rstd, 8 bytes a token, are not
    counted: 2/h of the input)."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.planner.activations import final_norm_bytes
    from megatronish.testing import run_distributed

    argv = [a for a in BASE if a != "--bf16"] + ["--normalization", norm, "--tensor-model-parallel-size", "2",
                                                  "--micro-batch-size", "2", "--hidden-dropout", "0"]
    for sp in ([], ["--sequence-parallel"]):
        got = run_distributed(_final_norm_saved, 2, argv + sp)
        predicted = final_norm_bytes(configs_from_args(parse_args(argv + sp), 2), cpu=True)
        assert got[0] == got[1] == pytest.approx(predicted, rel=2 / 64 + 1e-9), (sp, got, predicted)
