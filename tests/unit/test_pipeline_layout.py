"""``--pipeline-model-parallel-layout`` (Megatron-LM's grammar: ``|`` between stages, ``E t m L``, ``x*n`` and
``(group)*n`` repeats, cosmetic commas) and ``--account-for-embedding/loss-in-pipeline-split``: parsing against
Megatron-LM's documented examples, one error line per rule, the virtual stages a layout sets, the layer ranges
equal to those of the first/last flags and of the account-for splits (Megatron-LM's formula), the model chunks
built from a layout and the checkpoint's layout record, all without processes."""
import pytest
import torch

from megatronish.checkpoint.manager import _layout
from megatronish.config import gpt2
from megatronish.errors import ConfigError
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.pipeline.layout import (
    LayoutError,
    check_layout,
    format_layout,
    layout_of_counts,
    parse_layout,
    stage_layer_counts,
)
from megatronish.parallel.pipeline.schedules import custom_backward
from megatronish.parallel.random import set_random_seed
from megatronish.parallel_config import parallel_dims
from tests.unit.test_arguments import cfg_of, errors_of

LAYOUT, FIRST, LAST = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                       "--decoder-last-pipeline-num-layers")
EMB, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"


def pp(n):
    return ["--pipeline-model-parallel-size", str(n)]


# ------------------------------------------------------------------ the grammar
@pytest.mark.parametrize("text, stages", [
    # Megatron-LM's docstring: "Ettt|(tt|)*29,m|L" -> [E t t t] + [t t] * 29 + [m] + [L]
    ("Ettt|(tt|)*29,m|L", ("Ettt",) + ("tt",) * 29 + ("m", "L")),
    ("Et*3|(tt|)*29,m|L", ("Ettt",) + ("tt",) * 29 + ("m", "L")),
    ("E|(t|)*3,m|m||L", ("E", "t", "t", "t", "m", "m", "", "L")),  # the flag's help text (an empty stage)
    ("E|(tt|)*2,(t|)*4,mL", ("E", "tt", "tt", "t", "t", "t", "t", "mL")),  # TransformerConfig's docstring
    ("Et(tt|tt|tt)*2,tL", ("Ettt", "tt", "tttt", "tt", "tttL")),  # xy(ab|cd|ef)*2,pq -> xyab|cd|efab|cd|efpq
    ("(|tt)*2,tL", ("", "tt", "tttL")),  # (|ab)*2,cd -> |ab|abcd
    ("Et*12L", ("E" + "t" * 12 + "L",)),
    ("E,t,t|t,t,L", ("Ett", "ttL")),
    ("Et*0|tL", ("E", "tL")),
])
def test_parse_unrolls_repeats_as_megatron(text, stages):
    assert parse_layout(text) == stages
    assert parse_layout(format_layout(stages)) == stages  # the short form reads back


def test_format_layout_is_short():
    assert format_layout(parse_layout("Ettt|tt|tt|tt|m|L")) == "Et*3|(tt|)*3,m|L"
    assert format_layout(parse_layout("Et|tt|tt|tL")) == "Et|(tt|)*2,tL"
    assert format_layout(layout_of_counts((1, 2, 2, 2))) == "Et|(tt|)*2,ttL"
    assert layout_of_counts((3, 0), mtp_num_layers=2) == ("Ettt", "mmL")


@pytest.mark.parametrize("text, pp_size, message", [
    ("Et|tq|tL", 3, "stage 1 ('tq' once repeats are unrolled) holds 'q'"),
    ("Et|((t|)*2)*2|L", 2, "holds '('"),  # groups do not nest (Megatron's pattern leaves the outer one)
    ("Et*|tL", 2, "holds '*'"),
    ("Et|tt|tL", 2, "its 3 stages do not divide among 2 pipeline ranks"),
    ("Et|tL", 1, "its 2 stages need pipeline parallelism"),
    ("EtE|tL", 2, "it names E (the embedding) 2 times"),
    ("Et|tt", 2, "it names L (the loss) 0 times"),
    ("tE|tL", 2, "its first layer is 't'; E (the embedding) must come first"),
    ("Et|Lt", 2, "its last layer is 't'; L (the loss) must come last"),
    ("Etm|tL", 2, "a t comes after an m"),
    ("|Et|tt|tL", 2, "E (the embedding) is not in the first stage"),  # Megatron runs the empty stage 0
    ("Et|tt|tL|", 2, "L (the loss) is not in the last stage"),
    ("Et|tm|L|", 2, "L (the loss) is not in the last stage"),
    ("Et|ttm|tt|L", 2, "a t comes after an m"),
    ("Et|tm|tt|L", 2, "a t comes after an m"),
    ("Et|tm|m|L", 2, "the m layers are on stages 1 and 2; put every multi-token prediction layer on one stage"),
])
def test_layout_rules(text, pp_size, message):
    with pytest.raises(LayoutError) as e:
        check_layout(parse_layout(text), pp_size)
    assert message in str(e.value), str(e.value)


def test_counts():
    assert stage_layer_counts(parse_layout("E|t*4|tttmL")) == (0, 4, 3)


# ------------------------------------------------------------------ the flags
def test_layout_sets_the_virtual_stages_and_the_ranges():
    dims = cfg_of([LAYOUT, "E|tt|t|tL"] + pp(2), world=2).parallel
    assert (dims.vp, dims.pipeline_model_parallel_layout) == (2, "E|tt|t|tL")
    # Megatron's order: stage c*p + r is chunk c of rank r
    assert [[dims.layer_range(4, r, c) for c in range(2)] for r in range(2)] == [
        [range(0, 0), range(2, 3)], [range(0, 2), range(3, 4)]]
    assert [dims.rank_num_layers(4, r) for r in range(2)] == [1, 3]
    mtp = cfg_of([LAYOUT, "Et|tttmL", "--mtp-num-layers", "1", "--position-embedding-type", "rope"] + pp(2),
                 world=2).parallel  # the m layers on the last stage, with L
    assert mtp.stage_layer_counts(4) == (1, 3)
    one = cfg_of([LAYOUT, "EttttL"]).parallel  # one stage at pp 1: the plain model
    assert one.vp == 1 and one.layer_range(4, 0) == range(0, 4)


@pytest.mark.parametrize("extra, world, line", [
    ([LAYOUT, "Et|tt|tL"] + pp(2), 2, f"{LAYOUT} 'Et|tt|tL': its 3 stages do not divide among 2 pipeline ranks"),
    ([LAYOUT, "Et|tL"] + pp(2), 2, f"{LAYOUT} 'Et|tL' holds 2 transformer layers (t) but --num-layers is 4"),
    ([LAYOUT, "Et|ttt"] + pp(2), 2, f"{LAYOUT} 'Et|ttt': it names L (the loss) 0 times"),
    ([LAYOUT, "Et|tt|m|tL"] + pp(2), 2, f"{LAYOUT} 'Et|tt|m|tL': a t comes after an m"),
    ([LAYOUT, "Et|tttL", "--mtp-num-layers", "1"] + pp(2), 2,
     f"{LAYOUT} 'Et|tttL' holds 0 multi-token prediction layers (m) but --mtp-num-layers is 1"),
    ([LAYOUT, "Et|tttmL"] + pp(2), 2, f"{LAYOUT} 'Et|tttmL' holds 1 multi-token prediction layers (m) but "
                                      "--mtp-num-layers is 0"),
    ([LAYOUT, "E|tt|t|tL", "--num-virtual-stages-per-pipeline-rank", "2"] + pp(2), 2,
     f"{LAYOUT} sets the virtual stages (its stage count / --pipeline-model-parallel-size); drop "
     "--num-virtual-stages-per-pipeline-rank"),
    ([LAYOUT, "E|tt|t|tL", "--num-layers-per-virtual-pipeline-stage", "1"] + pp(2), 2,
     f"{LAYOUT} sets the virtual stages"),
    ([LAYOUT, "Et|tttL", FIRST, "1"] + pp(2), 2, f"{LAYOUT} says what every stage holds; drop {FIRST}"),
    ([LAYOUT, "Et|tttL", EMB] + pp(2), 2, f"{LAYOUT} says what every stage holds"),
    ([LAYOUT, "Et|tttL", "--pipeline-schedule", "zbv"] + pp(2), 2,
     f"--pipeline-schedule zbv runs 2 chunks per pipeline rank in a V, so {LAYOUT} needs 2 x "
     "--pipeline-model-parallel-size 2 = 4 stages; it has 2"),
    ([EMB, FIRST, "1"] + pp(2), 2, f"{FIRST} / {LAST} cannot be combined with {EMB} / {LOSS}"),
    ([LOSS], 1, f"{EMB} / {LOSS} change how layers split over pipeline stages, but --pipeline-model-parallel-size "
                "is 1"),
    ([LOSS] + pp(2), 2, f"--num-layers 4 with {EMB} / {LOSS} counts 5 layers, which do not split evenly into "
                        "--pipeline-model-parallel-size 2 x 1 virtual stages per rank = 2 stages"),
    ([EMB, LOSS, "--num-layers-per-virtual-pipeline-stage", "2"] + pp(4), 4,
     f"--num-layers 4 (+ 2 for {EMB} / {LOSS}) / --pipeline-model-parallel-size 4 is not a multiple of "
     "--num-layers-per-virtual-pipeline-stage 2"),
])
def test_one_line_per_rule(extra, world, line):
    errors = errors_of(extra, world=world)
    assert any(e.startswith(line) for e in errors), errors


def _ranges(dims, num_layers):
    return [[dims.layer_range(num_layers, r, c) for c in range(dims.vp)] for r in range(dims.pp)]


@pytest.mark.parametrize("layers, pp_size, vp, schedule, first, last", [
    (7, 2, 1, None, 3, None), (7, 2, 1, "zb-h1", None, 3), (10, 4, 1, None, 1, 3), (10, 4, 1, None, 1, None),
    (10, 2, 2, None, 4, None), (10, 2, 2, "zbv", 4, None), (12, 3, 2, None, 2, 2), (8, 4, 2, None, None, None),
])
def test_first_last_flags_equal_their_layout(layers, pp_size, vp, schedule, first, last):
    """Megatron's uneven split and the layout string that writes it out give the same ranges (the layout's
    stages in stage order: interleaved, or a V under zbv)."""
    flags = ParallelDims(world_size=pp_size, pp=pp_size, vp=vp, pipeline_schedule=schedule,
                         decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    per_rank = [first if r == 0 and first else last if r == pp_size - 1 and last else None for r in range(pp_size)]
    middle = (layers - (first or 0) - (last or 0)) // (pp_size - (first is not None) - (last is not None))
    counts = [(per_rank[flags.place_stage(s)[0]] or middle) // vp for s in range(pp_size * vp)]
    text = format_layout(layout_of_counts(counts))
    layout = ParallelDims(world_size=pp_size, pp=pp_size, vp=vp, pipeline_schedule=schedule,
                          pipeline_model_parallel_layout=text)
    assert _ranges(layout, layers) == _ranges(flags, layers)
    assert sorted(i for rr in _ranges(flags, layers) for r in rr for i in r) == list(range(layers))


def _megatron_account_for(num_layers, pp_size, vp, emb, loss, pp_rank, vp_stage):
    """Megatron-LM's get_num_layers_to_build and get_transformer_layer_offset under the account-for flags."""
    total = num_layers + emb + loss
    per_rank = total // pp_size
    build = per_rank // vp
    first = vp_stage == 0 and pp_rank == 0
    last = vp_stage == vp - 1 and pp_rank == pp_size - 1
    build -= (emb and first) + (loss and last)
    if vp > 1:
        offset = vp_stage * (total // vp) + pp_rank * (per_rank // vp)
    else:
        offset = pp_rank * per_rank
    offset -= emb and not first
    return range(offset, offset + build)


@pytest.mark.parametrize("layers, pp_size, vp, emb, loss", [
    (7, 4, 1, True, False), (7, 4, 1, False, True), (6, 4, 1, True, True), (4, 2, 1, True, True),
    (15, 4, 2, True, False), (6, 2, 2, True, True), (62, 16, 2, True, True),
    (3, 2, 1, True, False),
])
def test_account_for_splits_are_megatrons(layers, pp_size, vp, emb, loss):
    extra = ([EMB] if emb else []) + ([LOSS] if loss else [])
    argv = ["--num-layers", str(layers)] + extra + pp(pp_size)
    if vp > 1:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
    dims = cfg_of(argv, world=pp_size, base=_BASE_NO_LAYERS).parallel
    want = [[_megatron_account_for(layers, pp_size, vp, emb, loss, r, c) for c in range(vp)] for r in range(pp_size)]
    assert _ranges(dims, layers) == want
    # the same split written as a layout string
    text = format_layout(layout_of_counts(dims.stage_layer_counts(layers)))
    layout = ParallelDims(world_size=pp_size, pp=pp_size, vp=vp, pipeline_model_parallel_layout=text)
    assert _ranges(layout, layers) == want


_BASE_NO_LAYERS = ["--num-attention-heads", "4", "--hidden-size", "32", "--seq-length", "16",
                   "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "16",
                   "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", "64"]


def test_account_for_with_layers_per_virtual_stage():
    """Megatron: vp = ((L + 1 + 1) / p) / N with both account-for flags."""
    dims = cfg_of(["--num-layers", "14", EMB, LOSS, "--num-layers-per-virtual-pipeline-stage", "2"] + pp(2),
                  world=2, base=_BASE_NO_LAYERS).parallel
    assert dims.vp == 4 and dims.stage_layer_counts(14) == (1, 2, 2, 2, 2, 2, 2, 1)


def test_chunks_and_checkpoint_record_follow_the_layout():
    """Each chunk holds its stage's layers under global numbers; E-only and L-only stages build the embedding /
    the output layer with no transformer layer; the checkpoint records the stage counts."""
    dims = ParallelDims(world_size=2, pp=2, vp=2, pipeline_model_parallel_layout="E|ttt|tt|L")
    cfg = gpt2(num_layers=5, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    want = {0: [(0, 0, True, False), (3, 5, False, False)], 1: [(0, 3, False, False), (5, 5, False, True)]}
    for r in range(2):
        chunks = build_model_chunks(cfg, ParallelContext.fake(dims, r), device="meta")
        got = [(m.first_layer, m.first_layer + len(m.decoder.layers), m.pre_process, m.post_process) for m in chunks]
        assert got == want[r]
    run = cfg_of(["--num-layers", "5", LAYOUT, "E|ttt|tt|L"] + pp(2), world=2, base=_BASE_NO_LAYERS)
    assert _layout(run)["stage_layers"] == [0, 3, 2, 0]
    account = cfg_of(["--num-layers", "5", EMB] + pp(2), world=2, base=_BASE_NO_LAYERS)
    assert _layout(account)["stage_layers"] == [2, 3]
    assert "stage_layers" not in _layout(cfg_of(["--num-layers", "6"] + pp(2), world=2, base=_BASE_NO_LAYERS))


def test_an_empty_stage_passes_its_input_on():
    """Megatron-LM's pass-through stage: a chunk holding none of E, t, m, L has no parameter, and its output is its
    input as a node of its own, so the schedules' backward from the output leaves the gradient in the input's
    ``.grad`` unchanged. The per-stage counts (the memory report's and the planner's source) give it 0 layers."""
    dims = ParallelDims(world_size=4, pp=4, pipeline_model_parallel_layout="Ett||tt|L")
    assert dims.stage_layer_counts(4) == (2, 0, 2, 0)
    assert [dims.rank_num_layers(4, r) for r in range(4)] == [2, 0, 2, 0]
    assert [dims.layer_range(4, r) for r in range(4)] == [range(0, 2), range(2, 2), range(2, 4), range(4, 4)]
    cfg = gpt2(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    (chunk,) = build_model_chunks(cfg, ParallelContext.fake(dims, 1))
    assert (chunk.pre_process, chunk.post_process, list(chunk.parameters())) == (False, False, [])
    x = torch.randn(16, 2, 32, requires_grad=True)
    chunk.set_input_tensor(x)
    y = chunk(torch.zeros(2, 16, dtype=torch.long))
    assert y is not x and y.grad_fn is not None and torch.equal(y, x)
    dy = torch.randn_like(y)
    custom_backward(y, dy)
    assert torch.equal(x.grad, dy)


def test_a_standalone_mtp_stage():
    """Megatron-LM's DeepSeek-V3 layout ``Et*3|(tt|)*29,m|L`` (PP 16 x VP 2): the MTP layer alone on stage 30, the
    loss alone on 31. The messages from the MTP stage on carry the decoder's hidden states and the depth's (2
    blocks); the MTP stage's rank joins the embedding group (its copy of the word embedding looks the shifted tokens
    up), the last rank only when the output layer is tied. The MTP chunk holds the final norm and the depth, the
    loss chunk neither."""
    text = "Et*3|(tt|)*29,m|L"
    dims = ParallelDims(world_size=16, pp=16, vp=2, pipeline_model_parallel_layout=text,
                        untie_embeddings_and_output_weights=True)
    assert (dims.mtp_stage, dims.message_blocks, dims.place_stage(30)) == (30, 2, (14, 1))
    assert [dims.stage_message_blocks(s) for s in (0, 29, 30)] == [1, 1, 2]  # 2 blocks from the MTP stage on
    assert dims.stage_layer_counts(61)[-3:] == (2, 0, 0) and dims.rank_num_layers(61, 14) == 2
    assert dims.embedding_pp_ranks() == [0, 14] and dims.embedding_groups()[0] == [0, 14]
    tied = ParallelDims(world_size=16, pp=16, vp=2, pipeline_model_parallel_layout=text)
    assert tied.embedding_pp_ranks() == [0, 14, 15]
    assert ParallelDims(world_size=16, pp=16, vp=2, pipeline_model_parallel_layout="Et|(tt|)*30,mL").message_blocks == 1
    v = ParallelDims(world_size=2, pp=2, vp=2, pipeline_schedule="zbv", pipeline_model_parallel_layout="Et|t|m|L")
    assert (v.mtp_stage, v.place_stage(2), v.embedding_pp_ranks()) == (2, (1, 1), [0, 1])

    small = ParallelDims(world_size=2, pp=2, vp=2, pipeline_model_parallel_layout="Et|t|m|L",
                         untie_embeddings_and_output_weights=True)
    cfg = gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, mtp_num_layers=1,
               position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    mtp_chunk = build_model_chunks(cfg, ParallelContext.fake(small, 0), device="meta")[1]
    loss_chunk = build_model_chunks(cfg, ParallelContext.fake(small, 1), device="meta")[1]
    names = {n for n, _ in mtp_chunk.named_global_parameters()}
    assert {"decoder.final_layernorm.weight", "embedding.word_embeddings.weight",
            "mtp.layers.0.eh_proj.weight"} <= names
    assert not any(n.startswith("decoder.layers.") for n in names) and mtp_chunk.output_layer is None
    w = mtp_chunk.embedding.word_embeddings.weight
    assert w.shared_embedding and w.embedding_copy
    assert {n for n, _ in loss_chunk.named_global_parameters()} == {"output_layer.weight"}
    # with labels the MTP stage sends the decoder's hidden states and the depth's along the sequence, which the loss
    # stage splits ([1 + D, b, s] losses); generation (no labels) sends and reads the hidden states alone
    set_random_seed(0)
    mtp_chunk = build_model_chunks(cfg, ParallelContext.fake(small, 0))[1]
    loss_chunk = build_model_chunks(cfg, ParallelContext.fake(small, 1))[1]
    for chunk in (mtp_chunk, loss_chunk):
        chunk.init_parameters(0)
    ids = torch.randint(0, 64, (2, 16))
    mtp_chunk.set_input_tensor(torch.randn(16, 2, 32))
    assert mtp_chunk(ids, labels=ids).shape == (32, 2, 32) and mtp_chunk(ids).shape == (16, 2, 32)
    loss_chunk.set_input_tensor(torch.randn(32, 2, 32))
    assert loss_chunk(ids, labels=ids).shape == (2, 2, 16)
    loss_chunk.set_input_tensor(torch.randn(16, 2, 32))
    assert loss_chunk(ids).shape == (2, 16, cfg.padded_vocab_size(1))


def test_dims_name_the_layout_flags():
    """Built directly (not from the flags), a layout's stage count must match pp x vp; the flag line says so."""
    with pytest.raises(ConfigError) as e:
        parallel_dims(world_size=2, pp=2, pipeline_model_parallel_layout="E|tt|t|tL")
    assert str(e.value) == (f"{LAYOUT} 'E|tt|t|tL' has 4 stages but --pipeline-model-parallel-size 2 x 1 virtual "
                            "stages per rank is 2; the layout sets the virtual stages: drop "
                            "--num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage)")
    with pytest.raises(ConfigError, match="^account_for_loss_in_pipeline_split must be a bool, got 1$"):
        parallel_dims(world_size=2, pp=2, account_for_loss_in_pipeline_split=1)


@pytest.mark.parametrize("split", [[LAYOUT, "Et|tttL"], [EMB, "--num-layers", "5"], [FIRST, "1"]])
def test_planner_search_starts_from_even_splits(split):
    """The layout search tries other degrees: a run's own split does not carry over (it would not fit them)."""
    from megatronish.planner.hardware import load_hardware
    from megatronish.planner.search import ParamTable, candidates

    cfg = cfg_of(split + pp(2), world=2)
    table = ParamTable(cfg)
    assert sorted(table.layers) == list(range(cfg.model.num_layers))
    plans = list(candidates(cfg, load_hardware("A100-80G", 2)))
    assert plans and all(not p.parallel.custom_split for p in plans)
