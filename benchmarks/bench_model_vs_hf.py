#!/usr/bin/env python
"""Training-step throughput of our GPTModel (TP=1) vs Hugging Face transformers, same shape, same process.

For each flavor (GPT-2: ``GPT2LMHeadModel``; Llama: ``LlamaForCausalLM``) both models are built with the
same shape and parameter count, fp32 on CPU, SDPA attention, no dropout, and fed the same token ids.
Two timed steps per model:

  fwd+bwd       forward with the loss, ``loss.mean().backward()`` (grads reset to None before each rep)
  fwd+bwd+adamw the same followed by an AdamW step (``torch.optim.AdamW(foreach=True)``, weight decay
                on matrices only, as ``megatronish.optim.build_optimizer`` builds it on CPU)

Warm-up reps run first; then the timed reps of ours and HF's are interleaved (the order flips every rep
so neither side always runs on a warmer cache), and the median is reported as tokens/s = batch*seq/time.
Each flavor prints ``ratio ours/hf`` lines (tokens/s ours divided by HF's; >= 1.0 means ours is as fast).
GPT-2 runs in the fair configuration: both sides use the tanh GELU as one fused op (ours ``--openai-gelu``, HF
``activation_function="gelu_pytorch_tanh"``) and SDPA.

The machine's fp32 matmul peak is measured first (best of several ``torch.mm`` of square fp32 matrices at the same
thread count), and our training FLOP/s (Megatron's model-FLOPs formula, :mod:`megatronish.training.flops`, over
the fwd+bwd step time) is reported as a fraction of it.

    python benchmarks/bench_model_vs_hf.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256]
        [--batch 4] [--reps 7] [--warmup 1] [--threads N] [--flavors gpt2 llama] [--profile]

``--profile`` additionally runs torch.profiler over one fwd+bwd of each model and prints the top ops by
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
    """Our CPU optimizer for ours; the same AdamW (foreach, same groups and hyper-parameters) for HF."""
    return build_optimizer(model.named_parameters(), "adam", lr=1e-4, weight_decay=0.01)


def hf_adamw(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                             foreach=True)


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


def interleaved(step_ours, step_hf, reps, warmup):
    """Warm both, then alternate timed reps (order flipped every rep); lists of seconds."""
    for _ in range(warmup):
        step_ours()
        step_hf()
    t_ours, t_hf = [], []
    for r in range(reps):
        if r % 2 == 0:
            t_ours.append(timed(step_ours))
            t_hf.append(timed(step_hf))
        else:
            t_hf.append(timed(step_hf))
            t_ours.append(timed(step_ours))
    return t_ours, t_hf


def profile(name, step, rows=15):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    step()
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\n--- profile: {name} (one fwd+bwd, top {rows} ops by self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


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
        ours, hf, v = build_pair(flavor, a)
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, v, (a.batch, a.seq), generator=g)
        labels = torch.randint(0, v, (a.batch, a.seq), generator=g)
        po, ph = n_params(ours), n_params(hf)
        extra = f", Llama kv groups {a.kv_groups}, ffn {a.ffn}" if flavor == "llama" else ""
        print(f"\n[{flavor}] vocab {v}{extra}; parameters: ours {po:,}, hf {ph:,}"
              + ("" if po == ph else "  (MISMATCH)"))

        kinds = [("fwd+bwd", None, None)]
        if not a.no_optimizer:
            kinds.append(("fwd+bwd+adamw", adamw(ours), hf_adamw(hf)))
        for kind, opt_o, opt_h in kinds:
            so = make_step(ours, ours_loss, ids, labels, opt_o)
            sh = make_step(hf, hf_loss, ids, labels, opt_h)
            t_o, t_h = interleaved(so, sh, a.reps, a.warmup)
            mo, mh = statistics.median(t_o), statistics.median(t_h)
            rows.append((flavor, kind, tokens / mo, tokens / mh, mo, mh, min(t_o), min(t_h)))
            if kind == "fwd+bwd":
                gflops = num_floating_point_operations(ours.config, a.batch) / mo / 1e9
                fractions.append((flavor, gflops, gflops / peak))
                print(f"  ours fwd+bwd: {gflops:.1f} GFLOP/s (model FLOPs) = {gflops / peak:.1%} of the matmul peak")
            ratios.append((flavor, kind, mh / mo))
            print(f"  {kind:<14} ours {tokens / mo:9.1f} tok/s ({mo * 1e3:7.1f} ms)   hf {tokens / mh:9.1f} tok/s "
                  f"({mh * 1e3:7.1f} ms)   ratio ours/hf {mh / mo:.3f}", flush=True)
        if a.profile:
            profile(f"ours {flavor}", make_step(ours, ours_loss, ids, labels))
            profile(f"hf {flavor}", make_step(hf, hf_loss, ids, labels))
        del ours, hf

    print("\n| flavor | step          | ours tok/s | hf tok/s | ours ms (median/min) | hf ms (median/min) "
          "| ours/hf |")
    print("|--------|---------------|-----------:|---------:|---------------------:|-------------------:"
          "|--------:|")
    for flavor, kind, to, th, mo, mh, bo, bh in rows:
        print(f"| {flavor:<6} | {kind:<13} | {to:10.1f} | {th:8.1f} | {mo * 1e3:8.1f} / {bo * 1e3:8.1f} "
              f"| {mh * 1e3:8.1f} / {bh * 1e3:7.1f} | {mh / mo:7.3f} |")
    print()
    for flavor, kind, r in ratios:
        print(f"ratio ours/hf {flavor} {kind}: {r:.3f}" + ("" if r >= 1.0 else "  (below 1.0)"))
    for flavor, gflops, frac in fractions:
        print(f"ours {flavor} fwd+bwd (eager): {gflops:.1f} GFLOP/s, {frac:.1%} of the measured fp32 matmul peak "
              f"{peak:.1f} GFLOP/s")
    print(f"total time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
