#!/usr/bin/env python
"""Training-step throughput of our GPTModel (TP=1) vs Hugging Face transformers, same shape, same process.

For each flavor (GPT-2: ``GPT2LMHeadModel``; Llama: ``LlamaForCausalLM``) both models are built with the
same shape and parameter count, fp32 on CPU, SDPA attention, no dropout, and fed the same token ids.
Two timed steps per model:

  fwd+bwd       forward with the loss, ``loss.mean().backward()`` (grads reset to None before each rep)
  fwd+bwd+adamw the same followed by an AdamW step: ``torch.optim.AdamW(fused=True)`` for both (transformers'
                Trainer default on torch >= 2.8, and what ``megatronish.optim.build_optimizer`` builds), weight
                decay on matrices only

With ``--compile`` (the default; ``--no-compile`` skips it) each model also runs under ``torch.compile``: HF's
whole model (its loss included) through ``torch.compile(model)``, ours through ``--torch-compile``'s compiler
(each transformer layer and the loss; :mod:`megatronish.training.compile`). The compiled copies are separate
models built from the same seed.

Warm-up reps run first (they include compilation); then the timed reps of all variants are interleaved (the order
rotates every rep so no variant always runs on a warmer cache), and the median is reported as
tokens/s = batch*seq/time. Each flavor prints ``ratio`` lines (tokens/s ours divided by HF's; >= 1.0 means ours
is as fast): ours eager / HF eager, ours (eager and compiled) / HF compiled. GPT-2 runs in the fair
configuration: both sides use the tanh GELU as one fused op (ours ``--openai-gelu``, HF
``activation_function="gelu_pytorch_tanh"``) and SDPA.

The machine's fp32 matmul peak is measured first (best of several ``torch.mm`` of square fp32 matrices at the same
thread count), and our training FLOP/s (Megatron's model-FLOPs formula, :mod:`megatronish.training.flops`, over
the fwd+bwd step time) is reported as a fraction of it.

    python benchmarks/bench_model_vs_hf.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256]
        [--batch 4] [--reps 7] [--warmup 1] [--threads N] [--flavors gpt2 llama] [--no-compile] [--profile]

``--profile`` additionally runs torch.profiler over one fwd+bwd of each eager model and prints the top ops by
self CPU time.
"""
import argparse
import os
import platform
import statistics
import time
import warnings

import torch

from megatronish.config import gpt2, llama
from megatronish.model import GPTModel
from megatronish.optim.optimizer import build_optimizer, no_weight_decay
from megatronish.parallel.random import set_random_seed
from megatronish.training.compile import Compiler
from megatronish.training.flops import num_floating_point_operations


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-groups", type=int, default=4, help="Llama key/value heads (GQA)")
    p.add_argument("--ffn", type=int, default=1408, help="Llama SwiGLU intermediate size (GPT-2 uses 4h)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--gpt2-vocab", type=int, default=50304)
    p.add_argument("--llama-vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=7, help="timed reps per model and step kind")
    p.add_argument("--warmup", type=int, default=1, help="untimed reps per model and step kind, first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--flavors", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--no-optimizer", action="store_true", help="skip the fwd+bwd+adamw step")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler op table per model")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time both models under torch.compile (default: on)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ---- model construction ---------------------------------------------------------------------------------

def build_pair(flavor, a):
    """(ours, hf, vocab): our GPTModel and the HF model of the same shape, both in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if flavor == "gpt2":
        v = a.gpt2_vocab
        cfg = gpt2(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, vocab_size=v,
                   seq_length=a.seq, attention_dropout=0.0, hidden_dropout=0.0, openai_gelu=True)
        hf_cfg = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, n_positions=a.seq, vocab_size=v,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_pytorch_tanh",
                            layer_norm_epsilon=1e-5, use_cache=False, attn_implementation="sdpa")
        hf_cls = GPT2LMHeadModel
    else:
        v = a.llama_vocab
        cfg = llama(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                    num_query_groups=a.kv_groups, ffn_hidden_size=a.ffn, vocab_size=v, seq_length=a.seq,
                    attention_dropout=0.0, hidden_dropout=0.0, norm_epsilon=1e-5)
        hf_cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                             num_attention_heads=a.heads, num_key_value_heads=a.kv_groups, vocab_size=v,
                             max_position_embeddings=a.seq, rms_norm_eps=1e-5, tie_word_embeddings=False,
                             attention_bias=False, mlp_bias=False, attention_dropout=0.0, use_cache=False,
                             attn_implementation="sdpa")
        hf_cls = LlamaForCausalLM
    if cfg.padded_vocab_size() != v:
        warnings.warn(f"vocab {v} is padded to {cfg.padded_vocab_size()} in ours: parameter counts differ; "
                      f"pick a multiple of {cfg.make_vocab_size_divisible_by}", stacklevel=2)
    ours = GPTModel(cfg)
    ours.init_parameters(a.seed)
    torch.manual_seed(a.seed)
    hf = hf_cls(hf_cfg)
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl != "sdpa":
        warnings.warn(f"HF attention implementation is {impl!r}, not 'sdpa'", stacklevel=2)
    ours.train()
    hf.train()
    return ours, hf, v


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def adamw(model):
    """Our CPU optimizer for ours; the same AdamW (fused, same groups and hyper-parameters) for HF."""
    return build_optimizer(model.named_parameters(), "adam", lr=1e-4, weight_decay=0.01)


def hf_adamw(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                             fused=True)


def compile_ours(model):
    """``--torch-compile``: each transformer layer's forward and the loss compiled (in place)."""
    compiler = Compiler("cpu")
    if compiler.problem:
        raise SystemExit(f"--compile: {compiler.problem} (rerun with --no-compile)")
    compiler.apply([model])
    return model


# ---- steps ------------------------------------------------------------------------------------------------

def ours_loss(model, ids, labels):
    return model(ids, labels=labels).mean()


def hf_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels, use_cache=False).loss


def make_step(model, loss_fn, ids, labels, optimizer=None):
    def step():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, labels)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss
    return step


def matmul_peak_gflops(n=2048, reps=10):
    """The best fp32 GFLOP/s of ``torch.mm`` on ``n x n`` matrices (and half of ``n``), at the current threads."""
    best = 0.0
    for size in (n // 2, n):
        x, y = torch.randn(size, size), torch.randn(size, size)
        torch.mm(x, y)
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(x, y)
            best = max(best, 2 * size ** 3 / (time.perf_counter() - t0) / 1e9)
    return best


def timed(step):
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def interleaved(steps, reps, warmup):
    """Warm every step (``steps``: name -> callable), then time ``reps`` rounds with the order rotated each round;
    name -> list of seconds, and name -> seconds of the warm-up (compilation included)."""
    warm = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        warm[name] = time.perf_counter() - t0
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(timed(steps[name]))
    return times, warm


def profile(name, step, rows=15):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    step()
    with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    print(f"\n--- profile: {name} (one fwd+bwd, top {rows} ops by self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
    print(f"--- profile: {name}, by input shapes ---")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                             max_name_column_width=32, max_shapes_column_width=60))


# ---- main -------------------------------------------------------------------------------------------------

def main():
    a = parse_args()
    import transformers
    transformers.logging.set_verbosity_error()  # e.g. the "loss_type=None ... ForCausalLMLoss" notice
    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    set_random_seed(a.seed)
    tokens = a.batch * a.seq
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python "
          f"{platform.python_version()}, {platform.machine()}, threads {torch.get_num_threads()} "
          f"(cores {os.cpu_count()})")
    print(f"shape: layers {a.layers}, hidden {a.hidden}, heads {a.heads}, seq {a.seq}, batch {a.batch} "
          f"({tokens} tokens/step), fp32, warm-up {a.warmup}, timed reps {a.reps} (median)")

    peak = matmul_peak_gflops()
    print(f"measured fp32 matmul peak: {peak:.1f} GFLOP/s ({torch.get_num_threads()} threads, best torch.mm)")

    rows, ratios, fractions = [], [], []
    t_start = time.perf_counter()
    for flavor in a.flavors:
        models = {}
        models["ours"], models["hf"], v = build_pair(flavor, a)
        if a.compile:
            ours_c, hf_c, _ = build_pair(flavor, a)  # the same weights (same seed), compiled
            models["ours compiled"], models["hf compiled"] = compile_ours(ours_c), torch.compile(hf_c)
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, v, (a.batch, a.seq), generator=g)
        labels = torch.randint(0, v, (a.batch, a.seq), generator=g)
        po, ph = n_params(models["ours"]), n_params(models["hf"])
        extra = f", Llama kv groups {a.kv_groups}, ffn {a.ffn}" if flavor == "llama" else ""
        print(f"\n[{flavor}] vocab {v}{extra}; parameters: ours {po:,}, hf {ph:,}"
              + ("" if po == ph else "  (MISMATCH)"))

        kinds = ["fwd+bwd"] + ([] if a.no_optimizer else ["fwd+bwd+adamw"])
        for kind in kinds:
            steps = {}
            for name, m in models.items():
                opt = None
                if kind != "fwd+bwd":
                    opt = hf_adamw(m) if name.startswith("hf") else adamw(m)
                steps[name] = make_step(m, hf_loss if name.startswith("hf") else ours_loss, ids, labels, opt)
            times, warm = interleaved(steps, a.reps, a.warmup)
            med = {n: statistics.median(t) for n, t in times.items()}
            for name in steps:
                rows.append((flavor, kind, name, tokens / med[name], med[name], min(times[name]), warm[name]))
            if kind == "fwd+bwd":
                for name in [n for n in steps if n.startswith("ours")]:
                    gflops = num_floating_point_operations(models["ours"].config, a.batch) / med[name] / 1e9
                    fractions.append((flavor, name, gflops, gflops / peak))
            pairs = [("ours", "hf")]
            if a.compile:
                pairs += [("ours", "hf compiled"), ("ours compiled", "hf compiled")]
            for num, den in pairs:
                ratios.append((flavor, kind, num, den, med[den] / med[num]))
            print(f"  {kind:<14} " + "   ".join(f"{n} {tokens / med[n]:8.1f} tok/s" for n in steps), flush=True)
        if a.profile:
            profile(f"ours {flavor}", make_step(models["ours"], ours_loss, ids, labels))
            profile(f"hf {flavor}", make_step(models["hf"], hf_loss, ids, labels))
        del models

    print("\n| flavor | step          | model         | tok/s   | ms (median / min)   | warm-up s |")
    print("|--------|---------------|---------------|--------:|--------------------:|----------:|")
    for flavor, kind, name, tps, med, best, warm in rows:
        print(f"| {flavor:<6} | {kind:<13} | {name:<13} | {tps:7.1f} | {med * 1e3:8.1f} / {best * 1e3:8.1f} "
              f"| {warm:9.1f} |")
    print()
    for flavor, kind, num, den, r in ratios:
        print(f"ratio {flavor} {kind:<13} {num} / {den}: {r:.3f}" + ("" if r >= 1.0 else "  (below 1.0)"))
    for flavor, name, gflops, frac in fractions:
        print(f"{name} {flavor} fwd+bwd: {gflops:.1f} GFLOP/s (model FLOPs), {frac:.1%} of the measured fp32 "
              f"matmul peak {peak:.1f} GFLOP/s")
    print(f"total time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
