"""The step-time model's measured-machine terms: a GEMM rate table by shape (interpolated in log space over
``hardware.GEMM_GRID``, used in place of the efficiency of the peak), the score matrix's elementwise passes and
every score computed where the attention core writes the matrix out, and the dropout masks' draws."""
import dataclasses
import itertools
import math

import pytest
import torch

from megatronish.arguments import build_parser, configs_from_args
from megatronish.planner import hardware
from megatronish.planner.hardware import CORE_GRID, CPU_KIND, GEMM_GRID, GPUS
from megatronish.planner.perf import EAGER_ELEMENTS, MEMORY_BOUND_BYTES, OPS, SCORE_ACCESSES, table_tflops
from megatronish.planner.plan import make_plan

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--train-iters", "10", "--lr", "1e-4"]


def _log_linear(m, k, n):
    return 3.0 * m ** 0.3 * k ** -0.2 * n ** 0.1


def test_table_is_interpolated_in_log_space_and_clamped():
    """A rate that is linear in the sizes' logs is reproduced exactly between the grid points; beyond the grid
    the end's rate holds."""
    table = {f"{m},{k},{n}": _log_linear(m, k, n) for m, k, n in itertools.product(GEMM_GRID, repeat=3)}
    lo, hi = GEMM_GRID[0], GEMM_GRID[-1]
    for m, k, n in ((lo, hi, lo), (48, 300, 77), (200, 33, 511), (100, 100, 100)):
        assert table_tflops(table, m, k, n) == pytest.approx(_log_linear(m, k, n), rel=1e-12)
    assert table_tflops(table, 4 * hi, 2, 100) == pytest.approx(_log_linear(hi, lo, 100), rel=1e-12)


def _cfg(world=1, extra=()):
    return configs_from_args(build_parser().parse_args(BASE + list(extra)), world)


def _time(cfg, hw):
    return make_plan(cfg, hw)["time"]["breakdown_s"]


@pytest.mark.parametrize("world, extra", [(1, []), (2, ["--tensor-model-parallel-size", "2"]),
                                          (2, ["--pipeline-model-parallel-size", "2", "--bf16"])])
def test_a_flat_table_prices_gemms_as_that_efficiency_of_the_peak(world, extra):
    """Tables with one rate everywhere (the linears', the attention core's matmuls' and flash kernel's) give the
    GEMMs' and the core's seconds of the efficiencies that reach that rate from the peak."""
    cfg = _cfg(world, extra)
    hw = GPUS["H100-SXM"]
    dtype = "bf16" if "--bf16" in extra else "fp32"  # an fp32 run's GEMMs: the table's fp32, the peak's tf32
    rate = 0.37 * hw.peak("bf16" if dtype == "bf16" else "tf32")
    flat = {f"{m},{k},{n}": rate / 1e12 for m, k, n in itertools.product(GEMM_GRID, repeat=3)}
    core = {f"{s},{d}": rate / 1e12 for s, d in itertools.product(*CORE_GRID)}
    tabled = _time(cfg, dataclasses.replace(hw, gemm_tflops={dtype: flat, f"core_{dtype}": core,
                                                             f"flash_{dtype}": core}))
    fitted = _time(cfg, dataclasses.replace(hw, efficiencies={"GEMM_EFFICIENCY": 0.37,
                                                              "ATTENTION_EFFICIENCY": 0.37}))
    assert tabled["gemm"] == pytest.approx(fitted["gemm"], rel=1e-12)
    assert tabled["attention"] == pytest.approx(fitted["attention"], rel=1e-12)


@pytest.mark.parametrize("extra", [[], ["--attention-dropout", "0", "--attention-backend", "unfused"],
                                   ["--recompute-granularity", "selective"],
                                   ["--tensor-model-parallel-size", "2", "--sequence-parallel"]])
def test_score_matrix_passes_and_dropout_draws(extra):
    """On this machine SDPA's math path writes the scores out (attention dropout, or ``unfused``): against the
    flash core (no attention dropout, the default backend), every score is computed (twice the core's seconds),
    the memory-bound seconds add the scores' passes (:data:`SCORE_ACCESSES` of 4 bytes, the forward's again under
    selective recompute) and the dropout term is the draws over the probed rate: the scores' under attention
    dropout, and either way two per token and hidden unit a layer (SP: the rank's share) and the embedding's."""
    world = 2 if "--tensor-model-parallel-size" in extra else 1
    cfg = _cfg(world, extra + ["--hidden-dropout", "0.1"])
    flash_cfg = _cfg(world, [x for x in extra if x not in ("--attention-backend", "unfused")] +
                     ["--hidden-dropout", "0.1", "--attention-dropout", "0"])
    m, par = cfg.model, cfg.parallel
    cpu = dataclasses.replace(GPUS["H100-SXM"], name=CPU_KIND, hbm_tbps=0.02, dropout_gelems=0.3, device="cpu")
    flash, math_path = _time(flash_cfg, cpu), _time(cfg, cpu)
    assert math_path["attention"] == pytest.approx(2 * flash["attention"], rel=1e-12)
    scores = cfg.train.global_batch_size * m.seq_length ** 2 * m.num_attention_heads / par.tp * m.num_layers
    dropout = m.attention.attention_dropout > 0
    a = SCORE_ACCESSES
    redo = 1 if "selective" in extra else 0
    accesses = (a["forward"] + dropout * a["dropout_forward"]) * (1 + redo) + a["backward"] + \
        dropout * a["dropout_backward"]
    rate = cpu.hbm_tbps * 1e12 * 0.5  # the model's MEMORY_EFFICIENCY
    assert math_path["memory_bound"] - flash["memory_bound"] == pytest.approx(scores * accesses * 4 / rate,
                                                                              rel=1e-9)
    tokens_h = cfg.train.global_batch_size * m.seq_length * m.hidden_size
    sp = par.tp if cfg.sequence_parallel else 1
    hidden = tokens_h / sp * (2 * m.num_layers + 1)
    assert math_path["dropout_draws"] == pytest.approx((scores * (1 + redo) * dropout + hidden) / 0.3e9, rel=1e-12)
    assert flash["dropout_draws"] == pytest.approx(hidden / 0.3e9, rel=1e-12)
    assert "dropout_draws" not in _time(flash_cfg, GPUS["H100-SXM"])  # drawn inside the dropout kernel's pass


@pytest.mark.parametrize("world, extra", [(1, []), (2, ["--tensor-model-parallel-size", "2"]),
                                          (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                          (1, ["--swiglu"])])
def test_eager_elementwise_bytes(world, extra):
    """On this machine (no fused kernels) a layer's memory-bound bytes are :data:`EAGER_ELEMENTS`' count per token
    (its TP share; the norms', dropouts' and residuals' only under SP) of 4 bytes, and every microbatch adds each
    weight's gradient into its accumulator; a GPU table keeps ``MEMORY_BOUND_BYTES``."""
    cfg = _cfg(world, extra + ["--attention-dropout", "0"])
    m, par = cfg.model, cfg.parallel
    gpu = dataclasses.replace(GPUS["H100-SXM"], hbm_tbps=0.02)
    plan = make_plan(cfg, dataclasses.replace(gpu, name=CPU_KIND, device="cpu"))
    eager, fused = plan["time"]["breakdown_s"]["memory_bound"], _time(cfg, gpu)["memory_bound"]
    rate = gpu.hbm_tbps * 1e12 * 0.5
    tokens = cfg.train.global_batch_size * m.seq_length
    a = EAGER_ELEMENTS
    per_token = (a["tp_h"] * m.hidden_size + a["tp_ffn_swiglu" if m.swiglu else "tp_ffn"] * m.ffn_hidden_size) / \
        par.tp + a["sp_h"] * m.hidden_size / (par.tp if cfg.sequence_parallel else 1)
    num_params = plan["stages"][0]["num_params"]
    want = tokens * per_token * 4 * m.num_layers + 3 * 4 * num_params * cfg.num_microbatches
    have = tokens * MEMORY_BOUND_BYTES * 2 * m.hidden_size * m.num_layers / par.tp  # fp32: twice the 16-bit bytes
    assert eager - fused == pytest.approx((want - have) / rate, rel=1e-9)


def test_probe_tables_cover_their_grids():
    table = hardware.probe_gemm_table(torch.float32, 0.01)
    assert sorted(table) == sorted(f"{m},{k},{n}" for m, k, n in itertools.product(GEMM_GRID, repeat=3))
    core, flash = hardware.probe_core_table(torch.float32, 0.01), hardware.probe_flash_table(torch.float32, 0.01)
    assert sorted(core) == sorted(flash) == sorted(f"{s},{d}" for s, d in itertools.product(*CORE_GRID))
    assert all(math.isfinite(v) and v > 0 for v in [*table.values(), *core.values(), *flash.values()])


def test_core_table_is_interpolated_over_sequence_and_head_size():
    table = {f"{s},{d}": 2.0 * s ** 0.5 * d ** 0.25 for s, d in itertools.product(*CORE_GRID)}
    assert table_tflops(table, 256, 64) == pytest.approx(2.0 * 256 ** 0.5 * 64 ** 0.25, rel=1e-12)
    assert table_tflops(table, 4096, 8) == pytest.approx(table["512,32"], rel=1e-12)


@pytest.mark.parametrize("world, extra", [(1, []), (2, ["--pipeline-model-parallel-size", "2"])])
def test_op_overhead_term(world, extra):
    """Where the host runs the kernels, each dispatched op costs ``op_overhead_s``: :data:`OPS` a layer and
    microbatch (the stage's share of the layers) and a step's own; a GPU table has none."""
    cfg = _cfg(world, extra)
    gpu = GPUS["H100-SXM"]
    t = make_plan(cfg, dataclasses.replace(gpu, op_overhead_s=7e-6))["time"]["breakdown_s"]
    layers = cfg.model.num_layers / cfg.parallel.pp
    assert t["op_overhead"] == pytest.approx(7e-6 * (OPS["layer"] * layers * cfg.num_microbatches + OPS["step"]),
                                             rel=1e-12)
    assert "op_overhead" not in _time(cfg, gpu)


def test_ranks_sharing_cores_fill_the_bubble():
    """Ranks that share cores (``rank_share`` below 1, rates already shared): the step is the longer of the
    critical path at a whole core each (compute plus bubble at ``share`` of the shared time) and the shared
    compute; at a whole device the bubble is the schedule's."""
    cfg = _cfg(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"])
    hw = GPUS["H100-SXM"]
    whole = _time(cfg, hw)
    compute = whole["gemm"] + whole["attention"] + whole["memory_bound"]
    for share in (0.5, 0.8):
        shared = _time(cfg, dataclasses.replace(hw, rank_share=share))
        assert shared["bubble"] == pytest.approx(max(0.0, (compute + whole["bubble"]) * share - compute), rel=1e-9,
                                                 abs=1e-18)


def test_each_collective_kind_at_its_own_measured_rates():
    """A measured machine's ``collective_links`` price each kind at its own rates inside a node (the ring's bytes
    and steps over that kind's GB/s and latency); a kind it did not measure, and every kind on a datasheet entry,
    takes the intra-node link."""
    from megatronish.planner.comms import Collective
    from megatronish.planner.perf import price

    par = _cfg(4, ["--tensor-model-parallel-size", "4"]).parallel
    links = {"all_gather": [0.5, 2e-4], "reduce_scatter": [0.25, 3e-4]}
    hw = dataclasses.replace(GPUS["H100-SXM"], collective_links=links)
    nbytes = 2 ** 20
    for kind, (gbps, lat) in links.items():
        c = Collective("tp", kind, 4, nbytes, 3.0)
        assert price(c, hw, par, 0, 1.0) == pytest.approx(3 * (0.75 * nbytes / (gbps * 1e9) + 3 * lat), rel=1e-12)
        assert price(c, GPUS["H100-SXM"], par, 0, 1.0) == pytest.approx(
            3 * (0.75 * nbytes / (hw.intra_node_gbps * 1e9) + 3 * hw.intra_node_latency_s), rel=1e-12)
    p2p = Collective("tp", "p2p", 4, nbytes, 1.0)
    assert price(p2p, hw, par, 0, 1.0) == price(p2p, GPUS["H100-SXM"], par, 0, 1.0)


def test_gloo_probe_measures_every_kind_it_prices():
    links = hardware.probe_gloo()
    assert set(links) == set(hardware.GLOO_KINDS)
    assert all(gbps > 0 and 0 < latency < 1 for gbps, latency in links.values())
