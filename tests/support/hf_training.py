"""The reference for training comparisons against transformers: a Hugging Face model trained by
``torch.optim.AdamW`` on given samples with Megatron's defaults for everything a test's command line leaves out
(weight decay 0.01 on matrices only, global grad-norm clip 1.0, betas 0.9 / 0.999, eps 1e-8) and its cosine
schedule with linear warm-up; and the tokenized corpus both sides train on."""
import math
import os

import torch

from megatronish.data.sampler import collate
from megatronish.data.tokenizers import gpt2_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS, GBS, MBS, SEQ, LR, MIN_LR, WARMUP = 12, 8, 2, 64, 3e-3, 3e-4, 2


def schedule_flags() -> list[str]:
    """The batch and learning-rate flags of the reference (``--seq-length`` and the data are the test's)."""
    return ["--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-iters", str(ITERS),
            "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(WARMUP)]


def lr_at(iteration: int) -> float:
    """Megatron's cosine schedule with linear warm-up, in samples, before iteration ``iteration`` (0-based)."""
    n, warm, decay = iteration * GBS, WARMUP * GBS, ITERS * GBS
    if n <= warm:
        return LR * n / warm
    return MIN_LR + 0.5 * (math.cos(math.pi * (n - warm) / (decay - warm)) + 1) * (LR - MIN_LR)


def hf_adamw_losses(hf, samples) -> list[float]:
    """Each iteration's loss (the mean token cross entropy of each micro-batch, averaged over the micro-batches)
    of ``hf`` trained on ``samples`` in order, ``GBS`` per iteration."""
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    losses, n = [], GBS // MBS
    for it in range(ITERS):
        batch = samples[it * GBS:(it + 1) * GBS]
        opt.zero_grad()
        loss = 0.0
        for m in range(n):
            mb = collate(batch[m * MBS:(m + 1) * MBS])
            logits = hf(input_ids=mb["tokens"].long()).logits
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 mb["labels"].long().reshape(-1))
            (ce / n).backward()
            loss += ce.item() / n
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        opt.step()
    return losses


def corpus(root, tokenizer_flags: list[str] | None = None, lines: int = 400) -> str:
    """The first ``lines`` documents of the bundled corpus tokenized under ``root`` (default: GPT-2 BPE; else the
    given ``--tokenizer-type ...`` flags); the data prefix."""
    from megatronish.tools import preprocess_data

    with open(os.path.join(ROOT, "examples", "corpus", "python_docs.jsonl")) as src:
        (root / "c.jsonl").write_text("".join(next(src) for _ in range(lines)))
    if tokenizer_flags is None:
        vocab, merges = gpt2_files()
        tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    preprocess_data.main(["--input", str(root / "c.jsonl"), "--output-prefix", str(root / "c"), *tokenizer_flags,
                          "--append-eod", "--workers", "1"])
    return str(root / "c_text_document")


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout: e4m3 values and one inverse scale per ``block`` x ``block`` tile (max |w| -> 448)."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.size(0)):
        for j in range(scale.size(1)):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_directory(path: str, block: int) -> dict[str, torch.Tensor]:
    """Rewrite the safetensors files of the HF directory ``path`` as DeepSeek-V3's published ones: every linear
    weight (``*proj.weight``) e4m3 with its ``weight_scale_inv`` (``block`` x ``block`` tiles, in config.json's
    ``quantization_config``). Returns the dequantized values (bfloat16 as in DeepSeek's converter, then float32)
    of the weights quantized, by name: the model the files now hold."""
    import json

    from safetensors.torch import load_file, save_file

    from megatronish.convert.hf_deepseek import dequantize_fp8

    values = {}
    for f in sorted(os.listdir(path)):
        if not f.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(path, f))
        out = {}
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith("proj.weight"):
                q, s = quantize_fp8(t, block)
                out[name], out[name + "_scale_inv"] = q, s
                values[name] = dequantize_fp8(q, s, (block, block)).float()
            else:
                out[name] = t
        save_file(out, os.path.join(path, f), metadata={"format": "pt"})
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            index = json.load(open(index_path))
            index["weight_map"].update({n: f for n in out})
            index["metadata"]["total_size"] += sum(out[n].numel() * out[n].element_size() for n in out) - \
                sum(t.numel() * t.element_size() for t in tensors.values())
            json.dump(index, open(index_path, "w"), indent=2)
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    json.dump(config, open(os.path.join(path, "config.json"), "w"), indent=2)
    return values
