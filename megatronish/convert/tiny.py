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
    # multi-latent attention with a query latent, YaRN, one dense layer, then 8 experts (top-4 of the best 2 of 4
    # groups, sigmoid scores with the expert bias, scaled by 2.5) and two shared experts' width
    "DeepseekV3ForCausalLM": dict(
        num_key_value_heads=8, rms_norm_eps=1e-6, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=16, n_shared_experts=2,
        norm_topk_prob=True, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)),
}


def tiny_hf_model(arch: str, *, vocab: int = 100, seed: int = 0, tied: bool | None = None, **over):
    """A small fp32 ``GPT2LMHeadModel`` (tanh GELU), dense Llama-flavored model (``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with q/k/v biases, ``Qwen3ForCausalLM`` with q/k norms and
    ``head_dim`` 16) or mixture of experts (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
    ``Qwen3MoeForCausalLM``: 4 experts, top-2; ``DeepseekV3ForCausalLM``: multi-latent attention and DeepSeek's
    MoE) with random weights (biases, norms, the embedding and DeepSeek's expert bias included), dropout off, SDPA
    attention."""
    import transformers

    transformers.logging.set_verbosity_error()
    if arch == "GPT2LMHeadModel":
        kw = dict(n_layer=4, n_embd=64, n_head=8, n_positions=32, vocab_size=vocab, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True if tied is None else tied)
        config_cls, cls = transformers.GPT2Config, transformers.GPT2LMHeadModel
    else:
        kw = dict(_LLAMA_LIKE, vocab_size=vocab, tie_word_embeddings=False if tied is None else tied)
        kw.update(_FAMILY.get(arch, {}))
        if arch == "DeepseekV3ForCausalLM":
            kw.pop("rope_theta")  # in rope_parameters
        name = arch.removesuffix("ForCausalLM")
        config_cls, cls = getattr(transformers, f"{name}Config"), getattr(transformers, arch)
    kw.update(over)
    cfg = config_cls(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(cfg)
    _informative(model, seed)
    return model.eval()


def _informative(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: make every tensor informative
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "ln" in name or "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):  # routers: decisive scores (no near-ties in the top-k)
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's expert bias: it changes the choice
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def add_mtp_layers(path: str, depths: int = 1, seed: int = 7) -> dict[str, torch.Tensor]:
    """Append ``depths`` multi-token-prediction layers to the ``DeepseekV3ForCausalLM`` directory ``path`` as
    published files carry them (``model.layers.<num_hidden_layers + k>.``: a random decoder layer of the model's
    kind, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and the copies ``embed_tokens`` /
    ``shared_head.head`` of the model's embedding and output layer), in a file of their own listed in
    ``model.safetensors.index.json``; ``num_nextn_predict_layers`` is set. Returns the tensors added."""
    import json
    import os
    import tempfile

    import transformers
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    bigger = transformers.AutoConfig.for_model(**dict(config, num_hidden_layers=layers + depths))
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(bigger)
    _informative(model, seed)
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        weight_map, total = index["weight_map"], index["metadata"]["total_size"]
    else:
        single = load_file(os.path.join(path, "model.safetensors"))
        weight_map = {k: "model.safetensors" for k in single}
        total = sum(t.numel() * t.element_size() for t in single.values())

    def own(name):
        return load_file(os.path.join(path, weight_map[name]))[name]

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = {k: v for f in os.listdir(tmp) if f.endswith(".safetensors")
                 for k, v in load_file(os.path.join(tmp, f)).items()}
    g = torch.Generator().manual_seed(seed + 2)
    h = config["hidden_size"]
    head = own("lm_head.weight" if "lm_head.weight" in weight_map else "model.embed_tokens.weight")
    added = {}
    for k in range(depths):
        p = f"model.layers.{layers + k}."
        added.update({n: t for n, t in files.items() if n.startswith(p)})
        added.update({f"{p}{n}.weight": 1.0 + 0.1 * torch.randn(h, generator=g)
                      for n in ("enorm", "hnorm", "shared_head.norm")})
        added[f"{p}eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
        added[f"{p}embed_tokens.weight"] = own("model.embed_tokens.weight").clone()
        added[f"{p}shared_head.head.weight"] = head.clone()
    save_file(added, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    weight_map.update({n: "mtp.safetensors" for n in added})
    with open(index_path, "w") as f:
        total += sum(t.numel() * t.element_size() for t in added.values())
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, num_nextn_predict_layers=depths), f, indent=2)
    return added
