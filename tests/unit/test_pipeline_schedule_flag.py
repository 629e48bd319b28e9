"""``--pipeline-schedule``: the flag, its config field (``ParallelDims.pipeline_schedule``), one error line per
rule, the schedule ``setup`` picks, and the V placement of ``zbv`` and ``dualpipev`` (layers, pre/post-processing
chunks, the embedding group, the loss rank) checked without processes; ``--overlap-p2p-communication`` reaches
the schedule ``setup`` builds; ``--decoder-first/last-pipeline-num-layers``: the
uneven split's layer ranges under every schedule and its error lines."""
import functools

import pytest

from megatronish.config import gpt2
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.pipeline import schedules
from megatronish.parallel.pipeline.choose import forward_backward_func
from megatronish.parallel.pipeline.zb_runner import forward_backward_zero_bubble
from megatronish.parallel.pipeline.zero_bubble import place, stage_of
from tests.unit.test_arguments import cfg_of, errors_of

PP2 = ["--pipeline-model-parallel-size", "2"]


def test_default_keeps_megatrons_choice():
    assert cfg_of(world=2, extra=PP2).parallel.pipeline_schedule is None
    assert forward_backward_func(2, 1, None) is schedules.forward_backward_pipelining_without_interleaving
    assert forward_backward_func(2, 2, None) is schedules.forward_backward_pipelining_with_interleaving
    assert forward_backward_func(2, 1, "1f1b") is schedules.forward_backward_pipelining_without_interleaving
    assert forward_backward_func(2, 2, "interleaved-1f1b") is schedules.forward_backward_pipelining_with_interleaving
    assert forward_backward_func(1, 1, None) is schedules.forward_backward_no_pipelining


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_zero_bubble_selected(schedule):
    f = forward_backward_func(2, 1 if schedule == "zb-h1" else 2, schedule)
    assert isinstance(f, functools.partial) and f.func is forward_backward_zero_bubble
    assert f.keywords == {"schedule": schedule}


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_imply_two_chunks_in_a_v(schedule):
    dims = cfg_of(["--pipeline-schedule", schedule] + PP2, world=2).parallel
    assert (dims.vp, dims.pipeline_schedule, dims.v_shape) == (2, schedule, True)
    for r in range(2):
        assert [dims.stage_of(r, c) for c in range(2)] == [stage_of(schedule, 2, r, c) for c in range(2)] \
            == [r, 3 - r]


def test_overlap_p2p_flag():
    """Megatron-LM's spellings, off by default; setup passes it to the schedule."""
    import inspect

    from megatronish.training import initialize

    assert cfg_of(world=2, extra=PP2).optim.overlap_p2p_comm is False
    for spelling in ("--overlap-p2p-communication", "--overlap-p2p-comm"):
        assert cfg_of([spelling] + PP2, world=2).optim.overlap_p2p_comm is True
    assert cfg_of(["--no-overlap-p2p-communication"] + PP2, world=2).optim.overlap_p2p_comm is False
    assert "overlap_p2p_comm=o.overlap_p2p_comm" in inspect.getsource(initialize)


def test_zbv_implies_two_chunks_in_a_v():
    dims = cfg_of(["--pipeline-schedule", "zbv"] + PP2, world=2).parallel
    assert cfg_of(["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"] + PP2,
                  world=2).parallel == dims
    # 16 / 2 = 8 microbatches on PP 4 x DP 1 is fine; 6 would break interleaving's rule but not the V's
    cfg_of(["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "4", "--num-layers", "8",
            "--global-batch-size", "12"], world=4)


@pytest.mark.parametrize("extra, world, line", [
    (["--pipeline-schedule", "zb-h1"], 1, "--pipeline-schedule zb-h1 needs pipeline parallelism, but "
                                          "--pipeline-model-parallel-size is 1"),
    (["--pipeline-schedule", "zb-h1", "--num-virtual-stages-per-pipeline-rank", "2"] + PP2, 2,
     "--pipeline-schedule zb-h1 runs one chunk per pipeline rank"),
    (["--pipeline-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", "2"] + PP2, 2,
     "--pipeline-schedule 1f1b runs one chunk per pipeline rank"),
    (["--pipeline-schedule", "interleaved-1f1b"] + PP2, 2,
     "--pipeline-schedule interleaved-1f1b needs more than one virtual stage per rank"),
    (["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "4", "--num-layers", "8"] + PP2, 2,
     "--pipeline-schedule zbv places exactly 2 chunks on every pipeline rank (a V)"),
    (["--pipeline-schedule", "zbv", "--num-layers", "6"] + PP2, 2, "--num-layers 6 is not divisible by"),
    (["--pipeline-schedule", "dualpipev", "--num-virtual-stages-per-pipeline-rank", "4", "--num-layers", "8"] + PP2,
     2, "--pipeline-schedule dualpipev places exactly 2 chunks on every pipeline rank (a V)"),
    (["--pipeline-schedule", "dualpipev", "--global-batch-size", "6", "--pipeline-model-parallel-size", "4",
      "--num-layers", "8"], 4, "--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size = 8 "
                               "microbatches per iteration, but --global-batch-size 6"),
    (["--pipeline-schedule", "dualpipev", "--rampup-batch-size", "4", "4", "64"] + PP2, 2,
     "--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size = 4 microbatches per iteration, "
     "but --rampup-batch-size starts at a batch of 4 = 2 microbatches"),
    (["--pipeline-schedule", "zbv", "--torch-compile"] + PP2, 2,
     "--pipeline-schedule zbv with --torch-compile is not supported"),
])
def test_one_line_per_rule(extra, world, line):
    errors = errors_of(extra, world=world)
    assert any(e.startswith(line) for e in errors), errors


@pytest.mark.parametrize("extra, world", [
    (["--pipeline-schedule", "dualpipev", "--use-torch-fsdp2"], 4),
    (["--pipeline-schedule", "zb-h1", "--use-torch-fsdp2"], 4),
    (["--pipeline-schedule", "zb-h1", "--context-parallel-size", "2", "--attention-dropout", "0"], 4),
    (["--pipeline-schedule", "zbv", "--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size",
      "2"], 4),
])
def test_split_backward_runs_with_cp_moe_and_fsdp2(extra, world):
    """Context parallelism, mixture of experts and FSDP2 run under the zero-bubble schedules (their parity:
    tests/distributed/test_zero_bubble_parity.py)."""
    assert cfg_of(extra + PP2 + ["--global-batch-size", "16"], world=world).parallel.pipeline_schedule == extra[1]


def test_v_placement_without_processes():
    """PP 2, 8 layers: rank 0 holds stages 0 and 3 (embedding, and the loss), rank 1 stages 1 and 2 (the
    hand-over); layer numbers stay global; the tied embedding's two copies are on rank 0, so its group is
    rank 0 alone."""
    dims = ParallelDims(world_size=2, pp=2, vp=2, pipeline_schedule="zbv")
    cfg = gpt2(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16)
    want = {0: [(0, 2, True, False), (6, 8, False, True)], 1: [(2, 4, False, False), (4, 6, False, False)]}
    for r in range(2):
        for c in range(2):
            assert dims.stage_of(r, c) == stage_of("zbv", 2, r, c)
            assert place("zbv", 2, dims.stage_of(r, c)) == (r, c)
        chunks = build_model_chunks(cfg, ParallelContext.fake(dims, r))
        got = [(m.first_layer, m.first_layer + len(m.decoder.layers), m.pre_process, m.post_process) for m in chunks]
        assert got == want[r]
    assert dims.embedding_groups() == [[0]] and dims.loss_pp_rank == 0
    assert ParallelContext.fake(dims, 0).holds_loss and ParallelContext.fake(dims, 0).loss_rank == 0
    interleaved = ParallelDims(world_size=2, pp=2, vp=2)
    assert [interleaved.layer_range(8, 0, c) for c in range(2)] == [range(0, 2), range(4, 6)]
    assert interleaved.embedding_groups() == [[0, 1]] and interleaved.loss_pp_rank == 1


# ------------------------------------------------------------------ uneven layer splits
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


@pytest.mark.parametrize("layers, pp, vp, schedule, first, last, want", [
    (7, 2, 1, None, 3, None, [[(0, 3)], [(3, 7)]]),
    (7, 2, 1, "zb-h1", None, 3, [[(0, 4)], [(4, 7)]]),
    (10, 4, 1, None, 1, None, [[(0, 1)], [(1, 4)], [(4, 7)], [(7, 10)]]),
    (10, 4, 1, None, 1, 3, [[(0, 1)], [(1, 4)], [(4, 7)], [(7, 10)]]),
    (10, 2, 2, None, 4, None, [[(0, 2), (5, 7)], [(2, 5), (7, 10)]]),  # interleaved: stages of 2, 3, 2, 3
    (10, 2, 2, "zbv", 4, None, [[(0, 2), (8, 10)], [(2, 5), (5, 8)]]),  # V: stages of 2, 3, 3, 2
])
def test_uneven_layer_ranges(layers, pp, vp, schedule, first, last, want):
    dims = ParallelDims(world_size=pp, pp=pp, vp=vp, pipeline_schedule=schedule,
                        decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    got = [[(r_.start, r_.stop) for r_ in (dims.layer_range(layers, r, c) for c in range(vp))] for r in range(pp)]
    assert got == want
    every = sorted(i for r in range(pp) for c in range(vp) for i in dims.layer_range(layers, r, c))
    assert every == list(range(layers))


def test_uneven_flags_reach_the_layout():
    argv = ["--num-layers", "7", FIRST, "3", "--pipeline-schedule", "zb-h1"] + PP2
    dims = cfg_of(argv, world=2).parallel
    assert (dims.decoder_first_pipeline_num_layers, dims.decoder_last_pipeline_num_layers) == (3, None)
    assert [dims.rank_num_layers(7, r) for r in range(2)] == [3, 4]


@pytest.mark.parametrize("extra, world, line", [
    (["--num-layers", "8", FIRST, "1", "--pipeline-model-parallel-size", "4"], 4,
     "--num-layers 8 with --decoder-first-pipeline-num-layers 1 over --pipeline-model-parallel-size 4: the 7 "
     "remaining layers must split evenly over the 3 ranks"),
    (["--num-layers", "7", FIRST, "3", LAST, "3"] + PP2, 2, "--num-layers 7 with --decoder-first-pipeline-num-layers "
     "3 --decoder-last-pipeline-num-layers 3 over --pipeline-model-parallel-size 2: the 1 remaining layers"),
    (["--num-layers", "7", FIRST, "3", "--num-virtual-stages-per-pipeline-rank", "2"] + PP2, 2,
     "--num-layers 7 with --decoder-first-pipeline-num-layers 3 over --pipeline-model-parallel-size 2: every "
     "pipeline rank's layers must divide by its 2 virtual stages"),
    ([FIRST, "2"], 1, "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers split the layers "
     "over pipeline ranks, but --pipeline-model-parallel-size is 1"),
    ([LAST, "0"] + PP2, 2, "--decoder-last-pipeline-num-layers must be an integer >= 1, got 0"),
    (["--num-layers", "8", FIRST, "2", "--num-layers-per-virtual-pipeline-stage", "1"] + PP2, 2,
     "--num-layers-per-virtual-pipeline-stage assumes an even layer split"),
])
def test_uneven_one_line_per_rule(extra, world, line):
    errors = errors_of(extra, world=world)
    assert any(e.startswith(line) for e in errors), errors


def test_generation_refuses_the_v_and_takes_zb_h1():
    """Text generation runs the stages in rank order: zbv's V is one error line; zb-h1 only changes training."""
    from megatronish.arguments import parse_args, validate_args
    from megatronish.errors import ConfigError
    from tests.unit.test_arguments import BASE

    for v_schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=rf"^--pipeline-schedule {v_schedule}: text generation"):
            validate_args(parse_args(BASE + ["--pipeline-schedule", v_schedule] + PP2), 2, for_training=False)
    validate_args(parse_args(BASE + ["--pipeline-schedule", "zb-h1"] + PP2), 2, for_training=False)
    validate_args(parse_args(BASE + ["--pipeline-schedule", "zbv"] + PP2), 2)
