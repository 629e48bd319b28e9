"""Checkpoint conversion between Hugging Face (``GPT2LMHeadModel``; the dense ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; the mixtures of experts ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``) and our global tensors / checkpoints.
``tools/checkpoint/convert.py`` is the command line; docs/convert.md the rules."""
from .core import (
           hf_state_dict_to_ours,
           hf_to_ours,
           load_into_model,
           model_global_tensors,
           ours_to_hf,
           ours_to_hf_state_dict,
)
from .hf_config import ConvertError, architecture_of, hf_config_from_model, model_config_from_hf

__all__ = ["ConvertError", "architecture_of", "hf_config_from_model", "hf_state_dict_to_ours", "hf_to_ours",
           "load_into_model", "model_config_from_hf", "model_global_tensors", "ours_to_hf", "ours_to_hf_state_dict"]
