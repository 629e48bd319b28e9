#!/usr/bin/env python
"""Conversion time and peak RSS for a ~1B-parameter randomly initialized Llama (fp32 on disk), vs plain
``safetensors.torch.load_file`` + ``save_file`` of the same tensors in one process.

Steps, each in its own process (peak RSS = that process's ``ru_maxrss``):

  generate      write the HF model tensor by tensor (streaming safetensors writer: one tensor in memory)
  baseline      load_file(model.safetensors) + save_file(all tensors) to another directory
  hf->ours      megatronish-convert-checkpoint --loader hf --saver megatronish (tools/checkpoint/convert.py)
  ours->hf      megatronish-convert-checkpoint --loader megatronish --saver hf

    python benchmarks/bench_convert.py [--dir /work/tmp_bench_convert] [--layers 22] [--hidden 2048] ...

Files are deleted at the end (also on failure).
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(kind, a):
    import torch

    t0 = time.perf_counter()
    if kind == "generate":
        from megatronish.config import llama
        from megatronish.convert.hf_config import hf_config_from_model
        from megatronish.convert.hf_io import HFWriter

        cfg = llama(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, num_query_groups=a.kv,
                    ffn_hidden_size=a.ffn, vocab_size=a.vocab, seq_length=2048)
        h, d = a.hidden, a.hidden // a.heads
        plan = [("model.embed_tokens.weight", (a.vocab, h))]
        for i in range(a.layers):
            p = f"model.layers.{i}."
            plan += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (a.heads * d, h)),
                     (p + "self_attn.k_proj.weight", (a.kv * d, h)), (p + "self_attn.v_proj.weight", (a.kv * d, h)),
                     (p + "self_attn.o_proj.weight", (h, a.heads * d)), (p + "post_attention_layernorm.weight", (h,)),
                     (p + "mlp.gate_proj.weight", (a.ffn, h)), (p + "mlp.up_proj.weight", (a.ffn, h)),
                     (p + "mlp.down_proj.weight", (h, a.ffn))]
        plan += [("model.norm.weight", (h,)), ("lm_head.weight", (a.vocab, h))]
        w = HFWriter(os.path.join(a.dir, "hf"), [(n, s, torch.float32) for n, s in plan], 10**13)
        g = torch.Generator().manual_seed(0)
        for n, s in plan:
            w.write(n, torch.randn(s, generator=g) * 0.02)
        w.close(hf_config_from_model(cfg))
        out = {"params": sum(torch.Size(s).numel() for _, s in plan)}
    elif kind == "baseline":
        from safetensors.torch import load_file, save_file

        sd = load_file(os.path.join(a.dir, "hf", "model.safetensors"))
        os.makedirs(os.path.join(a.dir, "copy"), exist_ok=True)
        save_file(sd, os.path.join(a.dir, "copy", "model.safetensors"))
        out = {}
    else:
        src, dst, loader, saver = (("hf", "ours", "hf", "megatronish") if kind == "hf2ours"
                                   else ("ours", "back", "megatronish", "hf"))
        spec_args = ["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir",
                     os.path.join(a.dir, src), "--save-dir", os.path.join(a.dir, dst)]
        sys.argv = ["convert.py", *spec_args]
        from megatronish.tools import convert_checkpoint

        convert_checkpoint.main(spec_args)
        out = {}
    out.update(seconds=time.perf_counter() - t0, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    print("RESULT " + json.dumps(out), flush=True)


def _run(kind, a):
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, "--dir", a.dir, "--layers", str(a.layers),
            "--hidden", str(a.hidden), "--heads", str(a.heads), "--kv", str(a.kv), "--ffn", str(a.ffn),
            "--vocab", str(a.vocab)]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{kind} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _du(path):
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.join(ROOT, "..", "tmp_bench_convert"))
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--child", default=None)
    a = p.parse_args()
    if a.child:
        return _child(a.child, a)
    a.dir = os.path.abspath(a.dir)
    os.makedirs(a.dir, exist_ok=False)
    try:
        gen = _run("generate", a)
        size = _du(os.path.join(a.dir, "hf"))
        print(f"Llama: {a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.kv} kv, ffn {a.ffn}, vocab {a.vocab}: "
              f"{gen['params'] / 1e9:.2f} B parameters, {size:.2f} GB fp32 on disk "
              f"(generated in {gen['seconds']:.1f} s, peak RSS {gen['peak_rss_gb']:.2f} GB)")
        base = _run("baseline", a)
        shutil.rmtree(os.path.join(a.dir, "copy"))
        h2o = _run("hf2ours", a)
        o2h = _run("ours2hf", a)
        print(f"{'step':<34}{'time s':>9}{'peak RSS GB':>13}{'time ratio':>12}{'RSS ratio':>11}")
        for name, r in (("load_file + save_file (baseline)", base), ("convert hf -> megatronish", h2o),
                        ("convert megatronish -> hf", o2h)):
            print(f"{name:<34}{r['seconds']:>9.1f}{r['peak_rss_gb']:>13.2f}{r['seconds'] / base['seconds']:>12.2f}"
                  f"{r['peak_rss_gb'] / base['peak_rss_gb']:>11.2f}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
