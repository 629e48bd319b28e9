"""The accelerators the planner knows: datasheet numbers, a TOML file's overrides, and this machine's CPU measured on
the spot.

Every number of :data:`GPUS` is a vendor datasheet's, dense (no 2:4 sparsity), per GPU; ``source`` names the
document. Bandwidths are per direction and per GPU: ``intra_node_gbps`` the GPU's share of NVLink / Infinity
Fabric (half the datasheet's bidirectional figure), ``inter_node_gbps`` the GPU's own network adapter (400 Gb/s =
50 GB/s for the InfiniBand NDR / RoCE rails of the reference systems). Latencies are not datasheet numbers: they
are the usual per-hop figures of NCCL's tuning model (a few microseconds on NVLink, more across the network), and a
``--hardware-file`` may change them.

A hardware file is TOML with the fields of :class:`Hardware` (``name`` optional)::

    base = "H100-SXM"            # start from a built-in entry (optional)
    hbm_gib = 96                 # HBM2e H100 of a Grand Teton host
    hbm_tbps = 2.4
    [peak_tflops]
    bf16 = 989
    [efficiencies]               # fitted on runs of this card (planner/perf.py's names)
    GEMM_EFFICIENCY = 0.5
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

# the dtype whose rates stand for another's: 16-bit floats run as bf16's, tf32 (fp32 inputs) as fp32's
DTYPE_FALLBACK = {"fp16": "bf16", "tf32": "fp32"}


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. ``peak_tflops``: dense peak per dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``,
    ``fp8``); ``hbm_gib`` memory, ``hbm_tbps`` its bandwidth (TB/s); links in GB/s per direction and seconds of
    latency per message; ``gpus_per_node``: the size of the fast (NVLink) domain. ``efficiencies``: this
    entry's own achievable fractions (``GEMM_EFFICIENCY``, ... of ``planner/perf.py``), fitted on runs of this
    card (a hardware file's ``[efficiencies]``); the model's constants where absent. ``gemm_tflops``: measured
    matmul rates by shape, ``{dtype: {"m,k,n": TFLOP/s}}`` on the grid :data:`GEMM_GRID`, and the attention core's
    ``{"core_<dtype>": {"s,d": TFLOP/s}}`` (its matmuls) and ``flash_<dtype>`` (its flash kernel) on
    :data:`CORE_GRID` (this machine's probe; the planner prices each GEMM at its shape's rate instead of
    ``GEMM_EFFICIENCY`` of the peak, the core instead of ``ATTENTION_EFFICIENCY``); empty for the datasheet
    entries. ``dropout_gelems``: dropout-mask elements drawn per
    second (billions), where drawing them costs more than writing the mask (a CPU core's random-number
    generator); 0 where the draw is part of the dropout kernel's memory pass (GPUs: Philox in registers).
    ``device``: the torch device type the run uses there (``cpu``: no fused kernels, SDPA's CPU kernels).
    ``op_overhead_s``: the framework's seconds per dispatched op (Python, dispatcher, autograd) where the host runs
    the kernels itself (a CPU); 0 where the host enqueues them ahead of the device (GPUs: the launches overlap the
    kernels of a large model). ``rank_share``: the share of one device each rank gets (below 1 where ranks
    outnumber this machine's cores and the rates are already that share: a waiting rank's core runs another's
    work, so the pipeline's bubble costs only what the ranks' own cores could not overlap).
    ``collective_links``: ``{kind: [GB/s, seconds per step]}`` measured for each collective kind inside a node
    (``all_reduce``, ``all_gather``, ``reduce_scatter``; this machine's gloo, whose all-gather and reduce-scatter
    are not the ring's fractions of its all-reduce), used in place of the intra-node link for that kind; empty
    for the datasheet entries."""

    name: str
    peak_tflops: dict = field(default_factory=dict)
    hbm_gib: float = 80.0
    hbm_tbps: float = 3.35
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    intra_node_latency_s: float = 3e-6
    inter_node_latency_s: float = 8e-6
    gpus_per_node: int = 8
    source: str = ""
    efficiencies: dict = field(default_factory=dict)
    gemm_tflops: dict = field(default_factory=dict)
    dropout_gelems: float = 0.0
    device: str = "cuda"
    op_overhead_s: float = 0.0
    rank_share: float = 1.0
    collective_links: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (falls back to bf16's for fp16, and fp32's for tf32)."""
        table = self.peak_tflops
        for key in (dtype, DTYPE_FALLBACK.get(dtype, dtype), "bf16"):
            if key in table:
                return float(table[key]) * 1e12
        raise ConfigError(f"--gpu {self.name}: no peak TFLOP/s for {dtype}")

    def measured(self, table: str, dtype: str) -> dict | None:
        """A measured rate table of :attr:`gemm_tflops` for ``dtype`` (fp16 reads bf16's, tf32 fp32's): ``table``
        ``""`` the matmuls', ``"core_"`` the attention core's matmuls', ``"flash_"`` its flash kernel's; None on a
        datasheet entry."""
        return self.gemm_tflops.get(table + DTYPE_FALLBACK.get(dtype, dtype)) or None

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2 ** 30


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s BF16 dense, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s)"
GPUS: dict[str, Hardware] = {
    "H100-SXM": Hardware("H100-SXM", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp8": 1979}, 80, 3.35, 450, 50,
                         source=_NV_H100),
    "H200": Hardware("H200", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp8": 1979}, 141, 4.8, 450, 50,
                     source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s)"),
    "B200": Hardware("B200", {"fp32": 80, "tf32": 1100, "bf16": 2250, "fp8": 4500}, 180, 8.0, 900, 50,
                     source="NVIDIA HGX B200 datasheet (per GPU: 4.5 PFLOP/s FP16/BF16 with sparsity, 180 GB HBM3e "
                            "8 TB/s, NVLink 5 1.8 TB/s)"),
    "GB200": Hardware("GB200", {"fp32": 80, "tf32": 1250, "bf16": 2500, "fp8": 5000}, 186, 8.0, 900, 50,
                      gpus_per_node=72,
                      source="NVIDIA GB200 NVL72 datasheet (72 GPUs: 360 PFLOP/s FP16/BF16 with sparsity, 13.4 TB "
                             "HBM3e 576 TB/s, NVLink 5 130 TB/s in one NVLink domain)"),
    "A100-80G": Hardware("A100-80G", {"fp32": 19.5, "tf32": 156, "bf16": 312}, 80, 2.039, 300, 25,
                         source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOP/s BF16 dense, HBM2e "
                                "2,039 GB/s, NVLink 600 GB/s; DGX A100: 200 Gb/s HDR per GPU)"),
    "MI300X": Hardware("MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp8": 2614.9}, 192, 5.3, 448, 50,
                       source="AMD Instinct MI300X data sheet (1307.4 TFLOP/s BF16 dense, 192 GB HBM3 5.3 TB/s, "
                              "Infinity Fabric 7 x 128 GB/s bidirectional peer links)"),
}
CPU_KIND = "cpu-this-machine"
KINDS = (*GPUS, CPU_KIND)


# the probe's matmul shapes: every (m, k, n) over these sizes, 32 (a head's size) to 512 (larger GEMMs run at
# about the 512 rate on a core); a shape between grid points is interpolated in log space, beyond it clamped. The
# largest takes under 2 ms on a core: shorter than a time slice of the scheduler, so a loaded machine's other
# processes leave some calls whole
GEMM_GRID = (32, 128, 512)
# the probe's elementwise kernels, those the layers run, as eager code runs them: one after another on a 4 MiB fp32
# tensor (a score block's size), each writing a new tensor that the next one reads: a mask added (broadcast), a
# last-dimension softmax, a product by a boolean mask (dropout), a select by one (masking), GeLU and a product;
# the bytes each reads and writes per element
_ELEMENTWISE = (("add_mask", 8), ("softmax", 8), ("mask_mul", 9), ("where", 13), ("gelu", 8), ("mul", 12))
# the attention core's per-head matmuls (SDPA's math path: batched over 8 heads, keys transposed): sequence
# lengths and head sizes, interpolated in log space between them, clamped beyond
CORE_GRID = ((128, 512), (32, 128))


def _timed(fn, budget: float, reps: int = 3, best: bool = False) -> float:
    """Seconds per call of ``fn``: one warm-up call, then up to ``reps`` calls within ``budget`` seconds (one at
    least); their mean, or with ``best`` the fastest (a shape's own speed, free of the other processes' slices)."""
    fn()
    times, t0 = [], time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - t0 < budget):
        t1 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t1)
    return min(times) if best else sum(times) / len(times)


def probe_gemm_table(dtype: torch.dtype, budget: float) -> dict:
    """``{"m,k,n": TFLOP/s}`` of ``[m, k] @ [k, n]`` in ``dtype`` over :data:`GEMM_GRID`, each shape's fastest of 5
    calls (its own speed, free of other processes' time slices); once ``budget`` seconds have passed, of one."""
    t0 = time.perf_counter()
    out = {}
    for m in GEMM_GRID:
        for k in GEMM_GRID:
            a = torch.randn(m, k, dtype=dtype)
            for n in GEMM_GRID:
                b = torch.randn(k, n, dtype=dtype)
                reps = 5 if time.perf_counter() - t0 < budget else 1
                out[f"{m},{k},{n}"] = 2 * m * k * n / _timed(lambda a=a, b=b: a @ b, budget, reps, True) / 1e12
    return out


def probe_elementwise() -> tuple[float, float]:
    """(bytes/s, dropout-mask elements/s) of one core's elementwise kernels: the :data:`_ELEMENTWISE` chain on a
    ``[2, 8, 256, 256]`` fp32 tensor, each kernel writing a new tensor that the next reads, as eager code does, run
    6 times and each kernel timed on its own, its fastest call kept (bytes read and written over their sum: each
    call shorter than a scheduler's time slice, so a loaded machine leaves some whole); and ``bernoulli_`` drawing
    a new mask of a quarter of it (fastest of 5)."""
    x = torch.randn(2, 8, 256, 256)
    y = torch.randn_like(x)
    keep = torch.rand(2, 8, 256, 256) > 0.1
    causal = torch.ones(256, 256).tril().log()
    steps = (lambda t: x + causal, lambda t: torch.softmax(t, -1), lambda t: t * keep,
             lambda t: torch.where(keep, t, y), torch.nn.functional.gelu, lambda t: t * y)
    best = [math.inf] * len(steps)
    for run in range(6):  # the first a warm-up
        t = x
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            t = step(t)
            if run:
                best[i] = min(best[i], time.perf_counter() - t0)
    moved = sum(nbytes for _, nbytes in _ELEMENTWISE) * x.numel()
    draws = x.numel() / 4 / _timed(lambda: torch.empty(x.numel() // 4).bernoulli_(0.9), 0.05, 5, True)
    return moved / sum(best), draws


def probe_flash_table(dtype: torch.dtype, budget: float) -> dict:
    """``{"s,d": TFLOP/s}`` of torch's CPU flash-attention kernel (forward and backward, causal, 8 heads of
    sequence ``s`` and head size ``d``) over :data:`CORE_GRID`: the computed half of the core's FLOPs
    (``perf.attention_core_flops``' convention) over its fastest of 3 (once ``budget`` seconds have passed, of
    one)."""
    t0, out = time.perf_counter(), {}
    flash, backward = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    for s in CORE_GRID[0]:
        for d in CORE_GRID[1]:
            q, k, v, g = (torch.randn(1, 8, s, d, dtype=dtype) for _ in range(4))

            def step(q=q, k=k, v=v, g=g):
                o, lse = flash(q, k, v, 0.0, True)[:2]
                backward(g, q, k, v, o, lse, 0.0, True)

            reps = 3 if time.perf_counter() - t0 < budget else 1
            out[f"{s},{d}"] = 6 * 2 * 8 * s * s * d / 2 / _timed(step, budget, reps, True) / 1e12
    return out


def probe_core_table(dtype: torch.dtype, budget: float) -> dict:
    """``{"s,d": TFLOP/s}`` of the attention core's six matmuls (``Q K^T``, ``P V``, and the backward's
    ``dO V^T``, ``P^T dO``, ``dS K``, ``dS^T Q``) batched over 8 heads of sequence ``s`` and head size ``d``, over
    :data:`CORE_GRID`: their FLOPs over the sum of each one's fastest of 3 calls (once ``budget`` seconds have
    passed, of one)."""
    t0, out = time.perf_counter(), {}
    for s in CORE_GRID[0]:
        for d in CORE_GRID[1]:
            q, k, v, o = (torch.randn(8, s, d, dtype=dtype) for _ in range(4))
            p, g = torch.randn(8, s, s, dtype=dtype), torch.randn(8, s, s, dtype=dtype)
            mms = (lambda: q @ k.transpose(1, 2), lambda: p @ v, lambda: o @ v.transpose(1, 2),
                   lambda: p.transpose(1, 2) @ o, lambda: g @ k, lambda: g.transpose(1, 2) @ q)
            reps = 3 if time.perf_counter() - t0 < budget else 1
            seconds = sum(_timed(fn, budget, reps, True) for fn in mms)
            out[f"{s},{d}"] = 6 * 2 * 8 * s * s * d / seconds / 1e12
    return out


def probe_cpu(seconds: float = 0.3) -> Hardware:
    """This machine's own speed, measured now on the threads torch uses, each kernel's fastest call (free of other
    processes' time slices: the table is the machine's, not its load's): the peak a 512^3 fp32 and bf16 matmul's
    rate, ``gemm_tflops`` the matmuls over :data:`GEMM_GRID` and, as ``core_<dtype>``, the attention core's over
    :data:`CORE_GRID` (:func:`probe_core_table`), as ``flash_<dtype>`` the CPU flash kernel's
    (:func:`probe_flash_table`; both dtypes); the memory-bound rate (``hbm_tbps``)
    one core's elementwise kernels' (:func:`probe_elementwise`: bytes read and written per second; elementwise
    kernels on a core are bound by their instructions per element, several times below a large copy's rate),
    ``dropout_gelems`` its ``bernoulli_`` draws; the links gloo's, two ranks in two threads of this process over
    the loopback (:func:`probe_gloo`); ``op_overhead_s`` the framework's time per op (:func:`probe_op_overhead`).
    Its efficiencies are 1: the rates are measured, not datasheet peaks.
    ``hbm_gib`` is the machine's memory. About 1 s on a core shared with a load average of 35."""
    peaks, table = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(512, 512, dtype=dtype)
        peaks[name] = 2 * 512 ** 3 / _timed(lambda a=a: a @ a, seconds / 6, 5, True) / 1e12
        table[name] = probe_gemm_table(dtype, seconds / 6)
        table[f"core_{name}"] = probe_core_table(dtype, seconds / 6)
        table[f"flash_{name}"] = probe_flash_table(dtype, seconds / 6)
    elementwise, draws = probe_elementwise()
    links = probe_gloo()
    gbps, latency = links["all_reduce"]
    overhead = probe_op_overhead()
    try:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        mem = 16.0
    return Hardware(CPU_KIND, peaks, mem, elementwise / 1e12, gbps, gbps, latency, latency, gpus_per_node=1 << 20,
                    source=f"measured now: {torch.get_num_threads()} threads, 512^3 matmul and a shape grid, "
                           f"elementwise kernels on 4 MiB, gloo over the loopback",
                    efficiencies={"GEMM_EFFICIENCY": 1.0, "ATTENTION_EFFICIENCY": 1.0, "MEMORY_EFFICIENCY": 1.0,
                                  "LINK_EFFICIENCY": 1.0},
                    gemm_tflops=table, dropout_gelems=draws / 1e9, device="cpu", op_overhead_s=overhead,
                    collective_links=links)


def probe_op_overhead() -> float:
    """Seconds per op of the framework alone: 32 ops on a 4-element tensor that requires grad and the backward
    through them (Python, the dispatcher, autograd's graph and engine; the kernels themselves nothing), over the 33
    ops forward (the backward's are counted with them), the fastest of 5."""
    def chain():
        y = x = torch.ones(4, requires_grad=True)
        for i in range(32):
            y = y * 1.0001 if i % 2 else y + 0.5
        y.sum().backward()
        return x

    return _timed(chain, 0.05, 5, True) / 33


# the collective kinds probe_gloo times apart
GLOO_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def probe_gloo() -> dict:
    """``{kind: [GB/s, seconds per step]}`` of gloo between two forked processes over the loopback for an
    all-reduce, an all-gather and a reduce-scatter, met as a training step meets its collectives: before each a
    rank computes for about a millisecond, so one of the two arrives first and waits in the collective until the
    other's data wakes it (on a virtual machine that wake-up, not the transport, is most of a small collective's
    time: 0.03 ms between two threads of one process, 0.3 to 0.5 ms between processes here). For each kind the
    median of an 8-byte tensor's collective is its steps' latency, the median of a 4 MiB one's (the full tensor:
    the all-gather's output, the reduce-scatter's input) less that moves its share of the bytes
    (``planner/perf.py``'s ring at 2 ranks, :func:`~megatronish.planner.perf.ring_moved`); 15 of each after two
    warm-ups, the slower rank's. Gloo's all-gather and reduce-scatter take about as long as its all-reduce of the
    same full tensor, or longer (where the ring would take half): each kind is priced at its own rates."""
    import multiprocessing
    import os
    import tempfile

    from .perf import ring_moved

    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as d:
        ends, procs = [], []
        for rank in range(2):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_gloo_rank, args=(rank, os.path.join(d, "store"), theirs), daemon=True)
            proc.start()
            ends.append(mine)
            procs.append(proc)
        results = [end.recv() for end in ends]
        for proc in procs:
            proc.join(timeout=30)
    links = {}
    for kind in GLOO_KINDS:
        small = max(r[kind][0] for r in results)
        large = max(r[kind][1] for r in results)
        moved, steps = ring_moved(kind, 2, 2 ** 22)
        latency = small / steps
        seconds = max(large - steps * latency, 1e-9)
        links[kind] = [moved / seconds / 1e9, latency]
    return links


def _gloo_rank(rank: int, path: str, conn) -> None:
    """One rank of :func:`probe_gloo`: sends ``{kind: (median seconds of an 8-byte collective, of a 4 MiB one)}``."""
    import datetime
    import statistics

    import torch.distributed as dist

    torch.set_num_threads(1)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=30)
    group = dist.ProcessGroupGloo(dist.FileStore(path, 2), rank, 2, opts)
    a = torch.randn(64, 64)

    def compute(seconds=1e-3):  # about a millisecond of work, as between a step's collectives
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a

    out = {}
    for kind in GLOO_KINDS:
        out[kind] = []
        for numel in (2, 2 ** 20):
            full, half = torch.ones(numel), torch.ones(numel // 2)
            run = {"all_reduce": lambda: group.allreduce([full]),
                   "all_gather": lambda: group._allgather_base(full, half),
                   "reduce_scatter": lambda: group._reduce_scatter_base(half, full)}[kind]
            times = []
            for i in range(17):
                compute()
                t0 = time.perf_counter()
                run().wait()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out[kind].append(statistics.median(times))
    conn.send(out)
    conn.close()


def load_hardware(kind: str, gpus_per_node: int | None = None, hardware_file: str | None = None) -> Hardware:
    """The ``--gpu`` entry, overridden by ``--hardware-file`` and ``--gpus-per-node``."""
    over = {}
    if hardware_file:
        import tomllib

        try:
            with open(hardware_file, "rb") as f:
                over = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--hardware-file {hardware_file}: {e}") from None
        kind = over.pop("base", kind)
    if kind == CPU_KIND:
        hw = probe_cpu()
    elif kind in GPUS:
        hw = GPUS[kind]
    else:
        raise ConfigError(f"--gpu {kind}: choose one of {', '.join(KINDS)} (or give --hardware-file)")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(over) - fields)
    if unknown:
        raise ConfigError(f"--hardware-file {hardware_file}: unknown fields {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(fields))}")
    if "peak_tflops" in over:
        over["peak_tflops"] = {**hw.peak_tflops, **over["peak_tflops"]}
    if "efficiencies" in over:
        from .perf import EFFICIENCIES

        bad = sorted(set(over["efficiencies"]) - set(EFFICIENCIES))
        if bad:
            raise ConfigError(f"--hardware-file {hardware_file}: unknown efficiencies {', '.join(bad)}; "
                              f"known: {', '.join(EFFICIENCIES)}")
        over["efficiencies"] = {**hw.efficiencies, **over["efficiencies"]}
    if over:
        over.setdefault("source", hw.source + f"; overridden by {hardware_file}")
        hw = dataclasses.replace(hw, **over)
    if gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
    return hw


__all__ = ["Hardware", "GPUS", "KINDS", "CPU_KIND", "GEMM_GRID", "CORE_GRID", "probe_cpu", "probe_gemm_table",
           "probe_core_table", "probe_flash_table", "probe_elementwise", "probe_gloo", "probe_op_overhead",
           "load_hardware"]
