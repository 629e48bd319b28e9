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
    assert "layouts enumerated" in out and out.count("tokens/s/GPU") == 3 and out.count("loses to 1. on:") == 2
