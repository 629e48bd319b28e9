"""Generation with multi-latent attention from the latent cache, in one process: greedy continuations of a random
DeepSeek-V3-like model (with and without the query latent, YaRN) are token-identical to transformers'
``DeepseekV3ForCausalLM.generate`` for the same weights, with the log-probs within 1e-5, both with the cached
latents up-projected at each step and with ``--cache-mla-latents``' weight absorption; the logits of every
decoding step (a prefill, a chunk of several tokens, then one token at a time) in both ways equal the full
forward without a cache (fp32, rtol 1e-5), and with absorption no step calls the key/value up-projection; the
cache holds ``kv_lora_rank + qk_pos_emb_head_dim`` values per token and layer, and ``InferenceParams.nbytes()``
reports exactly its tensors."""
import pytest
import torch

from megatronish.convert import model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.inference import Generator, InferenceParams, SamplingParams
from tests.unit.test_convert_deepseek import DS, V
from tests.unit.test_generation import PROMPTS, _ours, hf_reference

NEW, S = 8, 16
VARIANTS = {  # tiny_hf_model's DeepSeek-V3: q latent, YaRN, a dense layer then MoE; and a full-rank query
    "q_lora_yarn_moe": {},
    "full_q_yarn_dense": dict(q_lora_rank=None, first_k_dense_replace=4),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    hf = tiny_hf_model(DS, vocab=V, **VARIANTS[request.param])
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    return request.param, hf, _ours(hf)


def test_greedy_tokens_match_transformers(models):
    name, hf, model = models
    ref, ref_lp = hf_reference(hf, PROMPTS, NEW)
    for absorb in (False, True):
        out = Generator(model, max_batch=4, cache_mla_latents=absorb).generate(
            PROMPTS, NEW, SamplingParams(top_k=1), return_logprobs=True)
        assert out.tokens == ref, (name, absorb)
        for i in range(len(PROMPTS)):
            torch.testing.assert_close(torch.tensor(out.logprobs[i]), ref_lp[i], rtol=0, atol=1e-5)


def test_decoding_logits_equal_the_full_forward(models):
    name, _, model = models
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(5))
    up_calls = []  # the key/value up-projection's calls: per-head keys and values made
    hooks = [layer.self_attention.linear_kv_up_proj.register_forward_hook(lambda *_: up_calls.append(1))
             for layer in model.decoder.layers]
    chunks = [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, S)]  # a prefill, a chunk, then one token a step
    with torch.no_grad():
        full = model(ids)  # no cache: [b, S, V_padded]
        for absorb in (False, True):
            cache = InferenceParams.for_model(model, max_batch=2, max_sequence=S, cache_mla_latents=absorb)
            steps, up_calls[:] = [], []
            for start, end in chunks:
                steps.append(model(ids[:, start:end], inference_params=cache))
                cache.advance(end - start)
            torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} absorb={absorb}: {m}")
            assert len(up_calls) == (0 if absorb else len(chunks) * len(hooks)), (absorb, len(up_calls))
    for h in hooks:
        h.remove()


def test_cache_holds_the_latent_and_the_rope_key_only(models):
    _, hf, model = models
    a = model_config_from_hf(hf.config.to_dict())[0].attention
    per_token = a.kv_lora_rank + a.qk_pos_emb_head_dim  # 20 + 8 (the per-head keys and values: 8 x (20 + 10))
    batch, numbers = 3, [layer.layer_number for layer in model.decoder.layers]
    layers = len(numbers)
    cache = InferenceParams.for_model(model, max_batch=batch, max_sequence=S)
    tensors = [t for n in numbers for t in cache.layer_cache(n).entries]
    assert sum(t.numel() for t in tensors) == layers * batch * S * per_token
    assert [tuple(t.shape) for t in cache.layer_cache(numbers[0]).entries] == [(batch, S, per_token)]
    assert cache.nbytes() == sum(t.nbytes for t in tensors) == layers * batch * S * per_token * 4  # fp32
    with pytest.raises(ValueError, match="multi-latent-attention"):
        InferenceParams.for_model(_ours(tiny_hf_model("LlamaForCausalLM", vocab=V)), max_batch=1, max_sequence=4,
                                  cache_mla_latents=True)
