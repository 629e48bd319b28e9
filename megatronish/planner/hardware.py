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
import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. ``peak_tflops``: dense peak per dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``,
    ``fp8``); ``hbm_gib`` memory, ``hbm_tbps`` its bandwidth (TB/s); links in GB/s per direction and seconds of
    latency per message; ``gpus_per_node``: the size of the fast (NVLink) domain. ``efficiencies``: this
    entry's own achievable fractions (``GEMM_EFFICIENCY``, ... of ``planner/perf.py``), fitted on runs of this
    card (a hardware file's ``[efficiencies]``); the model's constants where absent."""

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

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (falls back to bf16's for fp16, and fp32's for tf32)."""
        table = self.peak_tflops
        for key in (dtype, {"fp16": "bf16", "tf32": "fp32"}.get(dtype, dtype), "bf16"):
            if key in table:
                return float(table[key]) * 1e12
        raise ConfigError(f"--gpu {self.name}: no peak TFLOP/s for {dtype}")

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


def probe_cpu(seconds: float = 0.3) -> Hardware:
    """This machine, measured now: the peak is a 512^3 fp32 and bf16 matmul's rate on the threads torch uses, the
    memory bandwidth a large copy's (read + write), the links the loopback's (a copy's rate, 50 us per message:
    gloo over TCP). ``hbm_gib`` is the machine's memory."""
    def rate(fn, work: float) -> float:
        fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            fn()
            n += 1
        return work * n / (time.perf_counter() - t0)

    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(512, 512, dtype=dtype)
        peaks[name] = rate(lambda a=a: a @ a, 2 * 512 ** 3) / 1e12
    src = torch.empty(16 * 2 ** 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    bw = rate(lambda: dst.copy_(src), 2 * src.numel() * 4) / 1e12
    try:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        mem = 16.0
    link = bw * 1e3 / 4  # GB/s: a socket moves data at a fraction of a copy's rate
    return Hardware(CPU_KIND, peaks, mem, bw, link, link, 50e-6, 50e-6, gpus_per_node=1 << 20,
                    source=f"measured now: {torch.get_num_threads()} threads, 512^3 matmul, 64 MiB copy")


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


__all__ = ["Hardware", "GPUS", "KINDS", "CPU_KIND", "probe_cpu", "load_hardware"]
