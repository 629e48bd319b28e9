"""Tiny randomly initialized Hugging Face models (built with ``transformers``), for tests and examples."""
from __future__ import annotations

import torch


def tiny_hf_model(arch: str, *, vocab: int = 100, seed: int = 0, tied: bool | None = None, **over):
    """A small fp32 ``GPT2LMHeadModel`` (tanh GELU) or ``LlamaForCausalLM`` (GQA: 8 heads, 4 key/value heads)
    with random weights (biases, norms and the embedding included), dropout off, SDPA attention."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    if arch == "GPT2LMHeadModel":
        kw = dict(n_layer=4, n_embd=64, n_head=8, n_positions=32, vocab_size=vocab, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True if tied is None else tied)
        kw.update(over)
        cfg, cls = GPT2Config(**kw), GPT2LMHeadModel
    else:
        kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=32, rms_norm_eps=1e-5,
                  tie_word_embeddings=False if tied is None else tied, rope_theta=10000.0, attention_dropout=0.0)
        kw.update(over)
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: make every tensor informative
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "ln" in name or "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
