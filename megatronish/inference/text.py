"""Strings in, strings out: tokenization of prompts, stop strings, and the response Megatron's server returns
(``text``: prompt + generation per prompt, ``segments``: the text of each token, ``logprobs``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Generator
from .sampling import SamplingParams

__all__ = ["TextRequest", "bos_id", "generate_text", "tokenize_prompts"]


@dataclass
class TextRequest:
    """One generation request, as the server validated it (or the command line gave it)."""

    prompts: list[str]
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    logprobs: bool = False
    add_BOS: bool = False  # Megatron's field name
    random_seed: int = 0
    stop_token: int | None = None  # default: the tokenizer's end-of-document; -1: none
    stop_strings: list[str] = field(default_factory=list)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              seed=self.random_seed)


def bos_id(tokenizer) -> int:
    """The token ``add_BOS`` prepends: the tokenizer's BOS, else its end-of-document (GPT-2's convention)."""
    try:
        bos = tokenizer.bos
    except (AttributeError, NotImplementedError):
        bos = None
    return tokenizer.eod if bos is None or bos < 0 else bos


def tokenize_prompts(tokenizer, prompts: list[str], add_BOS: bool = False) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tokenizer.tokenize(p) if p else []
        out.append(([bos_id(tokenizer)] if add_BOS else []) + list(ids))
    return out


def generate_text(generator: Generator, tokenizer, req: TextRequest, prompt_tokens: list[list[int]] | None = None,
                  *, use_cache: bool = True) -> dict:
    """Run ``req`` (collective: every rank calls it with the same request) and build the response."""
    prompt_tokens = prompt_tokens if prompt_tokens is not None else tokenize_prompts(tokenizer, req.prompts,
                                                                                     req.add_BOS)
    stop = tokenizer.eod if req.stop_token is None else req.stop_token
    stop_fn = None
    if req.stop_strings:
        strings = list(req.stop_strings)

        def stop_fn(i, generated):
            text = tokenizer.detokenize(generated)
            return any(s in text for s in strings)

    out = generator.generate(prompt_tokens, req.tokens_to_generate, req.sampling(),
                             stop_token_ids=[] if stop is None or stop < 0 else [stop], stop_fn=stop_fn,
                             return_logprobs=req.logprobs, use_cache=use_cache, pad_id=tokenizer.eod)
    texts, segments = [], []
    for i, toks in enumerate(out.tokens):
        prompt_text = req.prompts[i] if i < len(req.prompts) else tokenizer.detokenize(toks[:out.prompt_lengths[i]])
        texts.append(prompt_text + _continuation(tokenizer, toks, out.prompt_lengths[i], req.add_BOS))
        segments.append([tokenizer.detokenize([t]) for t in toks])
    return {"text": texts, "segments": segments, "logprobs": out.logprobs, "tokens": out.tokens}


def _continuation(tokenizer, toks: list[int], prompt_len: int, add_bos: bool) -> str:
    """The generated text: the detokenized whole minus the detokenized prompt (so that pieces that merge
    across the boundary come out right), or the generated tokens alone where the prompt does not round-trip."""
    start = 1 if add_bos else 0
    whole, prompt = tokenizer.detokenize(toks[start:]), tokenizer.detokenize(toks[start:prompt_len])
    if prompt_len - start > 0 and whole.startswith(prompt):
        return whole[len(prompt):]
    return tokenizer.detokenize(toks[prompt_len:])
