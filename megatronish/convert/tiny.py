"""Tiny randomly initialized Hugging Face models (built with ``transformers``), for tests and examples."""
from __future__ import annotations

import torch

# Llama-family sizes shared by the dense and the mixture-of-experts models (GQA: 8 heads, 4 key/value heads).
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                   attention_dropout=0.0)
# What sets each family apart (the rest is _LLAMA_LIKE): Qwen3's head_dim differs from hidden/heads (64/8);
# Mistral attends over the whole sequence (no sliding window); Qwen2 has q/k/v biases by construction.
# MoE: four experts, two per token; Qwen's experts are narrower than its dense MLPs (moe_intermediate_size).
_FAMILY = {
    "MistralForCausalLM": dict(sliding_window=None),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=40, norm_topk_prob=False),
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                norm_topk_prob=True),
}


def tiny_hf_model(arch: str, *, vocab: int = 100, seed: int = 0, tied: bool | None = None, **over):
    """A small fp32 ``GPT2LMHeadModel`` (tanh GELU), dense Llama-flavored model (``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with q/k/v biases, ``Qwen3ForCausalLM`` with q/k norms and
    ``head_dim`` 16) or mixture of experts (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
    ``Qwen3MoeForCausalLM``: 4 experts, top-2) with random weights (biases, norms and the embedding included),
    dropout off, SDPA attention."""
    import transformers

    transformers.logging.set_verbosity_error()
    if arch == "GPT2LMHeadModel":
        kw = dict(n_layer=4, n_embd=64, n_head=8, n_positions=32, vocab_size=vocab, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True if tied is None else tied)
        config_cls, cls = transformers.GPT2Config, transformers.GPT2LMHeadModel
    else:
        kw = dict(_LLAMA_LIKE, vocab_size=vocab, tie_word_embeddings=False if tied is None else tied,
                  **_FAMILY.get(arch, {}))
        name = arch.removesuffix("ForCausalLM")
        config_cls, cls = getattr(transformers, f"{name}Config"), getattr(transformers, arch)
    kw.update(over)
    cfg = config_cls(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: make every tensor informative
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "ln" in name or "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):  # routers: decisive scores (no near-ties in the top-k)
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()
