"""The planner against published runs and against this machine.

    python benchmarks/bench_planner.py published [--fit] [--search]
    python benchmarks/bench_planner.py cpu [--rounds 2 --iters 4]

``published``: torchtitan's Llama 3.1 8B / 70B / 405B H100 runs (benchmarks/llama3_h100_202412_torchtitan.md in
pytorch/torchtitan, December 2024: 96 GB HBM2e H100s at 500 W, ``benchmarks/hardware/h100_96gb_500w.toml``) and
Megatron-LM's GPT-3 175B (its README's model table: H100 SXM at 700 W, ``benchmarks/hardware/h100_sxm_700w.toml``),
each modelled as stated (layout, batch, sequence, activation checkpointing, Float8 GEMMs, torch.compile,
asynchronous TP), predicted vs published tokens/s/GPU, TFLOP/s/GPU, MFU and peak memory with ratios. Each card is
its own hardware table (``benchmarks/hardware/``) with its own efficiencies; ``--fit`` fits them per card on that
card's runs marked ``fit`` (a grid, least squares of log ratios), prints them and uses them (the hardware files
carry the values it printed); ``--search`` ranks every layout for each published run's model, GPU count and batch
and says where the published layout lands.

``cpu``: the planner on ``cpu-this-machine`` against the real ``train_step`` in forked gloo ranks (1, 2 and 4
processes on this machine's cores; each rank runs one thread, so the one-thread probe's compute rates are shared
out when there are more ranks than cores; the probe is the median of three), each layout's fastest step of
``--iters`` after two warm-up steps in each of ``--rounds`` rounds (layouts alternated; the slowest rank's), against
the prediction: the probe times each kernel's fastest call, the machine's own speed, and the fastest step is the
layout's own, free of other processes' load as far as one step can be; the rounds' median steps beside it, the load
average as each measurement ends, each layout's predicted terms and the count within 25%.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import math
import os
import statistics
import time
from contextlib import redirect_stdout

HW_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")
HW_FILE = os.path.join(HW_DIR, "h100_96gb_500w.toml")  # torchtitan's cards
SXM_FILE = os.path.join(HW_DIR, "h100_sxm_700w.toml")  # Megatron-LM's
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "10", "--lr", "1e-4", "--bf16"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "8", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--vocab-size", "128256", "--attention-dropout", "0", "--hidden-dropout", "0"]
L8B = LLAMA + ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size",
               "14336"]
L70B = LLAMA + ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--ffn-hidden-size",
                "28672"]
# 126 layers do not split into 8 (or 16) stages: 128 modelled, the step time scaled by 126/128
L405B = LLAMA + ["--num-layers", "128", "--hidden-size", "16384", "--num-attention-heads", "128",
                 "--ffn-hidden-size", "53248"]
GPT3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--vocab-size", "131072",
        "--seq-length", "4096", "--max-position-embeddings", "4096"]


def seq(n: int) -> list[str]:
    return ["--seq-length", str(n), "--max-position-embeddings", str(n)]


FSDP, SEL = ["--use-torch-fsdp2"], ["--recompute-granularity", "selective"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
TT = "torchtitan llama3_h100_202412"
# name, source, world, flags, options (fp8, compile, async_tp, layers_scale), published tokens/s/GPU, GiB, fit
RUNS = [
    ("8B FSDP8 bf16", f"{TT} Table 1", 8, L8B + seq(8192) + FSDP + SEL + ["--micro-batch-size", "2",
                                                                         "--global-batch-size", "16"],
     {}, 5762, 82.4, True),
    ("8B FSDP8 compile", f"{TT} Table 1", 8, L8B + seq(8192) + FSDP + SEL + ["--micro-batch-size", "2",
                                                                            "--global-batch-size", "16"],
     {"compile": True}, 6667, 77.0, False),
    ("8B FSDP8 compile fp8", f"{TT} Table 1", 8, L8B + seq(8192) + FSDP + SEL + ["--micro-batch-size", "2",
                                                                                "--global-batch-size", "16"],
     {"compile": True, "fp8": True}, 8532, 76.8, False),
    ("8B FSDP128 bf16", f"{TT} Table 3", 128, L8B + seq(8192) + FSDP + SEL + ["--micro-batch-size", "2",
                                                                             "--global-batch-size", "256"],
     {}, 5605, 67.0, False),
    ("8B FSDP128 compile fp8", f"{TT} Table 3", 128, L8B + seq(8192) + FSDP + SEL + ["--micro-batch-size", "2",
                                                                                    "--global-batch-size", "256"],
     {"compile": True, "fp8": True}, 8380, 61.8, False),
    *[(f"8B FSDP{8 // cp} CP{cp} s{s // 1024}k", f"{TT} Table 2", 8,
       L8B + seq(s) + FSDP + FULL + ["--context-parallel-size", str(cp), "--micro-batch-size", "1",
                                     "--global-batch-size", str(8 // cp)],
       {"compile": True, "fp8": True}, tps, mem, False)
      for cp, s, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0))],
    ("70B FSDP32 TP8", f"{TT} Table 4", 256, L70B + seq(8192) + FSDP + FULL + [
        "--tensor-model-parallel-size", "8", "--sequence-parallel", "--micro-batch-size", "16",
        "--global-batch-size", "512"], {"compile": True, "fp8": True}, 829, 71.9, True),
    ("70B FSDP32 TP8 AsyncTP", f"{TT} Table 4", 256, L70B + seq(8192) + FSDP + FULL + [
        "--tensor-model-parallel-size", "8", "--sequence-parallel", "--micro-batch-size", "16",
        "--global-batch-size", "512"], {"compile": True, "fp8": True, "async_tp": True}, 876, 67.6, False),
    # torchtitan's default microbatches: one per stage (8 of 4 sequences; interleaved 2 stages a rank, 16 of 2)
    *[(f"405B FSDP8 TP8 PP8 {name}", f"{TT} Table 5", 512, L405B + seq(8192) + FSDP + FULL + [
        "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "8",
        "--micro-batch-size", mbs, "--global-batch-size", "256", *extra],
       {"compile": True, "fp8": True, "async_tp": True, "layers_scale": 126 / 128, "torch_pipelining": True},
       tps, mem, False)
      for name, mbs, extra, tps, mem in (
          ("1F1B", "4", [], 100, 82.5),
          ("interleaved", "2", ["--num-layers-per-virtual-pipeline-stage", "8"], 128, 72.7))],
    ("GPT-3 175B TP8 PP6 DP48", "Megatron-LM README model table", 2304, GPT3 + SEL + [
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "6", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--micro-batch-size", "1",
        "--global-batch-size", "1152"], {"hw_file": SXM_FILE, "tflops": 432.8}, None, None, True),
]
GIB = 2 ** 30
# torchtitan's activations (docs/planner.md, "Another stack's activations"): its loss's fp32 copies of the logits
# (``activations.loss_fp32_copies``) and its per-op "selective" policy; under PP also the outputs that
# torch.distributed.pipelining keeps (``pipelining_outputs``)
TORCHTITAN_ACTIVATIONS = {"loss": "torchtitan", "selective": "per-op"}


def _cfg(flags, world, opts):
    from megatronish.arguments import build_parser, configs_from_args

    cfg = configs_from_args(build_parser().parse_args(COMMON + flags), world)
    if opts.get("compile"):
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, torch_compile=True))
    if opts.get("fp8"):  # Float8 GEMMs (torchao's on nn.Linear); our FSDP2 does not take --fp8-format yet
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(fp8="hybrid"))
    return cfg


def _hw(opts):
    from megatronish.planner.hardware import load_hardware

    return load_hardware("H100-SXM", hardware_file=opts.get("hw_file", HW_FILE))


def prepared():
    """Each run's config, hardware and plan inputs (built once)."""
    from megatronish.planner.plan import plan_inputs

    out = []
    for name, src, world, flags, opts, tps, mem, fit in RUNS:
        cfg, hw = _cfg(flags, world, opts), _hw(opts)
        act_kw = {}
        if src.startswith(TT):
            act_kw = dict(TORCHTITAN_ACTIVATIONS, pipelining_outputs=bool(opts.get("torch_pipelining")))
        inputs = plan_inputs(cfg, hw, unsharded_grads=bool(opts.get("torch_pipelining")), **act_kw)
        out.append((name, src, cfg, hw, opts, tps, mem, fit, inputs))
    return out


def predict(run, efficiencies=None):
    from megatronish.planner.plan import plan_from_inputs

    name, src, cfg, hw, opts, tps, mem, fit, inputs = run
    plan = plan_from_inputs(cfg, hw, *inputs, tp_overlap=bool(opts.get("async_tp")), efficiencies=efficiencies)
    tm = plan["time"]
    scale = opts.get("layers_scale", 1.0)
    step = tm["step_s"] * scale
    tokens = cfg.train.global_batch_size * cfg.model.seq_length / cfg.parallel.world_size
    tflops = tm["model_tflops_per_gpu"]  # FLOPs and time scale alike
    return {"tps": tokens / step, "tflops": tflops, "mfu": tflops * 1e12 / hw.peak("bf16"),
            "mem": plan["peak_bytes"] / GIB, "plan": plan}


def _flops_per_token(cfg) -> float:
    from megatronish.training.flops import num_floating_point_operations

    return num_floating_point_operations(cfg.model, 1) / cfg.model.seq_length


def _published_tps(run) -> float:
    """Published tokens/s/GPU (Megatron-LM publishes TFLOP/s/GPU: converted with the same FLOPs formula)."""
    name, src, cfg, hw, opts, tps, mem, fit, _ = run
    return tps if tps is not None else opts["tflops"] * 1e12 / _flops_per_token(cfg)


def fit(runs) -> dict:
    """Per hardware table, the efficiencies minimising the squared log ratio of predicted to published tokens/s on
    that card's ``fit`` runs (a grid; ties go to the model's a-priori constants): {hardware name: efficiencies}."""
    from megatronish.planner import perf

    prior = {k: getattr(perf, k) for k in perf.EFFICIENCIES}
    grid = {"GEMM_EFFICIENCY": [x / 100 for x in range(30, 81, 2)],
            "ATTENTION_EFFICIENCY": [x / 100 for x in range(25, 71, 5)],
            "MEMORY_EFFICIENCY": [x / 100 for x in range(50, 91, 10)],
            "LINK_EFFICIENCY": [x / 100 for x in range(45, 91, 15)]}
    out = {}
    for card in sorted({r[3].name for r in runs if r[7]}):
        chosen = [r for r in runs if r[7] and r[3].name == card]
        best, best_err = None, math.inf
        for values in itertools.product(*grid.values()):
            eff = dict(zip(grid, values))
            err = sum(math.log(predict(r, eff)["tps"] / _published_tps(r)) ** 2 for r in chosen)
            err += 1e-4 * sum((eff[k] - prior[k]) ** 2 for k in eff)
            if err < best_err:
                best, best_err = eff, err
        out[card] = best
    return out


def published(args) -> None:
    runs = prepared()
    eff = {}
    if args.fit:
        eff = fit(runs)
        for card, values in eff.items():
            print(f"{card}: fitted on", ", ".join(r[0] for r in runs if r[7] and r[3].name == card), ":",
                  ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print(f"{'run':34s} {'fit':4s} {'tok/s/GPU pub':>13s} {'pred':>7s} {'ratio':>6s} {'TFLOP/s pub':>11s} "
          f"{'pred':>6s} {'MFU pred':>8s} {'GiB pub':>8s} {'pred':>6s} {'ratio':>6s}")
    for r in runs:
        p = predict(r, eff.get(r[3].name))
        pub = _published_tps(r)
        name, src, cfg, hw, opts, tps, mem, fitted, _ = r
        pub_tflops = pub * _flops_per_token(cfg) / 1e12
        mem_s = f"{mem:8.1f} {p['mem']:6.1f} {p['mem'] / mem:6.2f}" if mem else f"{'-':>8s} {p['mem']:6.1f} {'-':>6s}"
        print(f"{name:34s} {'yes' if fitted else 'held':4s} {pub:13,.0f} {p['tps']:7,.0f} {p['tps'] / pub:6.2f} "
              f"{pub_tflops:11.1f} {p['tflops']:6.1f} {p['mfu'] * 100:7.1f}% {mem_s}")
        if args.verbose:
            print("   breakdown (ms): " + ", ".join(f"{k} {v * 1e3:.0f}"
                                                    for k, v in p["plan"]["time"]["breakdown_s"].items()))
    if args.search:
        _search(runs)


def _search(runs) -> None:
    """Each published run's model, GPU count, batch and stack searched with that stack's choices (torchtitan's runs:
    ``search.TORCHTITAN``, with AsyncTP where they ran it; torch.compile and Float8 as run), each setting once, and
    every published layout located in the ranking by what its source states (Megatron-LM's table: TP, PP, DP;
    its VP and micro-batch size unstated, so also the layout as modelled here, VP 1 and micro-batch 1)."""
    from megatronish.planner.search import LAYOUT_FIELDS, MEGATRON, TORCHTITAN, format_search, search

    groups: dict = {}
    for name, src, cfg, hw, opts, tps, *_ in runs:
        stack, async_tp = (TORCHTITAN if src.startswith(TT) else MEGATRON), bool(opts.get("async_tp"))
        key = (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length, cfg.parallel.world_size,
               cfg.train.global_batch_size, cfg.train.torch_compile, cfg.model.precision.fp8, stack.name, async_tp)
        published = [(f"published {name}", cfg, LAYOUT_FIELDS)] if tps is not None else \
            [(f"published {name}, as stated", cfg, ("tp", "pp", "cp", "dp")),
             (f"published {name}, as modelled", cfg, LAYOUT_FIELDS)]
        groups.setdefault(key, (cfg, hw, stack, async_tp, []))[4].extend(published)
    for cfg, hw, stack, async_tp, published in groups.values():
        t0 = time.perf_counter()
        res = search(cfg, hw, 5, stack, tp_overlap=async_tp)
        text = format_search(res, hw, published)
        print(f"\n== search for {', '.join(p[0][len('published '):] for p in published)} "
              f"({time.perf_counter() - t0:.0f} s)")
        print(text)


# ---------------------------------------------------------------------------------------------- this machine
CPU_BASE = ["--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256", "--max-position-embeddings",
            "256", "--vocab-size", "2048", "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size",
            "2", "--global-batch-size", "8", "--train-iters", "100", "--lr", "1e-4", "--eval-iters", "0",
            "--log-interval", "1000", "--num-layers", "4"]
CPU_LAYOUTS = {
    "1: single": (1, []),
    "1: selective": (1, ["--recompute-granularity", "selective"]),
    "1: full recompute": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"]),
    "2: dp2": (2, []),
    "2: tp2 sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "2: pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "2: dp2 dist-opt": (2, ["--use-distributed-optimizer"]),
    "2: cp2": (2, ["--context-parallel-size", "2", "--attention-dropout", "0"]),
    "4: dp4": (4, []),
    "4: tp2 dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "4: pp2 dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "4: tp2 pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "1: mla mtp": (1, ["--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim",
                       "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm",
                       "--position-embedding-type", "rope", "--mtp-num-layers", "1"]),
    "2: pp2 zbv": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]),
}


def _measure(rank, world, flags, iters):
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.parallel import groups
    from megatronish.training import pretrain as training

    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(CPU_BASE + flags), world)
    with redirect_stdout(io.StringIO()):
        run, state = training.setup(cfg)
        for _ in range(2):
            training.train_step(run, state)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            training.train_step(run, state)
            times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _median(probes):
    """The probes' median of each rate (each probe times each kernel's fastest call, which a loaded machine may
    still slow, or an allocator's state speed): peaks, matmul tables, elementwise and draw rates, links."""
    first, med = probes[0], statistics.median
    tables = {d: {k: med(p.gemm_tflops[d][k] for p in probes) for k in t} for d, t in first.gemm_tflops.items()}
    return dataclasses.replace(first, peak_tflops={k: med(p.peak_tflops[k] for p in probes) for k in first.peak_tflops},
                               gemm_tflops=tables, hbm_tbps=med(p.hbm_tbps for p in probes),
                               dropout_gelems=med(p.dropout_gelems for p in probes),
                               intra_node_gbps=med(p.intra_node_gbps for p in probes),
                               inter_node_gbps=med(p.inter_node_gbps for p in probes),
                               intra_node_latency_s=med(p.intra_node_latency_s for p in probes),
                               inter_node_latency_s=med(p.inter_node_latency_s for p in probes),
                               op_overhead_s=med(p.op_overhead_s for p in probes),
                               collective_links={k: [med(p.collective_links[k][i] for p in probes) for i in (0, 1)]
                                                 for k in first.collective_links})


def _cpu_hw(world: int, probes: int = 3):
    """This machine as ``world`` one-thread ranks see it: the one-thread probe (the median of ``probes``), its
    compute rates shared out over the cores (:func:`_share`)."""
    import torch

    from megatronish.planner.hardware import probe_cpu

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _share(_median([probe_cpu() for _ in range(probes)]), world)
    finally:
        torch.set_num_threads(threads)


def _share(hw, world: int):
    """``hw`` (one thread's) as each of ``world`` one-thread ranks sees it when they outnumber the cores: the
    matmuls', elementwise kernels' and dropout draws' rates times cores / ranks, the framework's time per op over
    it."""
    share = min(1.0, (os.cpu_count() or 1) / world)
    return dataclasses.replace(hw, peak_tflops={k: v * share for k, v in hw.peak_tflops.items()},
                               gemm_tflops={d: {k: v * share for k, v in t.items()} for d, t in hw.gemm_tflops.items()},
                               hbm_tbps=hw.hbm_tbps * share, dropout_gelems=hw.dropout_gelems * share,
                               op_overhead_s=hw.op_overhead_s / share, rank_share=share)


def cpu(args) -> None:
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.planner.plan import make_plan
    from megatronish.testing import run_distributed

    hw = _cpu_hw(1)
    share = {world: _share(hw, world) for world in sorted({w for w, _ in CPU_LAYOUTS.values()})}
    predicted = {name: make_plan(configs_from_args(parse_args(CPU_BASE + flags), world), share[world])
                 for name, (world, flags) in CPU_LAYOUTS.items()}
    print(f"{os.cpu_count()} cores; base: {' '.join(CPU_BASE)}; {args.rounds} round(s) of {args.iters} steps after "
          f"2 warm-up steps; the probe: {hw.source}", flush=True)
    print(f"probed (one thread): fp32 512^3 {hw.peak_tflops['fp32'] * 1e3:.0f} GFLOP/s, elementwise "
          f"{hw.hbm_tbps * 1e3:.1f} GB/s, dropout draws {hw.dropout_gelems:.3f} G/s, gloo {hw.intra_node_gbps:.2f} "
          f"GB/s and {hw.intra_node_latency_s * 1e6:.0f} us a step (all-reduce; "
          + ", ".join(f"{k} {g:.2f} GB/s {lat * 1e6:.0f} us" for k, (g, lat) in hw.collective_links.items())
          + f"), {hw.op_overhead_s * 1e6:.1f} us an op", flush=True)
    head = f"{'layout':22s} {'predicted ms':>12s} {'fastest ms':>12s} {'pred/meas':>9s}"
    print(f"{'round':>5s} {head} {'median ms':>9s} {'load':>5s}", flush=True)
    fastest = {name: [] for name in CPU_LAYOUTS}
    medians = {name: [] for name in CPU_LAYOUTS}
    for rnd in range(args.rounds):
        order = list(CPU_LAYOUTS) if rnd % 2 == 0 else list(reversed(CPU_LAYOUTS))
        for name in order:
            world, flags = CPU_LAYOUTS[name]
            out = run_distributed(_measure, world, flags, args.iters, timeout=900)
            fastest[name].append(max(f for f, _ in out))  # the slowest rank's fastest step
            medians[name].append(max(m for _, m in out))  # and its median step
            p, m = predicted[name]["time"]["step_s"], min(fastest[name])
            print(f"{rnd + 1:5d} {name:22s} {p * 1e3:12.0f} {m * 1e3:12.0f} {p / m:9.2f} "
                  f"{statistics.median(medians[name]) * 1e3:9.0f} {os.getloadavg()[0]:5.1f}", flush=True)
    print(f"\nthe fastest step of the rounds (the rounds' median steps beside it):\n{head} {'median ms':>9s} "
          f"{'pred/median':>11s}  predicted terms (ms)")
    within = 0
    for name in CPU_LAYOUTS:
        t = predicted[name]["time"]
        p, m, med = t["step_s"], min(fastest[name]), statistics.median(medians[name])
        within += abs(p / m - 1) <= 0.25
        terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t["breakdown_s"].items() if v)
        print(f"{name:22s} {p * 1e3:12.0f} {m * 1e3:12.0f} {p / m:9.2f} {med * 1e3:9.0f} {p / med:11.2f}  {terms}")
    print(f"within 25%: {within} of {len(CPU_LAYOUTS)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("published")
    p.add_argument("--fit", action="store_true")
    p.add_argument("--search", action="store_true")
    p.add_argument("--verbose", action="store_true")
    c = sub.add_parser("cpu")
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    published(args) if args.what == "published" else cpu(args)


if __name__ == "__main__":
    main()
