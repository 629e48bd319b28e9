"""Pipeline parallelism gives the single-process model: for GPT-2 (tied embeddings) and Llama (untied), the
loss and every parameter gradient under PP 2 / 4, VP 1 / 2, TP 2 x PP 2, PP 2 x DP 2 and TP 2 x PP 2 x DP 2
equal one process running the same microbatches without pipelining. So do uneven splits: 7 layers with 3 on
the first rank (3 + 4), layout strings with an embedding-only and a loss-only stage (``E|t*4|t*4|L`` at PP 4,
the tied copies on those two stages) and with VP (``E|ttt|ttt|ttL``, PP 2 x VP 2), and 7 layers over PP 4 with
the embedding counted as a layer (1 + 2 + 2 + 2), and layouts with an empty (pass-through) stage: ``Ettt|ttt||ttL``
(PP 2 x VP 2, tied) and ``Ettt||tttt|tL`` (PP 4: rank 1 holds nothing). No weights are copied: every layout
starts from (seed, global name). Also: the order each rank executed is :func:`schedule_table`'s, sent
activations were freed, and the tied embedding copies stay bitwise equal through optimizer steps."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatronish.config import gpt2, llama
from megatronish.model import GPTModel
from megatronish.model.build import build_model_chunks
from megatronish.optim.optimizer import build_optimizer, use_main_grads
from megatronish.parallel import groups
from megatronish.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.init import gather_to_global
from megatronish.parallel.pipeline.schedules import (
    forward_backward_no_pipelining,
    get_forward_backward_func,
    pipeline_tensor_shape,
    schedule_table,
)
from megatronish.parallel.pipeline.timeline import (
    PipelineTimeline,
    gather_timeline,
    read_chrome_trace,
    write_chrome_trace,
)
from megatronish.parallel.random import set_random_seed
from megatronish.testing import run_distributed

SEED, MBS, S, V, H, NUM_MB, STEPS = 1234, 2, 16, 100, 32, 8, 3
FLAVORS = {
    "gpt2": lambda: gpt2(num_layers=8, hidden_size=H, num_attention_heads=4, vocab_size=V, seq_length=S,
                         attention_dropout=0.0, hidden_dropout=0.0),
    "llama": lambda: llama(num_layers=8, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=64, vocab_size=V, seq_length=S, attention_dropout=0.0,
                           hidden_dropout=0.0),
    "gpt2-7": lambda: gpt2(num_layers=7, hidden_size=H, num_attention_heads=4, vocab_size=V, seq_length=S,
                           attention_dropout=0.0, hidden_dropout=0.0),
}


def _data():
    g = torch.Generator().manual_seed(99)
    return [(torch.randint(0, V, (MBS, S), generator=g), torch.randint(0, V, (MBS, S), generator=g))
            for _ in range(NUM_MB)]


def _forward_step(outputs=None):
    def forward_step(data_iterator, model):
        ids, labels = next(data_iterator)
        out = model(ids, labels=labels)  # per-token loss [b, s] on the last stage, else hidden [s, b, h]
        if outputs is not None and out.dim() == 3:
            outputs.append(out)

        def loss_func(losses):
            loss = losses.mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    return forward_step


@pytest.fixture(scope="module")
def references():
    """{flavor: (mean loss, {global name: grad})} from one process, no pipelining, all 8 microbatches."""
    refs = {}
    for flavor, make in FLAVORS.items():
        set_random_seed(SEED)
        model = GPTModel(make())
        model.init_parameters(SEED)
        stats = forward_backward_no_pipelining(_forward_step(), iter(_data()), model, NUM_MB)
        refs[flavor] = (torch.stack([s["lm loss"] for s in stats]).mean(),
                        {n: p.grad.clone() for n, p in model.named_global_parameters()})
    return refs


def _setup(world, flavor, tp, pp, vp, sp, split):
    cfg = FLAVORS[flavor]()
    dims = ParallelDims(world_size=world, tp=tp, pp=pp, vp=vp,
                        tie_embeddings=not cfg.untie_embeddings_and_output_weights, **split)
    groups.destroy_model_parallel()
    ctx = groups.initialize_model_parallel(dims)
    pp_rank, tp_rank = groups.get_pipeline_model_parallel_rank(), groups.get_tensor_model_parallel_rank()
    set_random_seed(SEED, pp_rank=pp_rank, tp_rank=tp_rank)
    chunks = build_model_chunks(cfg, ctx, sequence_parallel=sp)
    for chunk in chunks:
        chunk.init_parameters(SEED)
    return dims, [DistributedDataParallel(c, dp_group=ctx.dp_cp_group) for c in chunks]


def _iteration(dims, ddp, sp, timeline=None, outputs=None):
    """One training iteration's forward/backward over this DP rank's share of the 8 microbatches."""
    dp, dp_rank = groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()
    mine = _data()[dp_rank::dp]
    iterators = [iter(mine) for _ in ddp]  # each chunk reads microbatches 0..M-1
    func = get_forward_backward_func(dims.pp, dims.vp)
    shape = pipeline_tensor_shape(S, MBS, H, tp=dims.tp, sequence_parallel=sp)
    for chunk in ddp:
        chunk.zero_grad_buffer()
    stats = func(_forward_step(outputs), iterators if dims.vp > 1 else iterators[0], ddp if dims.vp > 1 else ddp[0],
                 len(mine), tensor_shape=shape, timeline=timeline, parallel=groups.get_context())
    finalize_model_grads(ddp, groups.get_context())
    return stats, len(mine)


def _check_case(world, flavor, tp, pp, vp, sp, refs, split=None):
    what = f"{flavor} TP{tp} PP{pp} VP{vp} DP{world // (tp * pp)} SP={sp} {split or ''}"
    dims, ddp = _setup(world, flavor, tp, pp, vp, sp, split or {})
    pp_rank = groups.get_pipeline_model_parallel_rank()
    timeline, outputs = PipelineTimeline(dist.get_rank()), []
    stats, M = _iteration(dims, ddp, sp, timeline, outputs)

    # the executed order is the schedule table's
    executed = [(e["name"], e["microbatch"], e["chunk"]) for e in timeline.events if e["cat"] == "compute"]
    assert executed == schedule_table(pp, vp, M, pp_rank), f"{what}: executed order differs from the table"
    # activations sent on were freed (only their autograd graph was kept)
    assert all(o.numel() == 1 for o in outputs), f"{what}: a sent activation kept its storage"

    # loss: on the last stage, DP-averaged
    ref_loss, ref_grads = refs[flavor]
    if groups.is_pipeline_last_stage():
        loss = torch.stack([s["lm loss"] for s in stats]).mean()
        dist.all_reduce(loss, group=groups.get_data_parallel_group())
        loss /= groups.get_data_parallel_world_size()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"{what} loss: {m}")
    else:
        assert stats == [], what

    # every gradient, gathered to its global shape
    seen = set()
    tp_group = groups.get_tensor_model_parallel_group()
    for chunk in ddp:
        for name, p in chunk.module.named_global_parameters():
            g = gather_to_global(p.main_grad, p.desc, tp_group)
            ref = ref_grads[name]
            if g.shape != ref.shape:  # the vocabulary is padded further at higher TP: padding grads are zero
                assert torch.all(g[ref.shape[0]:] == 0), f"{what} {name}: padding rows got gradient"
                g = g[: ref.shape[0]]
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} grad {name}: {m}")
            seen.add(name)
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    assert set().union(*everyone) == set(ref_grads), f"{what}: parameters missing from every rank"

    # tied embeddings: the first stage's word embedding and the last stage's output layer stay bitwise equal
    if not FLAVORS[flavor]().untie_embeddings_and_output_weights:
        shared = [p for c in ddp for p in c.module.parameters() if getattr(p, "shared_embedding", False)]
        before = [w.detach().clone() for w in shared]
        optimizer = build_optimizer([(n, p) for c in ddp for n, p in c.module.named_parameters()], "adam",
                                    lr=1e-2, weight_decay=0.1)
        for _ in range(STEPS):
            use_main_grads(optimizer)
            optimizer.step()
            _iteration(dims, ddp, sp)
        if groups.is_rank_in_embedding_group():
            (w,) = shared
            copies = [torch.empty_like(w) for _ in groups.get_group_ranks("embedding")]
            dist.all_gather(copies, w.detach(), group=groups.get_group("embedding"))
            assert len(copies) == 2 and torch.equal(copies[0], copies[1]), f"{what}: tied copies diverged"
            if groups.get_tensor_model_parallel_rank() == 0:  # (rank 1's slice is vocabulary padding at TP 2)
                assert not torch.equal(w.detach(), before[0]), f"{what}: the optimizer did not move the weights"
        else:
            assert shared == [], what
    return timeline


def _worker(rank, world, cases, refs, trace_path):
    for i, case in enumerate(cases):
        timeline = _check_case(world, *case[:5], refs, *case[5:])
        if i == 0 and trace_path:  # the timeline tool end to end on the first case
            events = gather_timeline(timeline)
            if rank == 0:
                write_chrome_trace(trace_path, events, {"p": case[3], "v": case[4]})
                back, meta = read_chrome_trace(trace_path)
                assert {e["rank"] for e in back} == set(range(world)) and meta["p"] == case[3]
                assert {"F", "B"} <= {e["name"] for e in back} and any(e["cat"] == "comm" for e in back)
    groups.destroy_model_parallel()
    return True


# (flavor, tp, pp, vp, sequence_parallel[, the layer split's ParallelDims fields])
EVEN = ("gpt2", "llama")
CASES = {
    2: [(f, 1, 2, vp, False) for f in EVEN for vp in (1, 2)]
       + [("gpt2-7", 1, 2, 1, False, {"decoder_first_pipeline_num_layers": 3}),
          ("llama", 1, 2, 2, False, {"pipeline_model_parallel_layout": "E|ttt|ttt|ttL"}),
          ("gpt2", 1, 2, 2, False, {"pipeline_model_parallel_layout": "Ettt|ttt||ttL"})],  # an empty stage
    4: [(f, 1, 4, vp, False) for f in EVEN for vp in (1, 2)]  # PP 4
       + [("gpt2", 2, 2, 1, True), ("llama", 2, 2, 2, True), ("gpt2", 2, 2, 2, False), ("llama", 2, 2, 1, False)]
       + [(f, 1, 2, vp, False) for f in EVEN for vp in (1, 2)]  # PP 2 x DP 2
       + [("gpt2", 1, 4, 1, False, {"pipeline_model_parallel_layout": "E|t*4|t*4|L"}),
          ("gpt2-7", 1, 4, 1, False, {"account_for_embedding_in_pipeline_split": True}),
          ("llama", 1, 4, 1, False, {"pipeline_model_parallel_layout": "Ettt||tttt|tL"})],  # rank 1 holds nothing
    8: [("gpt2", 2, 2, 2, True), ("llama", 2, 2, 1, True)],  # TP 2 x PP 2 x DP 2
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_parity(world, references):
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        assert all(run_distributed(_worker, world, CASES[world], references, trace, timeout=300))
        assert os.path.getsize(trace) > 0
