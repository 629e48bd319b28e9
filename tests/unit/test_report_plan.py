"""``--report-plan``: a one-process CPU run prints the planner's block at start (its rank-0 parameter bytes are the
built model's), then after the first log window the log line's elapsed time and the memory report's measurement
beside the prediction; a kind the planner does not know is one error line before set-up."""
import io
import re
from contextlib import redirect_stdout

import pytest

from megatronish.arguments import configs_from_args, parse_args
from megatronish.errors import ConfigError
from megatronish.testing import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--eval-iters", "0", "--log-interval", "2", "--report-plan"]


def _run(rank, world, argv):
    from megatronish.parallel import groups
    from megatronish.planner.report import PlanReport
    from megatronish.training import pretrain as loop
    from megatronish.training.memory import measured_state_bytes

    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(argv), world)
    out = io.StringIO()
    with redirect_stdout(out):
        run = loop.pretrain(cfg, report=PlanReport.check(cfg)).context
    params = sum(p.numel() * p.element_size() for m in run.models for p in m.parameters())
    return out.getvalue(), params, run.memory.measured + measured_state_bytes(run.chunks, run.optimizer)


def test_report_plan_block_and_measurement():
    text, param_bytes, measured_peak = run_distributed(_run, 1, BASE, timeout=300)[0]
    lines = [x for x in text.splitlines() if x.startswith("[report-plan]")]
    assert any("planned on cpu-this-machine" in x for x in lines), text
    assert any(x.split()[1:3] == ["0", "0"] for x in lines), "the stage table's row of stage 0"
    rank0 = next(x for x in lines if "rank 0:" in x and "parameters" in x)
    assert int(re.search(r"params (\d+) B", rank0).group(1)) == param_bytes
    # the first window's elapsed time, as the log line printed it; then the memory the run measured
    elapsed = re.findall(r"iteration\s+2/\s+3 .*elapsed time per iteration \(ms\): ([\d.]+)", text)
    step = next(x for x in lines if "step time: measured" in x)
    assert elapsed and re.search(r"measured ([\d.]+) ms", step).group(1) == elapsed[0]
    predicted_ms = float(re.search(r"step time ([\d.]+) ms:", "\n".join(lines)).group(1))
    assert f"predicted {predicted_ms:.3f} ms" in step
    mem = next(x for x in lines if "peak memory: measured" in x)
    assert int(re.search(r"measured (\d+) B", mem).group(1)) == round(measured_peak)
    assert text.index("planned on") < text.index("iteration        2/") < text.index("step time: measured")


def test_unknown_kind_is_one_line():
    from megatronish.planner.report import PlanReport

    cfg = configs_from_args(parse_args(BASE + ["--report-plan-gpu", "H99"]), 1)
    with pytest.raises(ConfigError, match=r"^--report-plan-gpu H99: choose one of H100-SXM, "):
        PlanReport.check(cfg)
    assert PlanReport.check(configs_from_args(parse_args(BASE[:-1]), 1)) is None
