"""Dataclass configs. Field names follow Megatron-LM's flags (``--hidden-size`` -> ``hidden_size``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .parallel.dims import ConfigError


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padding: round up to a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class ModelConfig:
    """The GPT model's shape. GPT-2 and Llama are two settings of these fields (see ``gpt2``/``llama``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # true tokenizer vocabulary; the embedding is padded past it
    seq_length: int = 1024
    ffn_hidden_size: int | None = None  # default 4h, or Megatron's SwiGLU default int(8h/3 / 64) * 64
    kv_channels: int | None = None  # default h / heads
    num_query_groups: int | None = None  # default heads (no GQA)
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # or "rope" / "none"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # activation recompute (Megatron's flags)
    recompute_granularity: str | None = None  # "full" (selective comes later)
    recompute_method: str | None = None  # "uniform" | "block"
    recompute_num_layers: int | None = None

    def __post_init__(self):
        h = self.hidden_size
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h
        if self.kv_channels is None:
            if h % self.num_attention_heads:
                raise ConfigError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                                  f"{self.num_attention_heads}; set --kv-channels or change one of them")
            self.kv_channels = h // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--num-query-groups {self.num_query_groups}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ConfigError(f"--position-embedding-type {self.position_embedding_type!r}: choose "
                              "learned_absolute, rope or none")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization {self.normalization!r}: choose LayerNorm or RMSNorm")
        if self.recompute_granularity not in (None, "full"):
            raise ConfigError(f"--recompute-granularity {self.recompute_granularity!r} is not supported yet; "
                              "use full")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
            if not self.recompute_num_layers or self.recompute_num_layers < 1:
                raise ConfigError("--recompute-granularity full needs --recompute-num-layers >= 1")

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def padded_vocab_size(self, tp: int = 1) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def gpt2(**kw) -> ModelConfig:
    """GPT-2 flavor: LayerNorm, learned absolute positions, GELU, biases, tied embeddings."""
    return ModelConfig(**kw)


def llama(**kw) -> ModelConfig:
    """Llama flavor: RMSNorm, RoPE, SwiGLU, no biases, untied output layer (GQA via num_query_groups)."""
    base = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True)
    base.update(kw)
    return ModelConfig(**base)
