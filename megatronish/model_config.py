"""The GPT model's config, grouped: the shape on :class:`ModelConfig` itself, and one frozen group each for
attention, mixture of experts, precision (FP8 and the layer implementation), fused kernels and activation
recompute. Every field keeps the name of its Megatron-LM flag (``--moe-router-topk`` -> ``moe.moe_router_topk``),
so the flag -> field mapping stays one to one (:data:`GROUPS` says which group holds a flag's field).

Configs are frozen: derived copies come from :meth:`ModelConfig.replace`. Checkpoints store the flat mapping
(:meth:`ModelConfig.flat`, Megatron's names) and :meth:`ModelConfig.from_flat` reads it back."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass, field

from .errors import ConfigError

# --attention-backend choices (Megatron's AttnBackend)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padding: round up to a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def default_ffn_hidden_size(hidden_size: int, swiglu: bool = False) -> int:
    """``--ffn-hidden-size`` when not given: 4h, or Megatron's SwiGLU default ``int(8h/3 / 64) * 64``."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclass(frozen=True)
class AttentionConfig:
    """Attention beyond the head counts: positions, per-head norms, the QKV bias, dropout, the backend and the
    context-parallel communication."""

    position_embedding_type: str = "learned_absolute"  # or "rope" / "none"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    qk_layernorm: bool = False  # --qk-layernorm: norm of each query/key head before RoPE (Qwen3)
    add_qkv_bias: bool = False
    attention_dropout: float = 0.1
    attention_backend: str = "auto"  # --attention-backend: auto | flash | fused | unfused | local
    cp_comm_type: str | list = "p2p"  # --cp-comm-type: p2p | a2a | allgather | a2a+p2p, or one per layer
    # Multi-latent attention (DeepSeek-V2/V3; model/mla.py, docs/deepseek.md). Megatron's flags and defaults.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: a full-rank query projection
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # the query/key head's part without position embedding
    qk_pos_emb_head_dim: int = 64  # the decoupled RoPE part (one key head shared by all heads)
    v_head_dim: int = 128
    # YaRN RoPE scaling: --position-embedding-type yarn, or --rope-type yarn (MLA's default) with MLA
    rope_type: str | None = None  # --rope-type: rope | yarn; None: yarn with MLA, rope otherwise
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int | None = None  # None: 4096 (Megatron's default)
    yarn_beta_fast: float | None = None  # None: 32
    yarn_beta_slow: float | None = None  # None: 1
    yarn_correction_range_round_to_int: bool | None = None  # None: True

    @property
    def yarn(self) -> bool:
        """Whether the rotary tables are YaRN's: ``--position-embedding-type yarn``, or MLA with ``--rope-type``
        yarn or unset (Megatron's MLA default)."""
        if self.multi_latent_attention:
            return self.rope_type in (None, "yarn")
        return self.position_embedding_type == "yarn"

    @property
    def rotary(self) -> bool:
        """Whether attention rotates queries and keys (MLA always does, on its decoupled RoPE part)."""
        return self.multi_latent_attention or self.position_embedding_type in ("rope", "yarn")

    @property
    def cp_comm_types(self) -> list[str]:
        """``--cp-comm-type`` as a list: one type for every layer, or one per layer."""
        return [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type)

    def cp_comm_type_of(self, layer_number: int) -> str:
        types = self.cp_comm_types
        return types[layer_number] if len(types) > 1 else types[0]

    def problems(self) -> list[str]:
        out = []
        if self.position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            out.append(f"--position-embedding-type {self.position_embedding_type!r}: choose "
                       "learned_absolute, rope, yarn or none")
        if self.rope_type not in (None, "rope", "yarn"):
            out.append(f"--rope-type {self.rope_type!r}: choose rope or yarn")
        elif self.rope_type == "yarn" and not self.multi_latent_attention:
            out.append("--rope-type yarn applies to --multi-latent-attention; for other attention use "
                       "--position-embedding-type yarn")
        if self.yarn and not self.rotary_scaling_factor > 0:
            out.append(f"--rotary-scaling-factor must be > 0, got {self.rotary_scaling_factor}")
        if self.multi_latent_attention:
            dims = {"--kv-lora-rank": self.kv_lora_rank, "--qk-head-dim": self.qk_head_dim,
                    "--qk-pos-emb-head-dim": self.qk_pos_emb_head_dim, "--v-head-dim": self.v_head_dim}
            if self.q_lora_rank is not None:
                dims["--q-lora-rank"] = self.q_lora_rank
            out += [f"{name} must be >= 1 with --multi-latent-attention, got {v}" for name, v in dims.items() if v < 1]
            if self.qk_pos_emb_head_dim % 2:
                out.append(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
            if self.add_qkv_bias:
                out.append("--add-qkv-bias: multi-latent attention's projections have no biases; drop the flag")
        if self.attention_backend not in ATTENTION_BACKENDS:
            out.append(f"--attention-backend {self.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        return out


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (Megatron's flags and defaults; docs/moe.md). ``num_experts`` None: dense MLPs."""

    num_experts: int | None = None
    moe_layer_freq: int | list = 1  # every N-th layer is MoE, or a 1/0 pattern per layer
    moe_ffn_hidden_size: int | None = None  # default --ffn-hidden-size (filled by ModelConfig)
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_load_balancing_type: str | list = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float | list = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: str | None = None  # None (the activations') | fp32 | fp64
    moe_expert_capacity_factor: float | None = None  # None: no token dropping
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False

    def problems(self, num_layers: int, add_bias_linear: bool) -> list[str]:
        """The mixture-of-experts flags' own problems (their fit to the layout is ``validate``'s)."""
        if self.num_experts is None:
            return []
        out = []
        e, k = self.num_experts, self.moe_router_topk
        if e < 1:
            return [f"--num-experts must be >= 1, got {e}"]
        if not 1 <= k <= e:
            out.append(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            out.append(f"--moe-router-score-function {self.moe_router_score_function!r}: choose softmax or sigmoid")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            out.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (aux-loss-free "
                       "balancing biases sigmoid scores)")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            out.append("--moe-router-pre-softmax applies to --moe-router-score-function softmax only")
        out += self._group_problems(e, k)
        out += self._balancing_problems()
        cf = self.moe_expert_capacity_factor
        if cf is not None and not cf > 0:
            out.append(f"--moe-expert-capacity-factor must be > 0, got {cf} (omit the flag for no token dropping)")
        if self.moe_pad_expert_input_to_capacity and cf is None:
            out.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_token_drop_policy not in ("probs", "position"):
            out.append(f"--moe-token-drop-policy {self.moe_token_drop_policy!r}: choose probs or position")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            out.append(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: choose allgather or "
                       "alltoall (the flex/DeepEP dispatcher is not available in this version)")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            out.append(f"--moe-router-dtype {self.moe_router_dtype!r}: choose fp32 or fp64")
        if add_bias_linear:
            out.append("--num-experts: expert linear layers have no biases in this version; pass "
                       "--disable-bias-linear")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                out.append(f"--moe-layer-freq must be >= 1, got {freq}")
        elif len(freq) != num_layers or any(v not in (0, 1) for v in freq):
            out.append(f"--moe-layer-freq pattern must hold one 0 or 1 per layer ({num_layers}), got "
                       f"{len(freq)} values")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size < 1:
            out.append("--moe-shared-expert-intermediate-size must be >= 1")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            out.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        return out

    def _group_problems(self, e: int, k: int) -> list[str]:
        if not self.moe_router_group_topk:
            return []
        g = self.moe_router_num_groups
        if not g:
            return ["--moe-router-group-topk needs --moe-router-num-groups"]
        if e % g:
            return [f"--num-experts {e} is not divisible by --moe-router-num-groups {g}"]
        if self.moe_router_group_topk > g:
            return [f"--moe-router-group-topk {self.moe_router_group_topk} exceeds --moe-router-num-groups {g}"]
        if k % self.moe_router_group_topk:
            return [f"--moe-router-topk {k} is not divisible by --moe-router-group-topk {self.moe_router_group_topk}"]
        return []

    def _balancing_problems(self) -> list[str]:
        types = self.moe_router_load_balancing_type
        types = [types] if isinstance(types, str) else list(types)
        out = [f"--moe-router-load-balancing-type {t!r}: choose aux_loss, seq_aux_loss, global_aux_loss or none "
               "(Sinkhorn balancing is not available in this version)"
               for t in types if t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")]
        coeffs = self.moe_aux_loss_coeff
        if not isinstance(coeffs, (int, float)) and len(coeffs) != len(types):
            out.append(f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(types)} load-balancing types; "
                       "give one per type")
        return out


@dataclass(frozen=True)
class PrecisionConfig:
    """FP8 (Megatron's flags; ``megatronish.precision.fp8.Fp8Recipe.from_config`` reads them) and the layers'
    implementation. The parameters' dtype (``--bf16``/``--fp16``) is the optimizer config's."""

    fp8: str | None = None  # --fp8-format: None (off) | "e4m3" | "hybrid"
    fp8_recipe: str = "delayed"  # "delayed" | "tensorwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # "most_recent" | "max"
    transformer_impl: str = "local"  # "local" | "transformer_engine"


@dataclass(frozen=True)
class KernelConfig:
    """Fused kernels (megatronish.kernels, docs/kernels.md)."""

    use_triton_kernels: bool = False  # --use-triton-kernels: RMSNorm/LayerNorm, RoPE, SwiGLU
    cross_entropy_loss_fusion: bool = False  # --cross-entropy-loss-fusion: the vocab-parallel loss
    cross_entropy_fusion_impl: str = "native"  # with --cross-entropy-loss-fusion: native (PyTorch) | te (Triton)

    def problems(self) -> list[str]:
        if self.cross_entropy_fusion_impl not in ("native", "te"):
            return [f"--cross-entropy-fusion-impl {self.cross_entropy_fusion_impl!r}: choose native or te"]
        return []


# --recompute-modules, as Megatron-LM's TransformerConfig lists them: what selective recompute runs again in backward
# (core attention; MLA's up-projections and RoPE; the dense MLP; the two norms; the experts' activation; the shared
# experts; the whole MoE layer). Megatron-LM's modules of features megatronish lacks are refused by name.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
MEGATRON_ONLY_RECOMPUTE_MODULES = {"gdn_norm_out": "the gated delta net attention variant",
                                   "gdp_in_proj": "the gated delta product attention variant",
                                   "gdp_qkv": "the gated delta product attention variant",
                                   "mhc": "hyper-connections"}


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron's flags)."""

    recompute_granularity: str | None = None  # "full" | "selective" (the modules of recompute_modules)
    recompute_method: str | None = None  # "uniform" | "block"
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None  # --recompute-modules (None: core_attn)

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (a name of ``RECOMPUTE_MODULES``)."""
        if self.recompute_granularity != "selective":
            return False
        return module in (("core_attn",) if self.recompute_modules is None else self.recompute_modules)

    def problems(self) -> list[str]:
        g, method = self.recompute_granularity, self.recompute_method
        if g not in (None, "full", "selective"):
            return [f"--recompute-granularity {g!r}: choose full or selective"]
        if self.recompute_modules is not None:
            if g != "selective":
                return ["--recompute-modules needs --recompute-granularity selective; add it or drop "
                        "--recompute-modules"]
            for name in self.recompute_modules:
                if name in MEGATRON_ONLY_RECOMPUTE_MODULES:
                    feature = MEGATRON_ONLY_RECOMPUTE_MODULES[name]
                    return [f"--recompute-modules {name}: recomputes a part of {feature}, which megatronish does "
                            "not have; drop it"]
                if name not in RECOMPUTE_MODULES:
                    return [f"--recompute-modules {name!r}: choose from {' '.join(RECOMPUTE_MODULES)}"]
        if g == "selective" and method is not None:
            return ["--recompute-method is not supported with --recompute-granularity selective "
                    "(it recomputes its modules in every layer); drop --recompute-method"]
        if g == "full":
            if method not in ("uniform", "block"):
                return ["--recompute-granularity full needs --recompute-method uniform or block"]
            if not self.recompute_num_layers or self.recompute_num_layers < 1:
                return ["--recompute-granularity full needs --recompute-num-layers >= 1"]
        return []


# The groups of ModelConfig: attribute name -> its class. A flag's field is ``ModelConfig.<group>.<field>`` when
# the group's class has it, else ``ModelConfig.<field>``.
GROUPS: dict[str, type] = {"attention": AttentionConfig, "moe": MoEConfig, "precision": PrecisionConfig,
                           "kernels": KernelConfig, "recompute": RecomputeConfig}
GROUP_OF: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class ModelConfig:
    """The GPT model's shape, and its groups (attention, moe, precision, kernels, recompute). GPT-2 and Llama are
    two settings of these fields (see ``gpt2``/``llama``). Build one from Megatron's flat field names with
    :meth:`from_flat`; the defaults below that depend on others are filled on construction."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # true tokenizer vocabulary; the embedding is padded past it
    seq_length: int = 1024
    ffn_hidden_size: int | None = None  # default 4h, or Megatron's SwiGLU default int(8h/3 / 64) * 64
    kv_channels: int | None = None  # default h / heads
    num_query_groups: int | None = None  # default heads (no GQA)
    max_position_embeddings: int | None = None  # default seq_length
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False  # zero-centered norm weights: the norm multiplies by (1 + weight)
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # Multi-token prediction (DeepSeek-V3; model/mtp.py, docs/deepseek.md): depths after the decoder, on the last
    # pipeline stage, and the weight of their mean loss. Megatron's flags and defaults.
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)

    # False: fill the defaults only, and leave every problem to problems() (argument validation lists them all)
    check: InitVar[bool] = True

    def __post_init__(self, check: bool = True):
        h, heads = self.hidden_size, self.num_attention_heads
        fill = {}
        if self.ffn_hidden_size is None:
            fill["ffn_hidden_size"] = default_ffn_hidden_size(h, self.swiglu)
        if self.kv_channels is None and heads > 0 and h % heads == 0:
            fill["kv_channels"] = h // heads  # else left None: problems() names the flags
        if self.num_query_groups is None:
            fill["num_query_groups"] = heads
        if self.max_position_embeddings is None:
            fill["max_position_embeddings"] = self.seq_length
        if self.moe.num_experts and self.moe.moe_ffn_hidden_size is None:
            fill["moe"] = dataclasses.replace(self.moe, moe_ffn_hidden_size=fill.get("ffn_hidden_size",
                                                                                     self.ffn_hidden_size))
        for name, value in fill.items():  # the construction's own defaults: nothing else assigns to a config
            object.__setattr__(self, name, value)
        if check:
            problems = self.problems()
            if problems:
                raise ConfigError("\n".join(problems))

    def __getattr__(self, name: str):
        group = GROUP_OF.get(name)
        if group is not None:  # a flat Megatron name read from the top: say where it lives
            raise AttributeError(f"ModelConfig.{name} is ModelConfig.{group}.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- Megatron's flat names in and out --------------------------------------------------------------------
    @classmethod
    def from_flat(cls, values: dict | None = None, /, *, check: bool = True, **kw) -> "ModelConfig":
        """A config from Megatron's flat field names (a stored ``"model"`` section, or keywords); a group object
        (``moe=MoEConfig(...)``) is taken as it is. Unknown names raise ``TypeError``."""
        values = {**(values or {}), **kw}
        groups: dict[str, dict] = {g: {} for g in GROUPS}
        top = {}
        for name, value in values.items():
            if name in GROUP_OF:
                groups[GROUP_OF[name]][name] = value
            else:
                top[name] = value
        for g, cls_ in GROUPS.items():
            if g in top:
                if groups[g]:
                    raise TypeError(f"ModelConfig: give {g}= or its fields {sorted(groups[g])}, not both")
            else:
                top[g] = cls_(**groups[g])
        return cls(**top, check=check)

    def flat(self) -> dict:
        """Every field under Megatron's flat name (what checkpoints store as their ``"model"`` section)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in GROUPS:
                out.update(dataclasses.asdict(value))
            else:
                out[f.name] = value
        return out

    @classmethod
    def flat_names(cls) -> set[str]:
        """The flat field names :meth:`from_flat` takes (a stored config's keys beyond these are ignored)."""
        return {f.name for f in dataclasses.fields(cls) if f.name not in GROUPS} | set(GROUP_OF)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with fields changed, by Megatron's flat names (or whole groups); checked like a new one."""
        top = {k: v for k, v in changes.items() if k not in GROUP_OF}
        for g in GROUPS:
            mine = {k: v for k, v in changes.items() if GROUP_OF.get(k) == g}
            if mine:
                top[g] = dataclasses.replace(top.get(g, getattr(self, g)), **mine)
        return dataclasses.replace(self, **top)

    # ---- checks and derived values ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """This model's own problems, one line each (its fit to the parallel layout is
        :func:`megatronish.parallel_config.validate_model`'s)."""
        out = []
        if self.kv_channels is None:
            out.append(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                       f"{self.num_attention_heads}; set --kv-channels or change one of them")
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            out.append(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                       f"--num-query-groups {self.num_query_groups}")
        out += self.attention.problems()
        if self.attention.multi_latent_attention:
            if self.num_query_groups != self.num_attention_heads:
                out.append("--group-query-attention is mutually exclusive with --multi-latent-attention (every "
                           "head has its own key and value); drop --group-query-attention")
            if self.attention.rotary_percent != 1.0:
                out.append("--rotary-percent: multi-latent attention rotates its whole --qk-pos-emb-head-dim part; "
                           "drop the flag")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            out.append(f"--normalization {self.normalization!r}: choose LayerNorm or RMSNorm")
        out += self.recompute.problems()
        out += self._recompute_module_problems()
        out += self.kernels.problems()
        out += self.moe.problems(self.num_layers, self.add_bias_linear)
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            out.append(f"--mtp-num-layers must be >= 1, got {self.mtp_num_layers}")
        if self.mtp_num_layers and self.attention.position_embedding_type == "learned_absolute" \
                and not self.attention.multi_latent_attention:
            out.append("--mtp-num-layers needs rotary positions (--position-embedding-type rope or yarn, or "
                       "--multi-latent-attention); learned absolute positions are not supported with it")
        return out

    def _recompute_module_problems(self) -> list[str]:
        """Megatron-LM's rules for modules that need a feature (``moe``, ``shared_experts`` and ``mlp`` apply
        where their layers exist and are ignored elsewhere, as in Megatron-LM)."""
        r, out = self.recompute, []
        if r.recomputes("mla_up_proj") and not self.attention.multi_latent_attention:
            out.append("--recompute-modules mla_up_proj needs --multi-latent-attention; drop mla_up_proj")
        if r.recomputes("moe_act") and not (self.moe.num_experts and self.moe.moe_grouped_gemm):
            out.append("--recompute-modules moe_act needs --num-experts with --moe-grouped-gemm (as in Megatron-LM); "
                       "add them or drop moe_act")
        delayed = [m for m in ("moe_act", "layernorm") if r.recomputes(m)]
        if self.precision.fp8 and self.precision.fp8_recipe == "delayed" and delayed:
            out.append(f"--recompute-modules {' '.join(delayed)}: not supported with --fp8-recipe delayed (as in "
                       "Megatron-LM); use --fp8-recipe tensorwise or drop them")
        return out

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.attention.add_qkv_bias

    def padded_vocab_size(self, tp: int = 1) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def config_dict(obj):
    """A (nested) dataclass config as plain dicts, a :class:`ModelConfig` under its flat Megatron names."""
    if isinstance(obj, ModelConfig):
        return obj.flat()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def gpt2(**kw) -> ModelConfig:
    """GPT-2 flavor: LayerNorm, learned absolute positions, GELU, biases, tied embeddings (Megatron's flat
    field names as keywords)."""
    return ModelConfig.from_flat(kw)


def llama(**kw) -> ModelConfig:
    """Llama flavor: RMSNorm, RoPE, SwiGLU, no biases, untied output layer (GQA via num_query_groups)."""
    base = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True)
    base.update(kw)
    return ModelConfig.from_flat(base)
