"""Peak activation memory of every pipeline schedule per rank at p = 4, measured beside the planner's prediction.

The same measurement as ``tests/distributed/test_pipeline_reshard_matrix.py`` (its p = 2 table, imported from it):
a tiny GPT with equal stages (hidden 64, sequence 32, dropout on, fp32) trains one iteration, then the peak over a
second iteration is taken from the saved-tensor hooks (what autograd keeps) plus the tensors each queued weight
GEMM of the split backward keeps from its ``B`` to its ``W``; the planner's figure is
``planner/activations.stage_activations(cfg, rank, cpu=True)`` (``walk_peak`` for zb-h1, zbv and
dualpipev). Every schedule runs on ``--p`` forked gloo ranks with ``--m`` microbatches of 2 sequences and
``2 p x --layers-per-stage`` layers: ``--layers-per-stage`` per chunk under the two-chunk schedules (interleaved with
VP 2, zbv, dualpipev), twice that per rank under 1F1B and zb-h1. The test checks p = 2 (m = 4); this prints p = 4
(m = 8) in a few seconds, too many for the suite's four more processes.

    python benchmarks/bench_pipeline_memory.py [--p 4 --m 8 --layers-per-stage 1]
"""
from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout

from megatronish.arguments import configs_from_args, parse_args
from megatronish.planner.activations import stage_activations
from megatronish.testing import repo_test_module, run_distributed
from megatronish.training import pretrain as training

_TEST = repo_test_module("distributed/test_pipeline_reshard_matrix.py")  # the test's own model and runs, not a copy
BASE, CONFIGS, MEMORY, MEMORY_SCHEDULES = _TEST.BASE, _TEST.CONFIGS, _TEST.MEMORY, _TEST.MEMORY_SCHEDULES
_counting_activations, _setup = _TEST._counting_activations, _TEST._setup


def _argv(name: str, p: int, m: int, layers_per_stage: int) -> list[str]:
    """The test's model and schedule at ``p`` ranks, ``m`` microbatches of 2, ``layers_per_stage`` per virtual
    stage (the later flags override BASE's)."""
    return BASE + CONFIGS[name] + MEMORY + [
        "--pipeline-model-parallel-size", str(p), "--num-layers", str(2 * p * layers_per_stage),
        "--micro-batch-size", "2", "--global-batch-size", str(2 * m)]


def _worker(rank, world, m, layers_per_stage):
    peaks = {}
    for name in MEMORY_SCHEDULES:
        cfg, run, state = _setup(_argv(name, world, m, layers_per_stage), world)
        with redirect_stdout(io.StringIO()):
            training.train_step(run, state)  # the run's own meter takes the first iteration
            with _counting_activations(run) as counter:
                training.train_step(run, state)
        peaks[name] = counter.peak
    return peaks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4, help="pipeline ranks (forked gloo processes)")
    ap.add_argument("--m", type=int, default=8, help="microbatches per iteration (a multiple of --p)")
    ap.add_argument("--layers-per-stage", type=int, default=1)
    args = ap.parse_args(argv)
    if args.p < 2 or args.m % args.p:
        ap.error(f"--m {args.m} must be a multiple of --p {args.p} (>= 2): the interleaved schedule needs it")
    results = run_distributed(_worker, args.p, args.m, args.layers_per_stage, timeout=1800)
    print(f"peak activation memory per rank, p {args.p}, m {args.m}, {2 * args.p * args.layers_per_stage} layers, "
          f"hidden 64, sequence 32, fp32; measured = saved tensors + deferred W's tensors")
    print(f"{'schedule':<12} rank  {'in flight':>9}  {'deferred W':>10}  {'planner':>10}  {'measured':>10}  "
          f"measured / planner")
    worst = 0.0
    for name in MEMORY_SCHEDULES:
        cfg = configs_from_args(parse_args(_argv(name, args.p, args.m, args.layers_per_stage)), args.p)
        for rank, peaks in enumerate(results):
            act = stage_activations(cfg, rank, cpu=True)
            ratio = peaks[name] / act.total
            worst = max(worst, abs(ratio - 1))
            print(f"{name:<12} {rank:>4}  {act.in_flight:>9}  {act.deferred / 2**10:>6.1f} KiB  "
                  f"{act.total / 2**10:>6.1f} KiB  {peaks[name] / 2**10:>6.1f} KiB  {ratio:.3f}", flush=True)
    print(f"largest |measured / planner - 1|: {worst:.3f}")


if __name__ == "__main__":
    main()
