"""Serve text generation from a checkpoint with Megatron-LM's REST API (``PUT /api``), at any TP x PP layout:

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --tensor-model-parallel-size 2 \\
        --load ckpts/run1 --use-checkpoint-args --tokenizer-type GPT2BPETokenizer --vocab-file ... --port 5000

Rank 0 answers HTTP; the other ranks follow it. See docs/generation.md."""
from megatronish.inference.cli import server_main

if __name__ == "__main__":
    server_main()
