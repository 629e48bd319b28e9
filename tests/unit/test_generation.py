"""Text generation in one process: greedy continuations token-identical to transformers' ``generate`` (with and
without its cache) for a converted random GPT-2 and Llama (GQA), a batch of prompts of different lengths, with
and without our KV cache; log-probs equal to transformers' within 1e-5; sampling, stops, request validation."""
import pytest
import torch

from megatronish.convert import hf_state_dict_to_ours, load_into_model, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.data.tokenizers import NullTokenizer
from megatronish.inference import Generator, SamplingParams, sample
from megatronish.inference.server import RequestError, parse_request
from megatronish.inference.text import TextRequest, generate_text
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext

V = 100
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 2, 3, 4, 5], [42]]
NEW = 10


def _ours(hf, dtype=torch.float32):
    cfg, arch = model_config_from_hf(hf.config.to_dict())
    (model,) = build_model_chunks(cfg, ParallelContext.single(), params_dtype=dtype)
    load_into_model(model, hf_state_dict_to_ours(hf.state_dict(), cfg, arch, tp=1), 0, 1)
    return model.eval()


def hf_reference(hf, prompts, new, use_cache=True):
    """transformers' greedy continuation of each prompt (exactly ``new`` tokens: no end-of-sequence stop) and
    the log-probs of every token after the first."""
    hf.generation_config.eos_token_id = None
    seqs, lps = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              use_cache=use_cache, pad_token_id=0)[0]
            lp = torch.log_softmax(hf(seq[None]).logits[0, :-1].float(), -1).gather(-1, seq[1:, None])[:, 0]
            seqs.append(seq.tolist())
            lps.append(lp)
    return seqs, lps


@pytest.fixture(scope="module", params=["GPT2LMHeadModel", "LlamaForCausalLM"])
def models(request):
    hf = tiny_hf_model(request.param, vocab=V)
    return request.param, hf, _ours(hf)


def test_greedy_and_logprobs_match_transformers(models):
    arch, hf, model = models
    gen = Generator(model, max_batch=4)
    for hf_cache in (True, False):
        ref, ref_lp = hf_reference(hf, PROMPTS, NEW, use_cache=hf_cache)
        for use_cache in (True, False):
            out = gen.generate(PROMPTS, NEW, SamplingParams(top_k=1), return_logprobs=True, use_cache=use_cache)
            assert out.tokens == ref, (arch, hf_cache, use_cache)
            assert out.prompt_lengths == [len(p) for p in PROMPTS]
            for i in range(len(PROMPTS)):
                assert len(out.logprobs[i]) == len(ref[i]) - 1
                torch.testing.assert_close(torch.tensor(out.logprobs[i]), ref_lp[i], rtol=0, atol=1e-5)


def test_batch_equals_one_by_one_and_cache_is_reused(models):
    _, _, model = models
    gen = Generator(model, max_batch=4)
    batch = gen.generate(PROMPTS, NEW)
    for i, p in enumerate(PROMPTS):
        assert gen.generate([p], NEW).tokens[0] == batch.tokens[i]


def test_prompt_logprobs_only_and_stop_token(models):
    _, hf, model = models
    gen = Generator(model, max_batch=4)
    ref, ref_lp = hf_reference(hf, PROMPTS, NEW)
    scored = gen.generate(PROMPTS, 0, return_logprobs=True)
    assert scored.tokens == PROMPTS
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(torch.tensor(scored.logprobs[i]), ref_lp[i][: len(p) - 1], rtol=0, atol=1e-5)
    # a stop token ends each sequence at its first occurrence (kept as the last token); the others go on
    stop = ref[0][len(PROMPTS[0]) + 3]
    out = gen.generate(PROMPTS, NEW, stop_token_ids=[stop])
    cuts = []
    for i in range(len(PROMPTS)):
        gen_i = ref[i][len(PROMPTS[i]):]
        cuts.append(gen_i.index(stop) + 1 if stop in gen_i else NEW)
        assert out.tokens[i] == ref[i][: len(PROMPTS[i]) + cuts[i]]
    assert min(cuts) <= 4


def test_sampling_is_seeded_and_respects_top_k_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    draw = lambda p: sample(logits, p, torch.Generator().manual_seed(p.seed))  # noqa: E731
    p = SamplingParams(temperature=0.7, seed=3)
    assert torch.equal(draw(p), draw(p))
    assert not all(torch.equal(draw(p), draw(SamplingParams(temperature=0.7, seed=s))) for s in range(4, 9))
    assert torch.equal(sample(logits, SamplingParams(top_k=1)), logits.argmax(-1))
    top3 = logits.topk(3, -1).indices
    for s in range(20):
        t = draw(SamplingParams(top_k=3, seed=s))
        assert (top3 == t[:, None]).any(-1).all()
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    for s in range(20):
        t = draw(SamplingParams(top_p=0.5, seed=s))
        for row in range(4):  # the drawn token is within the smallest set reaching 0.5
            rank = (order[row] == t[row]).nonzero().item()
            assert rank == 0 or sorted_p[row, :rank].sum() < 0.5
    with pytest.raises(ValueError, match="top_k and top_p"):
        SamplingParams(top_k=5, top_p=0.5)


def test_sampled_generation_is_reproducible(models):
    _, _, model = models
    gen = Generator(model, max_batch=4)
    a = gen.generate(PROMPTS, NEW, SamplingParams(temperature=1.5, top_k=20, seed=7))
    b = gen.generate(PROMPTS, NEW, SamplingParams(temperature=1.5, top_k=20, seed=7), use_cache=False)
    c = gen.generate(PROMPTS, NEW, SamplingParams(temperature=1.5, top_k=20, seed=8))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_text_response_and_stop_strings(models):
    _, hf, model = models
    tok = NullTokenizer(V - 1)
    ref, _ = hf_reference(hf, PROMPTS[:2], NEW)
    gen = Generator(model, max_batch=4)
    req = TextRequest(prompts=["5 6 7", "10 11 12 13 14 15 16 17 18"], tokens_to_generate=NEW, top_k=1,
                      stop_token=-1, logprobs=True)
    out = generate_text(gen, tok, req)
    assert out["text"] == [" ".join(map(str, r)) for r in ref]
    assert out["segments"][0] == [str(t) for t in ref[0]]
    assert [len(x) for x in out["logprobs"]] == [len(r) - 1 for r in ref]
    # a stop string: the third generated token's text ends the first sequence
    third = str(ref[0][5])
    req.stop_strings = [f" {third}"]  # detokenized generation is "a b c ...": " c" appears once c is out
    out = generate_text(gen, tok, req)
    generated = ref[0][3:]
    cut = next(k for k in range(1, NEW + 1) if f" {third}" in " ".join(map(str, generated[:k])))
    assert out["tokens"][0] == ref[0][: 3 + cut]


def test_bf16_tiny_runs_and_tracks_fp32():
    hf = tiny_hf_model("LlamaForCausalLM", vocab=V)
    model = _ours(hf, torch.bfloat16)
    out = Generator(model, max_batch=2).generate(PROMPTS[:2], 4, return_logprobs=True)
    ref, ref_lp = hf_reference(hf, PROMPTS[:2], 4)
    for i in range(2):
        n = len(PROMPTS[i]) - 1  # the prompt's log-probs do not depend on what was generated
        torch.testing.assert_close(torch.tensor(out.logprobs[i][:n]), ref_lp[i][:n], rtol=0, atol=0.1)
        assert all(0 <= t < V for t in out.tokens[i])


def test_generator_rejects_what_does_not_fit(models):
    _, _, model = models
    gen = Generator(model, max_batch=2, max_sequence=16)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        gen.generate([[1] * 10], 7)
    with pytest.raises(ValueError, match="exceed the batch of 2"):
        gen.generate([[1], [2], [3]], 1)


@pytest.mark.parametrize("body,message", [
    ([1], "must be a JSON object"),
    ({}, "prompts is required"),
    ({"prompts": "1 2"}, "prompts must be a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["1"] * 5}, "at most 4 per request"),
    ({"prompts": ["1"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer >= 0"),
    ({"prompts": ["1"], "tokens_to_generate": True}, "tokens_to_generate must be an integer >= 0"),
    ({"prompts": ["1"], "tokens_to_generate": 0}, "implies logprobs"),
    ({"prompts": ["1"], "temperature": 0}, "temperature must be a number in (0, 100]"),
    ({"prompts": ["1"], "top_k": 5, "top_p": 0.5}, "top_k and top_p cannot both be set"),
    ({"prompts": ["1"], "top_p": 1.5}, "top_p must be a number in [0, 1]"),
    ({"prompts": ["1"], "random_seed": -2}, "random_seed must be an integer >= 0"),
    ({"prompts": ["1"], "max_len": 5}, "replace it with tokens_to_generate"),
    ({"prompts": ["1"], "beam_width": 2}, "beam_width is not supported"),
    ({"prompts": ["1"], "tokens": 5}, "unknown field 'tokens'"),
    ({"prompts": [""]}, "an empty prompt needs add_BOS=true"),
    ({"prompts": ["1 x"]}, "prompts: NullTokenizer reads space-separated integers"),
    ({"prompts": ["1 2 3 4 5 6"], "tokens_to_generate": 11}, "prompts[0] has 6 tokens"),
])
def test_request_validation(body, message):
    with pytest.raises(RequestError) as e:
        parse_request(body, NullTokenizer(V - 1), max_prompts=4, max_sequence=16)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_request_defaults():
    req, tokens = parse_request({"prompts": ["1 2", ""], "add_BOS": True, "stop_on_eol": True},
                                NullTokenizer(V - 1), max_prompts=4, max_sequence=128)
    assert tokens == [[V - 1, 1, 2], [V - 1]] and req.tokens_to_generate == 64 and not req.logprobs
    assert req.stop_strings == ["\n"] and req.top_k == 0 and req.temperature == 1.0 and req.random_seed >= 0
