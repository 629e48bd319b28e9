"""Model FLOPs per iteration (Megatron's formula, GQA and SwiGLU aware) and dense device peaks."""
from __future__ import annotations


def num_floating_point_operations(cfg, batch_size: int) -> float:
    """Forward + backward FLOPs for ``batch_size`` sequences, without recomputation:
    ``12 B s L h^2 [ (1 + g/a + s/h) * (q/h) + (ffn/h) * (3/2 if SwiGLU) + V / (2 L h) ]`` where ``q`` is the
    query projection size ``a * kv_channels`` and ``g`` the number of query groups."""
    h, s, L = cfg.hidden_size, cfg.seq_length, cfg.num_layers
    a, g = cfg.num_attention_heads, cfg.num_query_groups
    q = a * cfg.kv_channels
    gated = 1.5 if cfg.swiglu else 1.0
    V = cfg.padded_vocab_size(1)
    return 12.0 * batch_size * s * L * h * h * ((1 + g / a + s / h) * (q / h) + (cfg.ffn_hidden_size / h) * gated
                                                 + V / (2.0 * L * h))


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
