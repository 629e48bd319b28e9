#!/usr/bin/env python
"""Generation throughput of our KV-cached generator vs transformers' ``generate`` with its cache, same weights.

For each flavor (GPT-2: ``GPT2LMHeadModel``; Llama: ``LlamaForCausalLM`` with GQA) a random Hugging Face model
is converted to ours (the same weights), and both generate greedily from the same prompts (no end-of-sequence
stop, so both produce exactly the asked tokens; the script checks that the tokens agree). GPT-2 runs in the fair
configuration: both sides use the tanh GELU as one fused op (ours ``--openai-gelu``, HF
``activation_function="gelu_pytorch_tanh"``, as in ``bench_model_vs_hf.py``):

  prefill   tokens/s = batch x prompt / time of generating 1 token (one forward over the prompts)
  decode    tokens/s = batch x (N - 1) / (time of generating N tokens - time of generating 1 token)

at batch 1 and 8 (``--batches``). Timed reps of ours and transformers' are interleaved (the order flips every
rep) and the median is reported, with ``ratio ours/hf`` (>= 1.0: ours is as fast). Same process, same threads.

    python benchmarks/bench_generation.py [--flavors gpt2 llama] [--layers 4] [--hidden 512] [--heads 8]
        [--prompt 128] [--new 64] [--batches 1 8] [--reps 5] [--threads N] [--device cpu|cuda] [--bf16]
"""
import argparse
import platform
import statistics
import time

import torch

from megatronish.convert import hf_state_dict_to_ours, load_into_model, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.inference import Generator, SamplingParams
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavors", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-groups", type=int, default=4, help="Llama key/value heads")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="generated tokens (N)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 weights on both sides (default fp32)")
    return p.parse_args()


def build(flavor, a, dtype, device):
    arch = "GPT2LMHeadModel" if flavor == "gpt2" else "LlamaForCausalLM"
    ctx = a.prompt + a.new
    if flavor == "gpt2":
        over = dict(n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, n_positions=ctx,
                    activation_function="gelu_pytorch_tanh")
    else:
        over = dict(num_hidden_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                    num_key_value_heads=a.kv_groups, intermediate_size=int(a.hidden * 8 / 3 / 64) * 64,
                    max_position_embeddings=ctx)
    hf = tiny_hf_model(arch, vocab=a.vocab, **over)
    hf.generation_config.eos_token_id = None
    cfg, ours_arch = model_config_from_hf(hf.config.to_dict())
    (model,) = build_model_chunks(cfg, ParallelContext.single(), params_dtype=dtype, device=device)
    load_into_model(model, hf_state_dict_to_ours(hf.state_dict(), cfg, ours_arch, tp=1), 0, 1)
    hf = hf.to(device=device, dtype=dtype)
    return hf, model.eval(), cfg


def main():
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    import transformers

    cpu = platform.processor() or platform.machine()
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, {cpu}, "
          f"device {dev}, {torch.get_num_threads()} threads, {dtype}; prompt {a.prompt}, new {a.new}")
    for flavor in a.flavors:
        hf, model, cfg = build(flavor, a, dtype, dev)
        n_params = sum(p.numel() for p in hf.parameters())
        print(f"\n## {flavor}: {a.layers} layers, hidden {a.hidden}, heads {a.heads}"
              + (f", kv groups {a.kv_groups}" if flavor == "llama" else "") + f", vocab {a.vocab}, "
              f"{n_params / 1e6:.1f} M parameters")
        gen = Generator(model, max_batch=max(a.batches), max_sequence=a.prompt + a.new)
        g = torch.Generator().manual_seed(0)
        for b in a.batches:
            ids = torch.randint(0, a.vocab, (b, a.prompt), generator=g)
            prompts = ids.tolist()
            ids = ids.to(dev)
            mask = torch.ones_like(ids)

            def ours(n, gen=gen, prompts=prompts):
                return gen.generate(prompts, n, SamplingParams(top_k=1)).tokens

            def theirs(n, hf=hf, ids=ids, mask=mask):
                with torch.inference_mode():
                    return hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                       use_cache=True, pad_token_id=0).tolist()

            same = ours(a.new) == theirs(a.new)  # also the warm-up
            ours(1), theirs(1)
            times = {k: [] for k in ("ours1", "oursN", "hf1", "hfN")}
            for rep in range(a.reps):
                order = [("ours", ours), ("hf", theirs)]
                for name, fn in order if rep % 2 == 0 else order[::-1]:
                    for n, key in ((1, name + "1"), (a.new, name + "N")):
                        sync()
                        t0 = time.perf_counter()
                        fn(n)
                        sync()
                        times[key].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            pre_o, pre_h = b * a.prompt / med["ours1"], b * a.prompt / med["hf1"]
            dec_o = b * (a.new - 1) / (med["oursN"] - med["ours1"])
            dec_h = b * (a.new - 1) / (med["hfN"] - med["hf1"])
            print(f"batch {b}: greedy tokens identical: {same}")
            print(f"  prefill  ours {pre_o:10.0f} tok/s   hf {pre_h:10.0f} tok/s   ratio ours/hf {pre_o / pre_h:.2f}")
            print(f"  decode   ours {dec_o:10.1f} tok/s   hf {dec_h:10.1f} tok/s   ratio ours/hf {dec_o / dec_h:.2f}")
        del hf, model, gen


if __name__ == "__main__":
    main()
