"""Pretrain a GPT model with Megatron-LM's flags: ``torchrun --nproc-per-node N pretrain_gpt.py <flags>``
(installed as ``megatronish-pretrain-gpt``; the code is ``megatronish/tools/pretrain_gpt.py``)."""
from megatronish.tools.pretrain_gpt import main

if __name__ == "__main__":
    main()
