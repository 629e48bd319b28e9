"""The steps of the first-GPU check (``tools/device_check.py`` runs each in a child process of its own, under its
time box; docs/device_check.md): the environment report, the ``gpu``-marked tests, Transformer Engine's FP8, MFU of
a ~1B Llama, the kernels' speed and generation speed. Each returns ``{"status", "reason", "details"}``."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ..errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

def _result(status: str, reason: str = "", **details) -> dict:
    return {"status": status, "reason": reason, "details": details}


def _sub(status: str, reason: str = "", **values) -> dict:
    return {"status": status, "reason": reason, **values}


# ============================================================================ the steps (run in a child process)
def step_env(rehearsal: bool) -> dict:
    from . import env

    report = env.collect()
    if not rehearsal and report["device"] != "cuda":
        return _result("failed", "no CUDA device visible to the check", report=report)
    return _result("ran", "", report=report)


def step_gpu_tests(rehearsal: bool) -> dict:
    tests = REPO / "tests" / "gpu"
    if not tests.is_dir():
        return _result("skipped", f"{tests} not found (the check runs from a source checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests), "-p",
                               "no:cacheprovider", f"--junitxml={xml}"], cwd=REPO, capture_output=True, text=True)
        if not os.path.exists(xml):
            return _result("failed", f"pytest exited {proc.returncode} without a report: "
                                     f"{(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
        cases = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, why = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, why = "failed", (child.get("message") or "").splitlines()[0][:300]
                elif child.tag == "skipped":
                    outcome, why = "skipped", (child.get("message") or "")[:300]
            cases.append({"test": case.get("name"), "outcome": outcome, "reason": why})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    if rehearsal:
        return _result("ran", "CUDA-only tests skip on CPU (each with its reason)", counts=counts, tests=cases)
    ok = counts["failed"] == 0 and counts["passed"] > 0 and proc.returncode == 0
    return _result("passed" if ok else "failed", "" if ok else f"{counts['failed']} failed, pytest rc "
                   f"{proc.returncode}", counts=counts, tests=cases)


# ---- training helpers shared by te_fp8 and mfu ---------------------------------------------------------------
def _llama(**kw):
    from ..config import llama

    return llama(**kw)


def _build(cfg, dtype, dev, seed=1234):
    import torch

    from ..model.build import build_model_chunks
    from ..parallel.context import ParallelContext
    from ..parallel.random import set_random_seed

    set_random_seed(seed, 0, 0)  # the default and model-parallel RNG streams of one process
    (model,) = build_model_chunks(cfg, ParallelContext.single(), params_dtype=dtype, device=dev)
    model.init_parameters(seed)
    torch.manual_seed(seed)
    return model


def _progressions(batch: int, seq: int, vocab: int, step: int, dev):
    """A learnable stream: each sequence counts up from a random start by a stride of 1, 2 or 3 (mod vocab)."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)


def _step(model, opt, batch: int, i: int, dev, autocast=None, after=None):
    """One training step on batch ``i`` of the progression stream (``autocast``: a context factory around the
    forward; ``after``: called after the optimizer step); returns the loss tensor."""
    cfg = model.config
    ids, labels = _progressions(batch, cfg.seq_length, cfg.vocab_size, i, dev)
    with autocast() if autocast else contextlib.nullcontext():
        loss = model(ids, labels=labels).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if after is not None:
        after()
    return loss


def _train(model, steps: int, batch: int, dev, autocast=None, after=None, lr=1e-3):
    """``steps`` AdamW steps on the progression stream; returns the losses."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return [_step(model, opt, batch, i, dev, autocast, after).item() for i in range(steps)]


def _tail(losses, n=10) -> float:
    return statistics.fmean(losses[-n:])


def _flat_grads(model):
    import torch

    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def _judge(checks: dict, failures: list, name: str, got, want, *, loss_tol: float, cos_tol: float) -> None:
    """Record check ``name``: ``got`` and ``want`` are (losses, flat gradients); passed when every loss is within
    ``loss_tol`` relative and the gradients' cosine at least ``cos_tol``."""
    import torch

    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
    cos = torch.nn.functional.cosine_similarity(got[1], want[1], dim=0).item()
    ok = loss_rel <= loss_tol and cos >= cos_tol
    if not ok:
        failures.append(f"{name}: loss rel diff {loss_rel:.2e}, gradient cosine {cos:.6f}")
    checks[name] = _sub("passed" if ok else "failed", loss_rel_diff=loss_rel, grad_cosine=cos)


def step_te_fp8(rehearsal: bool) -> dict:
    import torch

    from .. import device
    from ..precision.fp8 import Fp8Recipe, enable_fp8

    dev = "cpu" if rehearsal else "cuda"
    if rehearsal:  # tiny, fp32 (bf16 matmuls are ~300x slower on this CPU)
        dims = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=256, seq_length=16, max_position_embeddings=16)
        steps, batch, dtype = 3, 2, torch.float32
    else:
        dims = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408,
                    vocab_size=4096, seq_length=512, max_position_embeddings=512)
        steps, batch, dtype = 50, 8, torch.bfloat16
    cfg = _llama(**dims)
    seq, vocab = cfg.seq_length, cfg.vocab_size
    checks = {}
    base = _train(_build(cfg, dtype, dev), steps, batch, dev)
    checks["baseline"] = _sub("ran", losses=base, dtype=str(dtype))

    failures = []
    try:  # our emulated FP8 (the CPU path), delayed scaling, hybrid; a failure here leaves the TE checks to run
        model = _build(cfg, dtype, dev)
        fp8 = enable_fp8(model, Fp8Recipe(fp8_format="hybrid"))
        emulated = _train(model, steps, batch, dev, after=fp8.update)
        rel = abs(_tail(emulated) - _tail(base)) / _tail(base)
        checks["emulated_fp8_delayed"] = _sub("ran", losses=emulated, rel_diff_vs_baseline=rel)
    except Exception as e:
        failures.append(f"emulated_fp8_delayed: {type(e).__name__}: {e}")
        checks["emulated_fp8_delayed"] = _sub("failed", f"{type(e).__name__}: {e}")

    # Transformer Engine
    try:
        from ..precision import te_layers

        te_layers.import_te()
    except ConfigError as e:
        reason = str(e)
        for name in ("te_bf16", "te_fp8_delayed", "te_fp8_current", "te_mxfp8", "te_vs_emulated",
                     "te_fp8_recompute"):
            checks[name] = _sub("skipped", reason)
        if rehearsal:
            return _result("failed" if failures else "ran", "; ".join(failures), checks=checks)
        return _result("failed", "; ".join([reason, *failures]), checks=checks)

    def run_te(name, fmt, recipe):
        model = _build(cfg, dtype, dev)
        mgr = te_layers.enable_te(model, fmt, recipe)
        losses = _train(model, steps, batch, dev, autocast=mgr.autocast)
        rel = abs(_tail(losses) - _tail(base)) / _tail(base)
        ok = rel <= 0.01 and all(math.isfinite(x) for x in losses)
        if not ok:
            failures.append(f"{name}: final loss {_tail(losses):.4f} vs bf16 {_tail(base):.4f} ({rel:.2%})")
        checks[name] = _sub("passed" if ok else "failed", losses=losses, rel_diff_vs_bf16=rel)

    for name, fmt, recipe in (("te_bf16", None, "delayed"), ("te_fp8_delayed", "hybrid", "delayed"),
                              ("te_fp8_current", "hybrid", "tensorwise"), ("te_mxfp8", "e4m3", "mxfp8")):
        try:
            if recipe == "mxfp8":
                ok, why = te_layers.mxfp8_support()
                if not ok:
                    checks[name] = _sub("skipped", f"MXFP8 is not supported here: {why}")
                    continue
            run_te(name, fmt, recipe)
        except Exception as e:  # one recipe failing leaves the others to run
            failures.append(f"{name}: {type(e).__name__}: {e}")
            checks[name] = _sub("failed", f"{type(e).__name__}: {e}")

    # TE's FP8 against our emulated FP8, same weights, current scaling (both scale from the tensor's own amax)
    try:
        ref_model = _build(cfg, dtype, dev)
        enable_fp8(ref_model, Fp8Recipe(fp8_format="hybrid", fp8_recipe="tensorwise"))
        te_model = _build(cfg, dtype, dev)
        mgr = te_layers.enable_te(te_model, "hybrid", "tensorwise")
        ids, labels = _progressions(batch, seq, vocab, 0, dev)
        out = {}
        for name, m, ctx in (("emulated", ref_model, None), ("te", te_model, mgr.autocast)):
            with ctx() if ctx else contextlib.nullcontext():
                loss = m(ids, labels=labels).float().mean()
            loss.backward()
            out[name] = ([loss.item()], _flat_grads(m))
        _judge(checks, failures, "te_vs_emulated", out["te"], out["emulated"], loss_tol=5e-3, cos_tol=0.99)
    except Exception as e:
        failures.append(f"te_vs_emulated: {type(e).__name__}: {e}")
        checks["te_vs_emulated"] = _sub("failed", f"{type(e).__name__}: {e}")
    # full recompute under TE's FP8 (delayed scaling): the recomputed forward reads back the scales the first one
    # used (TeManager.recompute_contexts), so the run follows the one without recompute
    try:
        runs = {}
        for name, extra in (("plain", {}), ("recompute", dict(recompute_granularity="full",
                                                               recompute_method="uniform", recompute_num_layers=1))):
            model = _build(_llama(**dims, **extra), dtype, dev)
            mgr = te_layers.enable_te(model, "hybrid", "delayed")
            losses = _train(model, 4, batch, dev, autocast=mgr.autocast)  # the scales move after the first step
            ids, labels = _progressions(batch, seq, vocab, 4, dev)
            with mgr.autocast():
                loss = model(ids, labels=labels).float().mean()
            loss.backward()
            runs[name] = (losses + [loss.item()], _flat_grads(model))
        _judge(checks, failures, "te_fp8_recompute", runs["recompute"], runs["plain"], loss_tol=1e-4,
               cos_tol=0.99999)
    except Exception as e:
        failures.append(f"te_fp8_recompute: {type(e).__name__}: {e}")
        checks["te_fp8_recompute"] = _sub("failed", f"{type(e).__name__}: {e}")
    device.synchronize()
    return _result("failed" if failures else "passed", "; ".join(failures), checks=checks)


# ---- MFU -----------------------------------------------------------------------------------------------------
def _llama_1b(seq):
    """Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads, 8 key/value groups, ffn 8192, vocab 128256."""
    return _llama(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
                  vocab_size=128256, seq_length=seq, max_position_embeddings=seq, rotary_base=500000,
                  untie_embeddings_and_output_weights=False)


def _measure_mfu(cfg, dev, dtype, batches, steps, warmup, use_te: bool) -> dict:
    import torch

    from .. import device
    from ..training.flops import device_peak_tflops, num_floating_point_operations
    from ..training.memory import activation_bytes, bytes_per_parameter

    model = _build(cfg, dtype, dev)
    autocast = None
    if use_te:
        from ..precision import te_layers

        autocast = te_layers.enable_te(model).autocast
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, **({"fused": True} if dev == "cuda" else {}))
    seq = cfg.seq_length

    def step(b, i):
        return _step(model, opt, b, i, dev, autocast)

    fits, search = None, []
    for b in batches:  # the largest micro-batch that fits: two steps each
        try:
            step(b, 0)
            step(b, 1).item()
            fits = b
            search.append({"micro_batch": b, "fits": True})
        except RuntimeError as e:  # torch's OutOfMemoryError, or TE's / cuBLAS's allocation failure
            if not isinstance(e, torch.OutOfMemoryError) and not any(m in str(e) for m in ("out of memory",
                                                                                       "ALLOC_FAILED")):
                raise
            search.append({"micro_batch": b, "fits": False})
            opt.zero_grad(set_to_none=True)
            device.empty_cache()
            break
    if fits is None:
        return {"status": "failed", "reason": f"micro-batch {batches[0]} does not fit", "search": search}
    device.empty_cache()
    if dev == "cuda":
        device.reset_peak_memory()
    for i in range(warmup):
        step(fits, i)
    device.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(fits, warmup + i)
    loss.item()
    device.synchronize()
    elapsed = (time.perf_counter() - t0) / steps
    tflops = num_floating_point_operations(cfg, fits) / elapsed / 1e12
    peak = device_peak_tflops(device.device_name())
    estimate = n_params * bytes_per_parameter(dtype, dtype) + activation_bytes(cfg, micro_batch_size=fits)
    out = {"micro_batch": fits, "search": search, "params": n_params, "step_seconds": elapsed,
           "tokens_per_sec": fits * seq / elapsed, "tflops": tflops, "peak_tflops": peak,
           "mfu": tflops / peak if peak else None, "memory_estimate_bytes": estimate,
           "note": "pure bf16 parameters and AdamW states (no fp32 master copy); the estimate uses the same"}
    if dev == "cuda":
        out["peak_memory_bytes"] = device.max_memory_allocated()
        out["peak_reserved_bytes"] = device.max_memory_reserved()
        out["device_total_bytes"] = device.memory_info()[1]
        out["measured_over_estimate"] = out["peak_memory_bytes"] / estimate
    return out


def step_mfu(rehearsal: bool) -> dict:
    import torch

    if rehearsal:
        cfg = _llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                     vocab_size=512, seq_length=64, max_position_embeddings=64)
        local = _measure_mfu(cfg, "cpu", torch.float32, [1, 2], steps=2, warmup=1, use_te=False)
        te = _sub("skipped", "Transformer Engine needs CUDA")
        return _result("ran", "CPU rehearsal: tiny fp32 model, no datasheet peak (MFU not judged)",
                       paths={"local": {"status": "ran", **local}, "transformer_engine": te})
    cfg = _llama_1b(4096)
    paths, failures = {}, []
    for name, use_te in (("local", False), ("transformer_engine", True)):
        try:
            r = _measure_mfu(cfg, "cuda", torch.bfloat16, [1, 2, 4, 8, 16], steps=30, warmup=3, use_te=use_te)
        except ConfigError as e:  # Transformer Engine is not installed: nothing to measure on that path
            r = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # an error on either path is a failure, not a skip
            r = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        r.setdefault("status", "ran")
        paths[name] = r
        import gc

        gc.collect()
        from .. import device

        device.empty_cache()
    best = max((p.get("mfu") or 0.0) for p in paths.values())
    for name, p in paths.items():
        if p["status"] == "failed":
            failures.append(f"{name} path: {p.get('reason', '')}")
    if best < 0.45:
        failures.append(f"best MFU {best:.1%} < 45%")
    return _result("failed" if failures else "passed", "; ".join(failures), paths=paths, best_mfu=best)


# ---- kernel speed --------------------------------------------------------------------------------------------
def _time(fn, reps, sync, warm: bool = True) -> float:
    if warm:
        fn()
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_kernels(rehearsal: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from .. import device, kernels
    from ..model.rope import RotaryEmbedding, apply_rotary
    from ..parallel.cross_entropy import vocab_parallel_cross_entropy

    dev = "cpu" if rehearsal else "cuda"
    backend = kernels.kernels_backend(dev)
    if backend is None:
        return _result("skipped" if rehearsal else "failed", "the Triton kernels cannot run here (triton missing, "
                       "or no CUDA and TRITON_INTERPRET unset)")
    dtype = torch.float32 if rehearsal else torch.bfloat16
    rows, h, f, vocab = (64, 64, 96, 512) if rehearsal else (16384, 4096, 14336, 128256)
    s, b, heads, d = (16, 2, 4, 32) if rehearsal else (4096, 4, 32, 128)
    ce_rows = rows if rehearsal else 4096
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    x, w = rnd(rows, h).requires_grad_(), (1 + 0.1 * rnd(h)).requires_grad_()
    dy = rnd(rows, h)
    hh, dh = (2 * rnd(rows, 2 * f)).requires_grad_(), rnd(rows, f)
    qk = rnd(s, b, heads, d)
    cos, sin = RotaryEmbedding(d, 1.0)(s, device=dev)
    logits = (2 * rnd(ce_rows, 1, vocab)).float().requires_grad_()
    target = torch.randint(0, vocab, (ce_rows, 1), generator=g).to(dev)

    def fb(y, leaves, grad):
        torch.autograd.grad(y, leaves, grad)

    def swiglu_eager(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    ops = {
        "rms_norm": (lambda: fb(kernels.rms_norm(x, w, 1e-5), (x, w), dy),
                     lambda: fb(F.rms_norm(x, (h,), w, 1e-5), (x, w), dy)),
        "swiglu": (lambda: fb(kernels.swiglu(hh), (hh,), dh), lambda: fb(swiglu_eager(hh), (hh,), dh)),
        "rope": (lambda: kernels.apply_rotary_(qk.clone(), cos, sin), lambda: apply_rotary(qk.clone(), cos, sin)),
        "cross_entropy": (
            lambda: fb(kernels.vocab_parallel_cross_entropy(logits.clone(), target, 0.0, vocab).sum(), (logits,),
                       None),
            lambda: fb(vocab_parallel_cross_entropy(logits.clone(), target, 0.0, vocab).sum(), (logits,), None)),
    }
    reps = 2 if rehearsal else 20
    results, slower = {}, []
    for name, (fused, eager) in ops.items():
        t_fused, t_eager = _time(fused, reps, device.synchronize), _time(eager, reps, device.synchronize)
        speedup = t_eager / t_fused
        results[name] = {"fused_ms": t_fused * 1e3, "eager_ms": t_eager * 1e3, "speedup": speedup}
        if speedup <= 1.0:
            slower.append(f"{name} {speedup:.2f}x")
    if rehearsal:
        return _result("ran", f"kernels {backend} on CPU at tiny sizes: timings say nothing (not judged)", ops=results)
    return _result("failed" if slower else "passed", ("not faster than eager: " + ", ".join(slower)) if slower else "",
                   ops=results, backend=backend)


# ---- generation ----------------------------------------------------------------------------------------------
def step_generation(rehearsal: bool) -> dict:
    import torch

    from .. import device
    from ..convert import hf_state_dict_to_ours, load_into_model, model_config_from_hf
    from ..convert.tiny import tiny_hf_model
    from ..inference import Generator, SamplingParams
    from ..model.build import build_model_chunks
    from ..parallel.context import ParallelContext

    dev = torch.device("cpu" if rehearsal else "cuda")
    layers, hidden, heads, groups, vocab = (2, 64, 4, 2, 256) if rehearsal else (8, 1024, 16, 4, 32000)
    prompt, new, batch = (8, 4, 2) if rehearsal else (128, 64, 8)
    dtype = torch.float32 if rehearsal else torch.bfloat16
    hf = tiny_hf_model("LlamaForCausalLM", vocab=vocab, num_hidden_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, num_key_value_heads=groups,
                       intermediate_size=int(hidden * 8 / 3 / 64) * 64 or 64, max_position_embeddings=prompt + new)
    hf.generation_config.eos_token_id = None
    cfg, arch = model_config_from_hf(hf.config.to_dict())
    (model,) = build_model_chunks(cfg, ParallelContext.single(), params_dtype=dtype, device=dev)
    load_into_model(model, hf_state_dict_to_ours(hf.state_dict(), cfg, arch, tp=1), 0, 1)
    hf = hf.to(device=dev, dtype=dtype)
    model.eval()
    gen = Generator(model, max_batch=batch, max_sequence=prompt + new)
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))
    prompts = ids.tolist()
    ids = ids.to(dev)

    def ours():
        return gen.generate(prompts, new, SamplingParams(top_k=1)).tokens

    def theirs():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               use_cache=True, pad_token_id=0).tolist()

    same = ours() == theirs()  # also the warm-up
    reps = 1 if rehearsal else 3
    t_ours, t_hf = (_time(fn, reps, device.synchronize, warm=False) for fn in (ours, theirs))
    tok = batch * new
    return _result("ran", "informational (no pass criterion)" if not rehearsal else "CPU rehearsal, tiny model",
                   ours_tokens_per_sec=tok / t_ours, hf_tokens_per_sec=tok / t_hf, ratio=t_hf / t_ours,
                   greedy_tokens_identical=same, batch=batch, prompt=prompt, new_tokens=new, dtype=str(dtype))


STEP_FUNCTIONS = {"env": step_env, "gpu_tests": step_gpu_tests, "te_fp8": step_te_fp8, "mfu": step_mfu,
                  "kernels": step_kernels, "generation": step_generation}
