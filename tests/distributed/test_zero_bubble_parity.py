"""Zero-bubble schedules with the split backward give the single-process model: under ZB-H1 at PP 2 and PP 4, ZBV
(two chunks per rank in a V: the hand-over on the last rank and both tied-embedding copies on rank 0) at PP 2 and
PP 4, and
DualPipeV (the same V, 2p microbatches or more) at PP 2 and PP 4, combined with TP 2 + sequence parallelism, full
recompute, data parallelism with overlapped (hook-launched) gradient reduction, the distributed optimizer's
reduce-scatter and ``--calculate-per-token-loss``, the loss and every gradient equal one process running the same
microbatches (fp32, rtol 1e-5), and so do the parameters after 8 SGD (momentum) steps. Each rank executes
exactly its action list's F/B/W order. One group of 4 ranks runs every case. The same checks cover uneven layer
splits (``--decoder-first/last-pipeline-num-layers``: 7 layers over PP 2 as 3+4 and 4+3, 10 over PP 4 as 1+3+3+3,
10 over PP 2 with 2 chunks as 4+6) under 1F1B, interleaved 1F1B, ZB-H1 and ZBV (and interleaved 1F1B at PP 4 x VP 2),
and layouts with an empty
(pass-through) stage: ZB-H1 ``Et||tt|tL`` at PP 4 (rank 1 holds nothing), ZBV ``Et|t||ttL`` (the V's turn on the
last rank empty) and DualPipeV ``E|tt||ttL`` at PP 2. Receives posted ahead
(``--overlap-p2p-communication``) give the same numbers under DualPipeV at PP 4, ZBV and interleaved 1F1B (whose
steady state then exchanges in two halves). Through the training step, in the same group: ZB-H1 at CP 2 x PP 2, ZBV
with mixture of experts at EP 2 x PP 2 (distributed optimizer, overlapped bucket reduction), ZBV with FSDP2 at
DP 2 x PP 2 (also with an empty stage, ``Et|tt||tL``) and DualPipeV at TP 2 + SP x PP 2 with selective recompute
equal one process (losses, every iteration's reduced gradients, the parameters after 8 iterations); ZBV under FP8
(delayed scaling, its wgrad GEMMs deferred to W) at DP 2 x PP 2 equals 1F1B in the same layout."""
import pytest
import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.model import GPTModel
from megatronish.model.build import build_model_chunks
from megatronish.optim.optimizer import build_optimizer, use_main_grads
from megatronish.parallel import groups
from megatronish.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.init import gather_to_global
from megatronish.parallel.pipeline.choose import forward_backward_func
from megatronish.parallel.pipeline.schedules import forward_backward_no_pipelining, pipeline_tensor_shape
from megatronish.parallel.pipeline.timeline import PipelineTimeline
from megatronish.parallel.pipeline.zero_bubble import SCHEDULES, schedule_actions
from megatronish.parallel.random import set_random_seed
from megatronish.testing import global_tensors, run_distributed
from megatronish.training import pretrain as training
from tests.distributed.test_context_parallel import BASE as CP_BASE
from tests.distributed.test_context_parallel import FLAVORS as CP_FLAVORS
from tests.distributed.test_pipeline_parity import FLAVORS as PARITY_FLAVORS
from tests.distributed.test_pipeline_parity import _forward_step as mean_loss_forward_step

SEED, MBS, S, V, H, NUM_MB, STEPS, WORLD = 1234, 2, 16, 100, 32, 4, 8, 4
FLAVORS = {name: (lambda layers=4, make=make: make().replace(num_layers=layers))
           for name, make in PARITY_FLAVORS.items()}


def _lr(per_token, num_mb=NUM_MB):  # per-token losses are sums: the same step size per token
    return 0.1 / (num_mb * MBS * S) if per_token else 0.1


def _options(case):
    """A case's trailing options: ``overlap`` (receives posted ahead), ``microbatches`` per iteration, ``layout``
    (``--pipeline-model-parallel-layout``)."""
    return {"overlap": False, "microbatches": NUM_MB, "layout": None, **(case[9] if len(case) > 9 else {})}


def _data(num_mb=NUM_MB):
    g = torch.Generator().manual_seed(99)
    return [(torch.randint(0, V, (MBS, S), generator=g), torch.randint(0, V, (MBS, S), generator=g))
            for _ in range(num_mb)]


def _forward_step(per_token):
    if not per_token:
        return mean_loss_forward_step()

    def forward_step(data_iterator, model):
        ids, labels = next(data_iterator)
        return model(ids, labels=labels), lambda losses: (losses.sum(), {"lm loss": losses.sum().detach()})

    return forward_step


@pytest.fixture(scope="module")
def references():
    """{(flavor, per_token, layers, microbatches): (losses, {name: first step's grad}, {name: parameter after STEPS
    steps})}."""
    refs = {}
    for flavor, per_token, layers, num_mb in sorted({(c[0], c[7], c[8][0], _options(c)["microbatches"])
                                                     for c in CASES}):
        set_random_seed(SEED)
        model = GPTModel(FLAVORS[flavor](layers))
        model.init_parameters(SEED)
        opt = build_optimizer(list(model.named_parameters()), "sgd", lr=_lr(per_token, num_mb), weight_decay=0.1)
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            stats = forward_backward_no_pipelining(_forward_step(per_token), iter(_data(num_mb)), model, num_mb,
                                                   per_token_loss=per_token)
            if step == 0:
                losses = torch.stack([s["lm loss"] for s in stats])
                grads = {n: p.grad.clone() for n, p in model.named_global_parameters()}
            opt.step()
        refs[(flavor, per_token, layers, num_mb)] = (losses, grads, {n: p.detach().clone()
                                                     for n, p in model.named_global_parameters()})
    return refs


def _check_case(flavor, schedule, tp, pp, sp, recompute, dist_opt, per_token, split, refs, overlap, num_mb, layout):
    layers, first, last = split
    what = f"{flavor} {schedule} TP{tp} PP{pp} DP{WORLD // (tp * pp)} SP={sp} recompute={recompute} " \
           f"dist-opt={dist_opt} per-token={per_token} layers {layers} first {first} last {last} " \
           f"overlap={overlap} microbatches {num_mb} layout {layout}"
    cfg = FLAVORS[flavor](layers)
    if recompute:
        cfg = cfg.replace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, vp=1 if schedule in ("1f1b", "zb-h1") else 2,
                        tie_embeddings=not cfg.untie_embeddings_and_output_weights, pipeline_schedule=schedule,
                        decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                        pipeline_model_parallel_layout=layout)
    groups.destroy_model_parallel()
    ctx = groups.initialize_model_parallel(dims)
    set_random_seed(SEED, pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank)
    chunks = build_model_chunks(cfg, ctx, sequence_parallel=sp)
    ddps = []
    for chunk in chunks:
        chunk.init_parameters(SEED)
        ddps.append(DistributedDataParallel(chunk, dp_group=ctx.dp_cp_group, overlap_grad_reduce=True,
                                            use_distributed_optimizer=dist_opt, average=not per_token,
                                            bucket_size=2000))
    dp, dp_rank = ctx.dp_size, ctx.dp_rank
    mine = _data(num_mb)[dp_rank::dp]
    shape = pipeline_tensor_shape(S, MBS, H, tp=tp, sequence_parallel=sp)
    ref_losses, ref_grads, ref_params = refs[(flavor, per_token, layers, num_mb)]
    named = [(c, ddp, n, p) for c, ddp in zip(chunks, ddps) for n, p in c.named_global_parameters()]
    params = [(n, p) for c in chunks for n, p in c.named_parameters()]  # none on a rank of empty stages
    optimizer = build_optimizer(params, "sgd", lr=_lr(per_token, num_mb), weight_decay=0.1) if params else None

    for step in range(STEPS):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        timeline = PipelineTimeline(dist.get_rank())
        model = ddps if len(ddps) > 1 else ddps[0]
        data = [iter(mine) for _ in ddps] if len(ddps) > 1 else iter(mine)
        run = forward_backward_func(pp, dims.vp, schedule)
        stats = run(_forward_step(per_token), data, model, len(mine), tensor_shape=shape, parallel=ctx,
                    timeline=timeline, per_token_loss=per_token, overlap_p2p_comm=overlap)
        finalize_model_grads(ddps, ctx)
        if step > 0:
            if optimizer is not None:
                use_main_grads(optimizer)
                optimizer.step()
            continue
        executed = [(e["name"], e["microbatch"], e["chunk"]) for e in timeline.events if e["cat"] == "compute"]
        if overlap:  # the receives posted ahead were waited for when used
            assert any(e["name"].startswith("wait_") for e in timeline.events), what
        if schedule in SCHEDULES:
            planned = [(a.op, a.microbatch, a.chunk) for a in schedule_actions(schedule, pp, len(mine))[ctx.pp_rank]
                       if a.op in "FBW"]
            assert executed == planned, f"{what}: executed order differs from the action list"
        if ctx.holds_loss:
            losses = torch.stack([s["lm loss"] for s in stats])
            every = [torch.empty_like(losses) for _ in range(dp)]
            dist.all_gather(every, losses, group=ctx.dp_group)
            got = torch.stack(every, 1).reshape(-1)  # microbatch i came from DP rank i % dp
            torch.testing.assert_close(got, ref_losses, rtol=1e-5, atol=0, msg=lambda m: f"{what} loss: {m}")
        for _, ddp, name, p in named:
            if dist_opt:  # only this rank's shard of each bucket holds the reduced gradient
                bucket = ddp.bucket_of(p)
                lo, hi = bucket.shard()
                plo, phi = ddp.param_range[id(p)]
                a, b = max(plo, bucket.start + lo), min(phi, bucket.start + hi)
                if a < b:
                    ref = ref_grads[name].reshape(-1)[a - plo:b - plo]
                    torch.testing.assert_close(ddp.grad_buffer[a:b], ref, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{what} grad shard {name}: {m}")
                continue
            g = gather_to_global(p.main_grad, p.desc, ctx.tp_group)
            ref = ref_grads[name]
            if g.shape != ref.shape:  # padded vocabulary rows
                g = g[: ref.shape[0]]
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} grad {name}: {m}")
        if not dist_opt and optimizer is not None:
            use_main_grads(optimizer)
            optimizer.step()
    if not dist_opt:  # parameters after the steps
        for _, _, name, p in named:
            w = gather_to_global(p.detach(), p.desc, ctx.tp_group)[: ref_params[name].shape[0]]
            torch.testing.assert_close(w, ref_params[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what} parameter {name} after {STEPS} steps: {m}")


EVEN = (4, None, None)  # (layers, first rank's, last rank's)
# (flavor, schedule, tp, pp, sequence_parallel, full recompute, distributed optimizer, per-token loss, split)
CASES = [
    ("llama", "zb-h1", 1, 4, False, False, False, False, EVEN),  # PP 4
    ("gpt2", "zb-h1", 2, 2, True, True, False, False, EVEN),  # TP 2 + SP x PP 2, full recompute, tied embeddings
    ("llama", "zb-h1", 1, 2, False, True, True, False, EVEN),  # PP 2 x DP 2, distributed optimizer, recompute
    ("llama", "zb-h1", 2, 2, True, False, False, True, EVEN),  # TP 2 + SP x PP 2, per-token loss
    ("gpt2", "zbv", 1, 2, False, False, False, False, EVEN),  # V at PP 2 x DP 2, tied embeddings both on rank 0
    ("gpt2", "zbv", 2, 2, True, False, False, False, EVEN),  # V at TP 2 + SP x PP 2, tied embeddings
    ("llama", "zbv", 1, 2, False, False, True, True, EVEN, {"overlap": True}),  # V at PP 2 x DP 2, distributed
    # optimizer, per-token loss, receives posted ahead
    ("llama", "zbv", 1, 4, False, False, False, False, (8, None, None)),  # V at PP 4: 8 stages
    ("gpt2", "dualpipev", 2, 2, True, False, False, False, EVEN),  # TP 2 + SP x PP 2, tied embeddings, m = 2p
    ("llama", "dualpipev", 1, 4, False, False, False, False, (8, None, None), {"overlap": True, "microbatches": 8}),
    ("llama", "interleaved-1f1b", 2, 2, True, False, False, False, EVEN, {"overlap": True}),  # steady state halves
    ("llama", "interleaved-1f1b", 1, 4, False, False, False, False, (8, None, None)),  # PP 4 x VP 2
    # uneven splits
    ("llama", "1f1b", 1, 2, False, False, False, False, (7, 3, None)),  # 3 + 4
    ("llama", "zb-h1", 1, 2, False, False, True, False, (7, 3, None)),  # 3 + 4, distributed optimizer
    ("llama", "zb-h1", 2, 2, True, False, False, False, (7, None, 3)),  # 4 + 3, TP 2 + SP
    ("gpt2", "1f1b", 1, 4, False, False, False, False, (10, 1, None)),  # 1 + 3 + 3 + 3, tied embeddings
    ("gpt2", "zb-h1", 1, 4, False, False, False, False, (10, 1, None)),
    ("gpt2", "interleaved-1f1b", 1, 2, False, False, False, False, (10, 4, None)),  # chunks 2, 3, 2, 3
    ("llama", "zbv", 1, 2, False, False, False, False, (10, 4, None)),  # V: stages 2, 3, 3, 2
    # empty (pass-through) stages
    ("llama", "zb-h1", 1, 4, False, False, False, False, EVEN, {"layout": "Et||tt|tL"}),  # rank 1 holds nothing
    ("gpt2", "zbv", 1, 2, False, False, False, False, EVEN, {"layout": "Et|t||ttL"}),  # the V's turn is empty
    ("llama", "dualpipev", 1, 2, False, False, False, False, EVEN, {"layout": "E|tt||ttL", "microbatches": 8}),
]


# Through the training step (configs_from_args -> setup -> train_step), where the run's wrapping decides: context
# parallelism (the loss's token count summed over CP, attention's ring exchange inside B), mixture of experts over
# expert parallelism (the expert weights' gradients computed in B; their buckets reduced over the expert-DP group,
# launched by the hooks at the last W), FSDP2 (gradients accumulated unsharded, one reduce-scatter after the last W)
# and selective recompute. Every iteration's reduced gradients (before the step), the losses and the parameters
# after the steps equal the one-process run of the same flags without the layout's.
# Llama (GQA), sequence 32, SGD, 4 layers (the CP test trains 2)
TRAIN_BASE = CP_BASE + CP_FLAVORS["llama"] + ["--num-layers", "4", "--train-iters", str(STEPS)]
TRAIN_MODELS = {"dense": [], "moe": ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff",
                                     "1e-2", "--moe-z-loss-coeff", "1e-3"],
                "fp8": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "2", "--fp8-amax-compute-algo", "max"]}
PP2 = ["--pipeline-model-parallel-size", "2"]
TRAIN_CASES = [  # (model, the layout's flags)
    ("dense", PP2 + ["--pipeline-schedule", "zb-h1", "--context-parallel-size", "2"]),  # CP 2 x PP 2
    ("moe", PP2 + ["--pipeline-schedule", "zbv", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--ddp-bucket-size", "2000"]),  # EP 2 (DP 2) x PP 2
    ("dense", PP2 + ["--pipeline-schedule", "zbv", "--use-torch-fsdp2"]),  # FSDP2 DP 2 x PP 2, two units per rank
    ("dense", PP2 + ["--pipeline-schedule", "zbv", "--use-torch-fsdp2", "--pipeline-model-parallel-layout",
                     "Et|tt||tL"]),  # FSDP2 beside an empty stage (nothing to shard there)
    ("dense", PP2 + ["--pipeline-schedule", "dualpipev", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--recompute-activations"]),  # TP 2 + SP x PP 2, selective recompute, m = 2p
    # FP8 (delayed scaling, amaxes max-reduced over DP 2) x PP 2: the FP8 linears' wgrad GEMMs wait for W. Its
    # reference is 1F1B in the same layout, not one process: FP8 casts the gradients as each rank's backward sees
    # them, 1/microbatches of its loss, and at the first steps' scale (1) the smallest underflow, so a layout with
    # another microbatch count per rank rounds differently (docs/precision.md)
    ("fp8", PP2 + ["--pipeline-schedule", "zbv"], PP2 + ["--pipeline-schedule", "1f1b"]),
]


def _train(rank, world, model, argv=()):
    """Losses, every iteration's reduced gradients and the parameters after the steps (numpy, by global name)."""
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(TRAIN_BASE + TRAIN_MODELS[model] + list(argv)), world))
    grads, step = [], run.optimizer.step

    def step_after_recording():
        grads.append({n: g.numpy() for n, g in global_tensors(run.models, run.parallel, grads=True,
                                                              optimizer=run.optimizer).items()})
        return step()

    run.optimizer.step = step_after_recording
    losses = [training.train_step(run, state).loss for _ in range(STEPS)]
    params = {n: t.numpy() for n, t in global_tensors(run.models, run.parallel).items()}
    groups.destroy_model_parallel()
    return losses, grads, params


@pytest.fixture(scope="module")
def train_references():
    models = sorted({model for model, _, *ref_argv in TRAIN_CASES if not ref_argv})  # one-process references
    return {model: run_distributed(_train, 1, model)[0] for model in models}


def _check_train_case(model, argv, refs, ref_argv=None):
    """``ref_argv``: the reference is that layout (else one process)."""
    what = f"{model} {' '.join(argv)}"
    ref = refs[model] if ref_argv is None else _train(dist.get_rank(), WORLD, model, ref_argv)
    (losses, grads, params), (r_losses, r_grads, r_params) = _train(dist.get_rank(), WORLD, model, argv), ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    assert len(grads) == len(r_grads) == STEPS, what
    for it, (got, ref) in enumerate(zip(grads + [params], r_grads + [r_params])):
        kind = f"grad of iteration {it + 1}" if it < STEPS else f"parameter after {STEPS} steps"
        assert got.keys() == ref.keys(), f"{what} {kind}: {sorted(got.keys() ^ ref.keys())}"
        for name in ref:
            g, r = torch.from_numpy(got[name]), torch.from_numpy(ref[name])
            if g.shape != r.shape:  # the vocabulary padded to a multiple of 128 x TP: the rows past one process's
                n = min(len(g), len(r))  # padding stay zero
                assert not g[n:].any() and not r[n:].any(), f"{what} {kind}: padded rows of {name}"
                g, r = g[:n], r[:n]
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {kind} {name}: {m}")


def _worker(rank, world, cases, refs, train_cases=(), train_refs=None):
    for case in cases:
        _check_case(*case[:9], refs, *_options(case).values())
    for model, argv, *ref_argv in train_cases:
        _check_train_case(model, argv, train_refs, *ref_argv)
    groups.destroy_model_parallel()
    return True


def test_zero_bubble_parity(references, train_references):
    assert all(run_distributed(_worker, WORLD, CASES, references, TRAIN_CASES, train_references, timeout=300))
