#!/usr/bin/env python
"""Our checkpoint and its transformers export give the same logits on random tokens.

    python examples/deepseek_v3/compare_hf.py runs/deepseek_v3_tiny/checkpoints runs/deepseek_v3_tiny/hf

Our model is built from the checkpoint's stored config in one process (fp32) and filled with its global tensors;
transformers loads the exported directory with ``AutoModelForCausalLM``. Exits 1 when the largest difference is
above 1e-5 of the largest logit.
"""
import argparse
import sys
from types import SimpleNamespace

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatronish.convert import load_into_model
    from megatronish.convert.plugins import load_megatronish
    from megatronish.model import GPTModel

    src = load_megatronish(SimpleNamespace(load_dir=args.checkpoint, true_vocab_size=None))
    ours = GPTModel(src.cfg).eval()
    load_into_model(ours, {name: t.float() for name, t in src.tensors()})
    theirs = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    vocab = src.cfg.vocab_size
    ids = torch.randint(0, vocab, (2, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids)[..., :vocab], theirs(input_ids=ids).logits
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    print(f"{type(theirs).__name__}: max |logits - ours| = {diff:.3g} (largest logit {scale:.3g})")
    return 0 if diff <= 1e-5 * scale else 1


if __name__ == "__main__":
    sys.exit(main())
