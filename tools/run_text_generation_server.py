"""Serve text generation from a checkpoint with Megatron-LM's REST API (``PUT /api``), at any TP x PP layout:

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --tensor-model-parallel-size 2 \\
        --load ckpts/run1 --use-checkpoint-args --tokenizer-type GPT2BPETokenizer --vocab-file ... --port 5000

Rank 0 answers HTTP; the other ranks follow it. See docs/generation.md."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatronish.inference.cli import server_main  # noqa: E402

if __name__ == "__main__":
    server_main()
