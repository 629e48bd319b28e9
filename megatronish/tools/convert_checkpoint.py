"""Convert checkpoints between Hugging Face (GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE) and megatronish.

    megatronish-convert-checkpoint --model-type GPT --loader hf --saver megatronish \\
        --load-dir hf/llama --save-dir ckpts/llama --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader megatronish --saver hf \\
        --load-dir ckpts/run1 --save-dir hf/run1                 # Megatron-LM's script name, the same tool

Our checkpoints hold global tensors and reshard on load into any layout, so the target sizes only check that
the model splits that way and are recorded in the checkpoint's config; the vocabulary is padded for the target
tensor-parallel size. The result is ``<save-dir>/release`` (tracker ``release``): load it with
``pretrain_gpt.py --load <save-dir> --finetune``. Streaming: one tensor (and its sources) at a time on the
Hugging Face side. See docs/convert.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..arguments import exit_on_config_error
from ..convert.hf_config import ConvertError
from ..convert.plugins import LOADERS, SAVERS
from ..errors import CommandLineParser


def parse(argv=None) -> argparse.Namespace:
    p = CommandLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", required=True, choices=["GPT"], help="only GPT (decoder-only) models")
    p.add_argument("--loader", required=True, choices=sorted(LOADERS), help="source format")
    p.add_argument("--saver", required=True, choices=sorted(SAVERS), help="target format")
    p.add_argument("--load-dir", required=True, help="HF model directory, or a megatronish --save / iter directory")
    p.add_argument("--save-dir", required=True, help="output directory")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="layout the megatronish checkpoint is prepared for (vocabulary padding, split checks)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary; rows past it are padding (default: the source's vocab size)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="megatronish saver: pad the vocabulary to a multiple of this x target TP")
    p.add_argument("--max-shard-size", default="5GB", help="hf saver: bytes per safetensors file (e.g. 5GB)")
    p.add_argument("--megatron-path", default=None, help="accepted for Megatron command lines; not needed")
    return p.parse_args(argv)


def run(args) -> None:
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConvertError("--save-dir must differ from --load-dir")
    t0 = time.perf_counter()
    src = LOADERS[args.loader](args)
    SAVERS[args.saver](args, src)
    n = sum(1 for _ in src.specs)
    print(f"converted {src.arch} ({src.cfg.num_layers} layers, hidden {src.cfg.hidden_size}, vocabulary "
          f"{src.cfg.vocab_size}; {n} tensors) from {args.loader} {args.load_dir} to {args.saver} {args.save_dir} "
          f"in {time.perf_counter() - t0:.1f} s")


def main(argv=None) -> int:
    args = parse(argv)
    exit_on_config_error(lambda: run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
