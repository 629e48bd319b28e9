"""The tokenizer types, and the one table of Megatron flags we parse but whose feature is not available yet
(a non-default value is one error line; enabling a feature later means deleting its entry)."""
from __future__ import annotations

from dataclasses import dataclass

# Megatron-LM's --tokenizer-type choices, and the ones megatronish.data.tokenizers implements.
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")
SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                             "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")
_TOKENIZER_MODEL_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                          "Llama2Tokenizer", "TikTokenizer")


# ---------------------------------------------------------------------------------------------------------------
# The one table of Megatron flags we parse but whose feature is not available yet.
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NotYet:
    """``flag``'s values outside ``allowed`` name a feature that is not available yet; ``fix`` says what to do."""

    flag: str
    allowed: tuple
    feature: str
    fix: str

    def message(self, value) -> str:
        shown = self.flag if isinstance(value, bool) else f"{self.flag} {_show(value)}"
        return f"{shown}: {self.feature} is not available yet in this version; {self.fix}"


def _show(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


_DROP = "drop the flag"
NOT_YET_SUPPORTED: dict[str, NotYet] = {
    nt.flag.lstrip("-").replace("-", "_") if dest is None else dest: nt
    for dest, nt in [
        # parallelism
        (None, NotYet("--tp-comm-overlap", (False,), "tensor-parallel communication overlap", _DROP)),
        (None, NotYet("--use-megatron-fsdp", (False,), "Megatron FSDP", _DROP)),
        # mixture of experts (the features of docs/moe.md are built; these are not)
        (None, NotYet("--moe-token-dispatcher-type", ("allgather", "alltoall"), "the flex (DeepEP/HybridEP) "
                      "token dispatcher", "use --moe-token-dispatcher-type alltoall or allgather")),
        (None, NotYet("--moe-enable-deepep", (False,), "the DeepEP dispatcher", _DROP)),
        (None, NotYet("--moe-flex-dispatcher-backend", (None,), "the flex dispatcher", _DROP)),
        (None, NotYet("--moe-permute-fusion", (False,), "Transformer Engine's fused token permutation", _DROP)),
        (None, NotYet("--moe-router-fusion", (False,), "Transformer Engine's fused router", _DROP)),
        (None, NotYet("--moe-shared-expert-overlap", (False,), "overlapping shared experts with dispatch", _DROP)),
        (None, NotYet("--moe-use-upcycling", (False,), "dense-to-MoE upcycling", _DROP)),
        (None, NotYet("--moe-input-jitter-eps", (None,), "router input jitter", _DROP)),
        (None, NotYet("--moe-use-legacy-grouped-gemm", (False,), "the legacy grouped GEMM",
                      "drop the flag (--moe-grouped-gemm uses torch's grouped GEMM)")),
        (None, NotYet("--moe-router-force-load-balancing", (False,), "forced (random) routing", _DROP)),
        (None, NotYet("--moe-apply-probs-on-input", (False,), "applying router probs to the expert input", _DROP)),
        (None, NotYet("--moe-router-padding-for-fp8", (False,), "router padding for FP8", _DROP)),
        (None, NotYet("--moe-router-padding-for-quantization", (False,), "router padding for quantization",
                      _DROP)),
        (None, NotYet("--moe-latent-size", (None,), "MoE latent projections", _DROP)),
        (None, NotYet("--moe-extended-tp", (False,), "extended expert tensor parallelism",
                      "use --expert-tensor-parallel-size")),
        (None, NotYet("--mla-down-proj-fusion", (False,), "the fused MLA down-projection", _DROP)),
        # batch
        (None, NotYet("--step-batch-size-schedule", (None,), "the step batch-size schedule (Megatron-LM after "
                      "core 0.17)", "use --rampup-batch-size START INCREMENT SAMPLES")),
        # precision
        (None, NotYet("--fp8-recipe", ("delayed", "tensorwise"), "this FP8 recipe",
                      "use --fp8-recipe delayed or tensorwise")),
        (None, NotYet("--fp8-interval", (1,), "an FP8 amax update interval other than every step", _DROP)),
        # checkpoints
        (None, NotYet("--ckpt-format", ("torch_dist",), "this checkpoint format",
                      "use --ckpt-format torch_dist (the default: torch.distributed.checkpoint, loads into any "
                      "parallel layout)")),
        # model features
        (None, NotYet("--position-embedding-type", ("learned_absolute", "rope", "yarn", "none"),
                      "this position embedding type", "use learned_absolute, rope, yarn or none")),
        (None, NotYet("--squared-relu", (False,), "squared ReLU", _DROP)),
        (None, NotYet("--use-flash-attn", (False,), "flash attention", _DROP)),
        # data
        (None, NotYet("--tokenizer-type", (None,) + SUPPORTED_TOKENIZER_TYPES, "this tokenizer",
                      "choose one of " + ", ".join(SUPPORTED_TOKENIZER_TYPES))),
    ]
}
