"""Generate text from a checkpoint once, from the command line (prompts from --prompts, --prompt-file or
standard input, one per line), at any TP x PP layout:

    python tools/generate.py --load ckpts/run1 --use-checkpoint-args --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --prompts "The Python" --num-tokens-to-generate 32

See docs/generation.md."""
from megatronish.inference.cli import generate_main

if __name__ == "__main__":
    generate_main()
