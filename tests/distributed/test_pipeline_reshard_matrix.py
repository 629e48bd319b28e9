"""Every pipeline schedule and stage split resumes from every other's checkpoint. A tiny GPT (4 layers, hidden 32,
sequence 16, 4 microbatches) trains two iterations and saves under each configuration at PP 2: 1F1B, interleaved
1F1B (VP 2), ZB-H1, ZBV, DualPipeV (when the schedule exists), a layout with an embedding-only and a loss-only stage
over VP 2 (``E|ttt|t|L``), a 3 + 1 split (``--decoder-first-pipeline-num-layers 3``) and ``Et|tttL`` (1 + 3), and
once in one process. Each checkpoint is loaded under every PP 2 configuration, which runs the third iteration:
every pair's loss and every parameter after it (gathered under its global name) equal the uninterrupted
one-process run's (fp32, rtol 1e-5). The one-process checkpoint loads through ``setup``'s ``--load``; the others
are then loaded into that run as ``setup`` loads (a stale optimizer, scheduler or RNG state would show). No
weights are copied: every run starts from (seed, global name) or from a checkpoint.

In the same worker group, each schedule's peak activation memory per rank (equal stages, PP 2, 4 microbatches,
hidden 64, sequence 32, dropout on) is measured over one iteration and compared with the planner's per-rank
prediction (``planner/activations.stage_activations``, CPU terms) within 10%: the saved-tensor hooks count what
autograd keeps, and the tensors the zero-bubble schedules' deferred ``W`` keeps (each queued weight GEMM's input and
output gradient) count from the ``B`` that queues them to their ``W``. ``pytest -s`` prints the table;
``benchmarks/bench_pipeline_memory.py`` runs the same measurement at PP 4 (8 microbatches)."""
import dataclasses
import io
import os
import tempfile
from contextlib import contextmanager, redirect_stdout

import pytest
import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.checkpoint.manager import Checkpointer
from megatronish.parallel import groups
from megatronish.parallel.dims import PIPELINE_SCHEDULES
from megatronish.parallel.weight_grad import WeightGradStore
from megatronish.planner.activations import stage_activations
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training
from megatronish.training.memory import SavedActivationCounter
from megatronish.training.state import TrainState

SAVED_AT, ITERS = 2, 3
LAYOUT, SCHEDULE = "--pipeline-model-parallel-layout", "--pipeline-schedule"
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "11"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# every PP 2 configuration of the matrix (a new schedule is one entry)
CONFIGS = {
    "1f1b": [SCHEDULE, "1f1b"],
    "interleaved": [SCHEDULE, "interleaved-1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
    "zb-h1": [SCHEDULE, "zb-h1"],
    "zbv": [SCHEDULE, "zbv"],
    "dualpipev": [SCHEDULE, "dualpipev"],
    "E|ttt|t|L": [LAYOUT, "E|ttt|t|L"],
    "first 3": ["--decoder-first-pipeline-num-layers", "3"],
    "Et|tttL": [LAYOUT, "Et|tttL"],
}
CONFIGS = {name: argv for name, argv in CONFIGS.items() if name != "dualpipev" or "dualpipev" in PIPELINE_SCHEDULES}
ONE = "one process"
# the memory measurement's model (the planner's CPU terms are exact to a few percent at this size, with dropout)
MEMORY = ["--hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "100",
          "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
MEMORY_SCHEDULES = [n for n in ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev") if n in CONFIGS]


def _global_params(run) -> dict:
    """Every parameter of the model under its global name, from all pipeline ranks (the tied output layer's copy
    is the word embedding's name: the two are equal)."""
    mine = {name: p.detach().clone() for m in run.models for name, p in m.named_global_parameters()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: t for part in everyone for name, t in part.items()}


def _setup(argv, world):
    groups.destroy_model_parallel()  # the accessors' context only: each run keeps its own groups
    cfg = configs_from_args(parse_args(BASE + argv), world)
    with redirect_stdout(io.StringIO()):
        run, state = training.setup(cfg)
    return cfg, run, state


def _result(losses, run):
    return losses, {name: t.numpy() for name, t in _global_params(run).items()}  # (tensors do not cross processes)


def _resume(cfg, run, path):
    """Load ``path`` into a live run as ``setup`` does for ``--load`` (:meth:`Checkpointer.load`, then the master
    copies from the loaded model): the model, optimizer, scheduler, RNG and counters all come from the checkpoint,
    none from the run's own two iterations."""
    ck = dataclasses.replace(cfg.checkpoint, load=path, save=None)
    checkpointer = Checkpointer(dataclasses.replace(cfg, checkpoint=ck), run.models, run.optimizer, run.scheduler,
                                parallel=run.parallel, rng_tracker=run.rng_tracker)
    state = TrainState()
    with redirect_stdout(io.StringIO()):
        assert checkpointer.load(state) and state.iteration == SAVED_AT
    run.optimizer.reload_model_params()
    return state


def _train_and_save(cfg, run, state, until):
    losses = []
    while state.iteration < until:
        losses.append(training.train_step(run, state).loss)
        if state.iteration == SAVED_AT:
            with redirect_stdout(io.StringIO()):
                run.checkpointer.save(state)
                run.checkpointer.wait()
    return losses


def _one_process(rank, world, root):
    """The reference: three uninterrupted iterations (saving after the second)."""
    cfg, run, state = _setup(["--save", os.path.join(root, ONE)], world)
    return _result(_train_and_save(cfg, run, state, ITERS), run)


@contextmanager
def _counting_activations(run):
    """Saved activations (:class:`SavedActivationCounter`) plus what deferred weight-gradient work holds: the
    tensors a queued GEMM's closure references (its linear's input and output gradient), counted from the ``B``
    that queues it until its ``W`` has run (as one storage each, shared with the saved tensors)."""
    counter = SavedActivationCounter([p for m in run.models for p in m.parameters()])
    put = WeightGradStore.put

    def holding_put(store, params, compute):
        held = [counter._pack(c.cell_contents) for c in compute.__closure__ or () if torch.is_tensor(c.cell_contents)]
        if not held:
            raise AssertionError("queued weight-gradient work references no tensor")
        put(store, params, lambda: (held, compute())[1])  # released with the queue entry, after its W

    WeightGradStore.put = holding_put
    try:
        with counter:
            yield counter
    finally:
        WeightGradStore.put = put


def _peak_memory(world):
    """Each schedule's measured peak over one iteration (the second: the run's own meter takes the first)."""
    peaks = {}
    for name in MEMORY_SCHEDULES:
        cfg, run, state = _setup(PP2 + CONFIGS[name] + MEMORY, world)
        training.train_step(run, state)
        with _counting_activations(run) as counter:
            training.train_step(run, state)
        peaks[name] = counter.peak
    return peaks


def _matrix(rank, world, root):
    peaks = _peak_memory(world)
    for name, argv in CONFIGS.items():  # two iterations and a save under each configuration
        cfg, run, state = _setup(PP2 + argv + ["--save", os.path.join(root, name)], world)
        _train_and_save(cfg, run, state, SAVED_AT)
    out, runs = {}, {}
    for saved in [ONE, *CONFIGS]:  # each checkpoint continued under each configuration
        for name, argv in CONFIGS.items():
            if saved == ONE:  # the one-process checkpoint through setup's own --load
                cfg, run, state = _setup(PP2 + argv + ["--load", os.path.join(root, ONE)], world)
                runs[name] = cfg, run
            else:  # the others into that run again
                cfg, run = runs[name]
                state = _resume(cfg, run, os.path.join(root, saved))
            losses, params = _result([training.train_step(run, state).loss], run)
            out[(saved, name)] = (losses, params if rank == 0 else None)
    groups.destroy_model_parallel()
    return out, peaks


@pytest.fixture(scope="module")
def measured():
    """The one-process reference, then every save, load and memory measurement in one group of two workers."""
    with tempfile.TemporaryDirectory() as root:
        reference, = run_distributed(_one_process, 1, root, timeout=120)
        return reference, run_distributed(_matrix, 2, root, timeout=600)


def test_every_schedule_and_layout_resumes_from_every_other(measured):
    (ref_losses, ref_params), results = measured
    expected = torch.tensor(ref_losses[SAVED_AT:], dtype=torch.float64)
    for rank, (out, _) in enumerate(results):
        assert len(out) == (len(CONFIGS) + 1) * len(CONFIGS)
        for (saved, name), (losses, params) in out.items():
            pair = f"saved under {saved}, loaded under {name} (rank {rank})"
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), expected, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{pair}: loss {m}")
            if params is None:
                continue
            assert params.keys() == ref_params.keys(), pair
            for key, value in ref_params.items():
                # the key part of the QKV bias has no gradient in exact arithmetic (softmax ignores a shift of
                # the scores); Adam normalises its rounding noise, so those entries move by ~1e-7 (lr 3e-3)
                atol = 1e-6 if key.endswith("linear_qkv.bias") else 1e-7
                torch.testing.assert_close(torch.from_numpy(params[key]), torch.from_numpy(value), rtol=1e-5,
                                           atol=atol, msg=lambda m: f"{pair}: {key} {m}")


def test_peak_activation_memory_per_schedule_matches_the_planner(measured, capsys):
    _, results = measured
    rows, problems = [], []
    for name in MEMORY_SCHEDULES:
        cfg = configs_from_args(parse_args(BASE + PP2 + CONFIGS[name] + MEMORY), 2)
        for rank, (_, peaks) in enumerate(results):
            act = stage_activations(cfg, rank, cpu=True)
            got = peaks[name]
            rows.append(f"{name:12s} rank {rank}  in flight {act.in_flight}  deferred W {act.deferred / 2**10:7.1f} KiB"
                        f"  planner {act.total / 2**10:8.1f} KiB  measured {got / 2**10:8.1f} KiB"
                        f"  measured/planner {got / act.total:.3f}")
            if abs(got - act.total) > 0.10 * act.total:
                problems.append(rows[-1])
    with capsys.disabled():
        print("\npeak activation memory per rank, PP 2, 4 microbatches (m), 4 layers\n" + "\n".join(rows))
    assert not problems, "\n".join(problems)
