"""Model FLOPs per iteration (Megatron's formula, GQA and SwiGLU aware) and dense device peaks."""
from __future__ import annotations

from ..model.moe.layer import is_moe_layer


def num_floating_point_operations(cfg, batch_size: int) -> float:
    """Forward + backward FLOPs for ``batch_size`` sequences, without recomputation (Megatron-LM's
    ``num_floating_point_operations``):
    ``12 B s h^2 [ L (1 + g/a + s/h) (q/h) + (L_dense ffn + L_moe (k F + F_shared)) / h * (3/2 if SwiGLU)
    + V / (2h) ]`` where ``q`` is the query projection size ``a * kv_channels``, ``g`` the number of query groups,
    ``L_moe`` the MoE layers (``--moe-layer-freq``), ``k`` ``--moe-router-topk``, ``F`` the expert FFN size and
    ``F_shared`` ``--moe-shared-expert-intermediate-size``: an MoE layer counts the ``k`` experts each token
    runs, not all of them. As in Megatron-LM the router's ``[h, E]`` GEMM (``6 h E`` per token, small next to
    the experts') is not counted.

    With ``--multi-latent-attention`` the attention term per layer and token is Megatron-LM's MLA branch:
    ``6 [q + r_kv (h + a (d_nope + d_v) + 1) + h d_rope + a d_v h + a (d_nope + d_rope + d_v) s / 2]``, ``q`` being
    ``h a (d_nope + d_rope)`` (full-rank query) or ``r_q (h + a (d_nope + d_rope) + 1)`` (the ``+ 1`` terms are
    the latents' norms), the core attention halved for the causal mask.

    With ``--mtp-num-layers D`` (Megatron-LM's ``mtp_num_layers`` terms) each depth adds a transformer layer (MoE
    when the decoder's last layer is, as the depth's is built), its ``eh_proj`` (``2h -> h``) and norms
    (``enorm``, ``hnorm``, ``final_layernorm``: ``6 (2h^2 + 3h)`` per token) and its logits through the shared
    output layer (``(1 + D) V / (2h)`` in the bracket)."""
    h, s, L = cfg.hidden_size, cfg.seq_length, cfg.num_layers
    D = cfg.mtp_num_layers or 0
    a, g = cfg.num_attention_heads, cfg.num_query_groups
    q = a * cfg.kv_channels
    attention = 12.0 * h * h * (1 + g / a + s / h) * (q / h)  # per layer and token
    if cfg.attention.multi_latent_attention:
        attention = _mla_flops_per_token(cfg)
    gated = 1.5 if cfg.swiglu else 1.0
    V = cfg.padded_vocab_size(1)
    n_moe = sum(is_moe_layer(cfg, i) for i in range(L))
    if D and is_moe_layer(cfg, L - 1):  # the depths' layers are MoE layers
        n_moe += D
    mlp = (L + D - n_moe) * cfg.ffn_hidden_size
    if n_moe:
        moe = cfg.moe
        mlp += n_moe * (moe.moe_router_topk * moe.moe_ffn_hidden_size + (moe.moe_shared_expert_intermediate_size or 0))
    mtp = 6.0 * D * (2 * h * h + 3 * h)  # the depths' eh_proj and norms, per token
    return batch_size * s * ((L + D) * attention + 12.0 * h * h * (mlp / h * gated + (1 + D) * V / (2.0 * h)) + mtp)


def _mla_flops_per_token(cfg) -> float:
    """Forward + backward FLOPs of one multi-latent attention layer per token (Megatron-LM's MLA terms)."""
    m, h, a, s = cfg.attention, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    q = h * a * q_head if m.q_lora_rank is None else m.q_lora_rank * (h + a * q_head + 1)
    kv = m.kv_lora_rank * (h + a * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
    core = a * (q_head + m.v_head_dim) * s / 2
    return 6.0 * (q + kv + a * m.v_head_dim * h + core)


# Dense (no sparsity) peak TFLOP/s by device-name substring, for MFU: bf16/fp16 tensor cores.
DENSE_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0,
                     "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}


def device_peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, peak in DENSE_PEAK_TFLOPS.items():
        if key in device_name:
            return peak
    return None
