#!/usr/bin/env python
"""The fused Triton kernels (megatronish/kernels, docs/kernels.md): speed and memory on a GPU, correctness on CPU.

On CUDA (one run, a few minutes on an H200), bf16, Llama-3-8B-like shapes (h 4096, 32 heads / 8 KV groups of
128, ffn 14336, vocab 128256, seq 4096 x micro-batch 2 = 8192 tokens, TP 1):

1. each kernel against the model's PyTorch path for the same op (``F.rms_norm``/``F.layer_norm``,
   ``apply_rotary`` on q and k, ``silu(gate) * up``, ``vocab_parallel_cross_entropy``) and against
   ``torch.compile`` of that path: forward and forward+backward time (median of CUDA-event timings), the
   minimum bytes the op must move (read inputs, write outputs, as listed per op below) divided by the time,
   that bandwidth as a fraction of the device's peak (the datasheet figure and a measured device copy), and the
   peak memory the op adds in forward+backward. Ops that work in place (RoPE, the loss's backward) get fresh
   copies of their inputs each rep, for every variant alike; the copy's own time is measured and subtracted.
2. end to end: a ~1B Llama (Llama-3.2-1B's shape: 16 layers, h 2048, 32 heads / 8 groups, ffn 8192,
   vocab 128256, bf16 parameters) forward+backward on one GPU with the kernels off and on
   (``use_triton_kernels`` + ``cross_entropy_loss_fusion``): tokens/s, peak memory, and the two losses.

Without CUDA it sets ``TRITON_INTERPRET=1`` and only checks that every kernel (forward and backward) matches
its PyTorch path on small shapes (fp32 and bf16), printing the largest differences; exit status 1 on a mismatch.
``--smoke`` instead runs the GPU code on tiny CPU shapes (interpreted; the numbers mean nothing) to check the
script itself.

    python benchmarks/bench_kernels.py [--reps 20] [--tokens 8192] [--e2e-seq 4096 --e2e-batch 2 --e2e-iters 10]
        [--skip-e2e] [--skip-compile] [--peak-gbps N] [--json results.json] [--smoke]
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from megatronish import kernels  # imports triton only when a fused op is first used
from megatronish.config import llama
from megatronish.model import GPTModel
from megatronish.model.rope import RotaryEmbedding, apply_rotary
from megatronish.parallel.cross_entropy import vocab_parallel_cross_entropy

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

# datasheet HBM bandwidth (GB/s) by device name
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300}


def bench_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=8192, help="rows of the per-kernel benchmarks (s x b)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length of the RoPE benchmark")
    p.add_argument("--e2e-seq", type=int, default=4096)
    p.add_argument("--e2e-batch", type=int, default=2)
    p.add_argument("--e2e-iters", type=int, default=10)
    p.add_argument("--e2e-layers", type=int, default=16)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--peak-gbps", type=float, default=None, help="override the datasheet bandwidth")
    p.add_argument("--smoke", action="store_true",
                   help="without CUDA: run the GPU code on tiny shapes through the interpreter (checks the script)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args()


# ---- the ops: (name, make inputs, fused, pytorch path, bytes forward, bytes backward) ------------------------
# Each `make(dtype, device, small)` returns (leaves, grad_out, fresh) where fresh(leaves) -> the op's inputs
# (copies where the op works in place, else the leaves themselves).

def _norm_case(kind, dtype, device, small):
    rows, h = (37, 100) if small else (ARGS.tokens, 4096)
    x = torch.randn(rows, h, device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_()
    leaves = [x, w] if kind == "rms" else [x, w, b]
    return leaves, torch.randn(rows, h, device=device, dtype=dtype), None


def _rope_case(dtype, device, small):
    s, b, heads, groups, d = (5, 2, 4, 2, 12) if small else (ARGS.seq, ARGS.tokens // ARGS.seq, 32, 8, 128)
    qk = torch.randn(s, b, heads + groups, d, device=device, dtype=dtype).requires_grad_()
    cos, sin = RotaryEmbedding(d, 0.5 if small else 1.0)(s, device=device)
    grad = torch.randn(s, b, heads + groups, d, device=device, dtype=dtype)
    return [qk], grad, (cos, sin, heads)


def _swiglu_case(dtype, device, small):
    rows, f = (37, 50) if small else (ARGS.tokens, 14336)
    h = (2 * torch.randn(rows, 2 * f, device=device)).to(dtype).requires_grad_()
    return [h], torch.randn(rows, f, device=device, dtype=dtype), None


def _ce_case(dtype, device, small):
    rows, part, vocab = (37, 300, 290) if small else (ARGS.tokens, 128256, 128256)
    logits = (2 * torch.randn(rows, 1, part, device=device)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows, 1), device=device)
    return [logits], torch.rand(rows, 1, device=device), (target, vocab)


def _rope_apply(fn_q_k):
    def run(leaves, extra):
        cos, sin, heads = extra
        qk = leaves[0].clone()  # a non-leaf, as the QKV projection's output (in place needs one)
        q, k = qk[:, :, :heads], qk[:, :, heads:]
        q2, k2 = fn_q_k(q, cos, sin), fn_q_k(k, cos, sin)
        return torch.cat((q2, k2), dim=2) if q2.data_ptr() != q.data_ptr() else qk
    return run


def _ce_apply(fn):
    def run(leaves, extra):
        target, vocab = extra
        return fn(leaves[0].clone(), target, 0.0, vocab)  # a copy: the fused backward writes over its logits
    return run


def ops():
    """name -> (make, fused, pytorch path, bytes moved forward, bytes moved backward); `fused` and `pytorch` take
    (leaves, extra). Bytes: the minimum traffic of the op itself (inputs read once, outputs written once)."""
    def e(t):
        return t.element_size()

    def rms_bytes(leaves, _):
        x = leaves[0]
        return 2 * x.numel() * e(x), 3 * x.numel() * e(x)  # fwd: x, y; bwd: x, dy, dx

    def ce_bytes(leaves, _):
        x = leaves[0]
        return x.numel() * e(x), 2 * x.numel() * e(x)  # fwd: logits; bwd: logits, grad

    def rope_bytes(leaves, _):
        x = leaves[0]
        return 2 * x.numel() * e(x), 2 * x.numel() * e(x)  # read + write q, k (both ways)

    def swiglu_bytes(leaves, _):
        h = leaves[0]
        return 1.5 * h.numel() * e(h), 2.5 * h.numel() * e(h)  # fwd: h, out; bwd: h, g, dh

    compiled_rope = _lazy_compile(apply_rotary)
    return {
        "RMSNorm": (lambda dt, dev, sm: _norm_case("rms", dt, dev, sm),
                    lambda lv, _: kernels.rms_norm(lv[0], lv[1], 1e-5),
                    lambda lv, _: F.rms_norm(lv[0], lv[0].shape[-1:], lv[1], 1e-5), rms_bytes),
        "LayerNorm": (lambda dt, dev, sm: _norm_case("ln", dt, dev, sm),
                      lambda lv, _: kernels.layer_norm(lv[0], lv[1], lv[2], 1e-5),
                      lambda lv, _: F.layer_norm(lv[0], lv[0].shape[-1:], lv[1], lv[2], 1e-5), rms_bytes),
        "RoPE (q+k)": (_rope_case, _rope_apply(kernels.apply_rotary_), _rope_apply(apply_rotary), rope_bytes,
                       _rope_apply(compiled_rope)),
        "SwiGLU": (_swiglu_case, lambda lv, _: kernels.swiglu(lv[0]),
                   lambda lv, _: (lambda g, u: F.silu(g) * u)(*lv[0].chunk(2, dim=-1)), swiglu_bytes),
        "CrossEntropy": (_ce_case, _ce_apply(kernels.vocab_parallel_cross_entropy),
                         _ce_apply(vocab_parallel_cross_entropy), ce_bytes, _ce_apply(_lazy_compile(_ce_chain))),
    }


def _ce_chain(logits, target, label_smoothing, vocab):
    """The cross entropy as plain ops (what torch.compile can fuse; the model's version is an autograd.Function
    with in-place steps)."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1) - x.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _lazy_compile(fn):
    cache = {}

    def run(*a):
        if "f" not in cache:
            cache["f"] = torch.compile(fn, dynamic=False)
        return cache["f"](*a)
    return run


# ---- CPU: correctness only ------------------------------------------------------------------------------------
def check_cpu():
    print("no CUDA device: checking the kernels (TRITON_INTERPRET=1) against the PyTorch path; no timings\n")
    print(f"{'op':<14}{'dtype':<10}{'max |out diff|':>16}{'max |grad diff|':>17}{'out bound':>11}"
          f"{'grad bound':>11}  result")
    bad = 0
    for name, spec in ops().items():
        make, fused, torch_path = spec[:3]
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            leaves, grad, extra = make(dtype, "cpu", True)
            results = []
            for fn, ins in ((fused, leaves), (torch_path, [t.detach().float().requires_grad_() for t in leaves])):
                out = fn(ins, extra)
                out.backward(grad.to(out.dtype))
                results.append((out.detach().float(), [t.grad.float() for t in ins]))
            (o1, g1), (o2, g2) = results
            d_out = (o1 - o2).abs().max().item()
            d_grad = max((a - b).abs().max().item() for a, b in zip(g1, g2))
            rel = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: about one rounding step
            bound = rel * o2.abs().max().item()
            g_bound = rel * max(g.abs().max().item() for g in g2)
            ok = d_out <= bound and d_grad <= g_bound and all(torch.isfinite(g).all() for g in g1)
            bad += not ok
            print(f"{name:<14}{str(dtype)[6:]:<10}{d_out:>16.3e}{d_grad:>17.3e}{bound:>11.1e}{g_bound:>11.1e}  "
                  f"{'ok' if ok else 'FAIL'}")
    return 1 if bad else 0


# ---- timings (CUDA; --smoke: the same code on tiny CPU shapes, interpreted, to check the script) -------------
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn, reps, warmup=3):
    """Median milliseconds of ``fn`` (CUDA events; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


class PeakMemory:
    """Peak bytes allocated inside the block above what was allocated at its start (CUDA; None on CPU)."""

    def __enter__(self):
        self.extra = None
        if CUDA:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if CUDA:
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base


def copy_bandwidth_gbps():
    x = torch.empty(2 ** 30 if CUDA else 2 ** 24, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() / ms / 1e6


def peak_gbps():
    if ARGS.peak_gbps:
        return ARGS.peak_gbps
    if not CUDA:
        return None
    name = torch.cuda.get_device_name()
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


def bench_op(name, spec, variant, fn, peak, copy_gbps):
    make, bytes_fn = spec[0], spec[3]
    torch.manual_seed(0)
    leaves, grad, extra = make(torch.bfloat16, DEV, ARGS.smoke)
    # the per-rep input copy (RoPE, CE) is part of every variant: time it alone and subtract it
    copies = name.startswith(("RoPE", "CrossEntropy"))
    copy_ms = time_ms(lambda: leaves[0].detach().clone(), ARGS.reps) if copies else 0.0

    def fwd():
        with torch.no_grad():
            fn(leaves, extra)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        out = fn(leaves, extra)
        out.backward(grad.to(out.dtype))

    t_f = time_ms(fwd, ARGS.reps) - copy_ms
    t_fb = time_ms(fwd_bwd, ARGS.reps) - copy_ms
    for t in leaves:
        t.grad = None
    with PeakMemory() as mem:
        fwd_bwd()
    b_f, b_b = bytes_fn(leaves, extra)
    gbps = (b_f + b_b) / t_fb / 1e6
    nan = float("nan")
    return dict(op=name, variant=variant, fwd_ms=t_f, fwd_bwd_ms=t_fb, gb=(b_f + b_b) / 1e9, gbps=gbps,
                pct_peak=100 * gbps / peak if peak else nan, pct_copy=100 * gbps / copy_gbps,
                extra_mib=mem.extra / 2 ** 20 if mem.extra is not None else nan)


def bench_kernels():
    peak = peak_gbps()
    copy_gbps = copy_bandwidth_gbps()
    where = torch.cuda.get_device_name() if CUDA else "CPU, Triton interpreter (--smoke: checks the script only)"
    print(f"device: {where}; datasheet bandwidth {peak} GB/s; measured copy {copy_gbps:.0f} GB/s; "
          f"torch {torch.__version__}; bf16; {'tiny shapes' if ARGS.smoke else f'{ARGS.tokens} tokens'}\n")
    rows = []
    for name, spec in ops().items():
        fused, torch_path = spec[1], spec[2]
        compiled = spec[4] if len(spec) > 4 else _lazy_compile_leaves(torch_path)
        variants = [("triton", fused), ("pytorch", torch_path)] + ([] if ARGS.skip_compile else [("compile", compiled)])
        for variant, fn in variants:
            try:
                rows.append(bench_op(name, spec, variant, fn, peak, copy_gbps))
            except Exception as e:  # one failing variant must not end the run
                print(f"{name} {variant}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                traceback.print_exc(limit=3)
            if CUDA:
                torch.cuda.empty_cache()
    hdr = (f"| {'op':<13} | {'variant':<8} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'GB moved':>8} | {'GB/s':>7} | "
           f"{'% peak':>6} | {'% copy':>6} | {'extra MiB':>9} | {'speedup':>7} |")
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    base = {r["op"]: r["fwd_bwd_ms"] for r in rows if r["variant"] == "pytorch"}
    for r in rows:
        r["speedup"] = base.get(r["op"], float("nan")) / r["fwd_bwd_ms"]
        print(f"| {r['op']:<13} | {r['variant']:<8} | {r['fwd_ms']:>8.3f} | {r['fwd_bwd_ms']:>10.3f} | "
              f"{r['gb']:>8.3f} | {r['gbps']:>7.0f} | {r['pct_peak']:>6.1f} | {r['pct_copy']:>6.1f} | "
              f"{r['extra_mib']:>9.0f} | {r['speedup']:>6.2f}x |")
    print("\nGB moved: minimum traffic of forward + backward (inputs read once, outputs written once); GB/s and "
          "% use the fwd+bwd time; % peak: of the datasheet bandwidth, % copy: of the measured device copy; extra "
          "MiB: peak memory the op adds over its inputs in forward+backward; speedup: pytorch fwd+bwd time / this "
          "one.\n")
    return dict(device=where, peak_gbps=peak, copy_gbps=copy_gbps, kernels=rows)


def _lazy_compile_leaves(torch_path):
    cache = {}

    def run(leaves, extra):
        if "f" not in cache:
            cache["f"] = torch.compile(lambda *lv: torch_path(list(lv), extra), dynamic=False)
        return cache["f"](*leaves)
    return run


# ---- end to end -------------------------------------------------------------------------------------------
def bench_e2e():
    if ARGS.smoke:
        s, b, vocab, layers, iters = 16, 2, 300, 2, 2
        shape = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96)
    else:
        s, b, vocab, layers, iters = ARGS.e2e_seq, ARGS.e2e_batch, 128256, ARGS.e2e_layers, ARGS.e2e_iters
        shape = dict(hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192)
    results = {}
    for on in (False, True):
        torch.manual_seed(0)
        cfg = llama(num_layers=layers, vocab_size=vocab, seq_length=s, attention_dropout=0.0, hidden_dropout=0.0,
                    rotary_base=500000, use_triton_kernels=on, cross_entropy_loss_fusion=on, **shape)
        model = GPTModel(cfg, params_dtype=torch.bfloat16, device=DEV)
        with torch.no_grad():
            for p in model.parameters():  # matrices N(0, 0.02), norm weights 1 (a Llama has no biases)
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        n_params = sum(p.numel() for p in model.parameters())
        g = torch.Generator(device=DEV).manual_seed(1)
        ids = torch.randint(0, vocab, (b, s), device=DEV, generator=g)
        labels = torch.randint(0, vocab, (b, s), device=DEV, generator=g)
        losses = []

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=labels).float().mean()
            loss.backward()
            losses.append(loss.detach())

        step()  # warm-up (compiles the kernels)
        with PeakMemory() as mem:
            ms = time_ms(step, iters, warmup=1)
        peak = (mem.extra + mem.base) / 2 ** 30 if mem.extra is not None else float("nan")
        results[on] = dict(kernels=on, tok_s=b * s / ms * 1e3, step_ms=ms, peak_gib=peak, loss=losses[0].item(),
                           params=n_params)
        model = None  # freed before the next variant (step() holds the name, not the model)
        if CUDA:
            torch.cuda.empty_cache()
    print(f"end to end: Llama {results[False]['params'] / 1e9:.3f}B params (bf16, no optimizer step), "
          f"{layers} layers, seq {s} x micro-batch {b}, forward+backward, median of {iters} iterations\n")
    print("| kernels | tokens/s | step ms | peak GiB | first loss |")
    print("|---------|---------:|--------:|---------:|-----------:|")
    for on, r in results.items():
        print(f"| {'on' if on else 'off':<7} | {r['tok_s']:>8.0f} | {r['step_ms']:>7.1f} | {r['peak_gib']:>8.2f} | "
              f"{r['loss']:>10.5f} |")
    print(f"\ntokens/s on/off: {results[True]['tok_s'] / results[False]['tok_s']:.3f}; "
          f"peak memory on/off: {results[True]['peak_gib'] / results[False]['peak_gib']:.3f}")
    return list(results.values())


def main():
    if not CUDA and not ARGS.smoke:
        return check_cpu()
    os.environ.setdefault("MEGATRONISH_DEVICE", DEV)
    if CUDA:
        torch.backends.cuda.matmul.allow_tf32 = True
    report, rc = {"torch": torch.__version__}, 0
    report.update(bench_kernels())
    if not ARGS.skip_e2e:
        try:
            report["end_to_end"] = bench_e2e()
        except Exception:  # the per-kernel table above stands on its own
            traceback.print_exc()
            rc = 1
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    ARGS = bench_args()
    sys.exit(main())
