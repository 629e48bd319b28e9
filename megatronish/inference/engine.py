"""Token-level generation over one rank's slice of the model: prefill, then one token per step with the KV cache.

:class:`Generator` is collective: every rank of the run calls :meth:`Generator.generate` with the same
arguments (the server broadcasts each request first). Per step, the first pipeline stage embeds the new
tokens, each stage runs its layers (reading and extending its layers' caches) and sends the hidden states
``[s, b, h]`` to the next stage; the last stage gathers the vocabulary-parallel logits over its tensor-parallel
group, chooses the next tokens, and broadcasts them (with the finished flags) to every stage of its pipeline.
Every tensor-parallel rank of the last stage computes the same gathered logits and draws with the same seeded
generator, so they choose the same tokens without talking.

Prompts of different lengths share positions (no padding inside a sequence, as in Megatron): the batch is
prefilled up to the shortest prompt; from there each step feeds one position, and a sequence whose prompt is
longer takes its own prompt token at that position instead of a sampled one. Each sequence generates
``tokens_to_generate`` tokens or stops early at a stop token or when ``stop_fn`` says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..parallel import comm_log as comm
from ..parallel.context import ParallelContext
from ..parallel.mappings import gather_from_tensor_model_parallel_region
from .kv_cache import InferenceParams
from .sampling import SamplingParams, sample

__all__ = ["GenerationOutput", "Generator"]


@dataclass
class GenerationOutput:
    """Per sequence: ``tokens`` (prompt + generated), ``prompt_lengths``, and with ``return_logprobs`` the
    log-probability of every token after the first, given the tokens before it (``len(tokens) - 1`` values)."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    logprobs: list[list[float]] | None = None

    def generated(self, i: int) -> list[int]:
        return self.tokens[i][self.prompt_lengths[i]:]


class Generator:
    """Generation with ``model`` (this rank's :class:`~megatronish.model.gpt.GPTModel` slice under ``parallel``).

    ``max_batch`` x ``max_sequence``: the KV cache, allocated on first use and reused (prompt + generated
    tokens of a sequence must fit in ``max_sequence``). ``vocab_size``: the true vocabulary (padding rows of
    the output layer are never chosen). ``cache_mla_latents`` (``--cache-mla-latents``): a multi-latent-attention
    model attends in the latent space (its cache holds the latents either way).
    """

    def __init__(self, model, parallel: ParallelContext | None = None, *, max_batch: int = 8,
                 max_sequence: int | None = None, vocab_size: int | None = None, cache_mla_latents: bool = False):
        if parallel is not None and parallel.vp_size > 1:
            raise ValueError("generation runs one model chunk per pipeline rank; load the checkpoint without "
                             "virtual pipeline stages (any layout loads it)")
        self.model = model
        self.parallel = parallel or ParallelContext.single()
        c = model.config
        self.max_batch = max_batch
        self.max_sequence = max_sequence or c.max_position_embeddings
        self.vocab_size = vocab_size or c.vocab_size
        self.hidden_size = c.hidden_size
        self.cache_mla_latents = cache_mla_latents
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._cache: InferenceParams | None = None

    # ------------------------------------------------------------------------------------------ one forward
    def _forward(self, ids: torch.Tensor, params: InferenceParams | None) -> torch.Tensor | None:
        """Run this stage on ``ids`` ``[b, s]``; the last stage returns fp32 logits ``[b, s', V]``."""
        ctx = self.parallel
        if not ctx.is_first_stage:
            x = torch.empty(ids.size(1), ids.size(0), self.hidden_size, dtype=self.dtype, device=self.device)
            comm.recv(x, ctx.prev_pp_rank)
            self.model.set_input_tensor(x)
        out = self.model(ids, inference_params=params)
        if not ctx.is_last_stage:
            comm.send(out.contiguous(), ctx.next_pp_rank)
            return None
        logits = gather_from_tensor_model_parallel_region(out, ctx.tp_group)  # [b, s', V_padded]
        return logits[..., : self.vocab_size].float()

    def _broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        ctx = self.parallel
        if ctx.pp_size > 1:
            comm.broadcast(t, src=ctx.ranks("pp")[-1], group=ctx.pp_group)
        return t

    # ------------------------------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], tokens_to_generate: int,
                 sampling: SamplingParams | None = None, *, stop_token_ids: Sequence[int] = (),
                 stop_fn: Callable[[int, list[int]], bool] | None = None, return_logprobs: bool = False,
                 use_cache: bool = True, pad_id: int = 0) -> GenerationOutput:
        """Generate up to ``tokens_to_generate`` tokens after each prompt (collective; same arguments on every
        rank). ``stop_fn(i, generated_ids)``, called on the last stage only, ends sequence ``i`` early
        (e.g. a stop string); a stop token is kept as the last token."""
        sampling = SamplingParams(top_k=1) if sampling is None else sampling  # default: greedy
        b = len(prompts)
        if b == 0:
            return GenerationOutput([], [], [] if return_logprobs else None)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if tokens_to_generate < 0:
            raise ValueError(f"tokens_to_generate must be >= 0, got {tokens_to_generate}")
        lengths = [len(p) for p in prompts]
        final = [n + tokens_to_generate for n in lengths]
        total = max(final)
        if total > self.max_sequence:
            raise ValueError(f"prompt ({max(lengths)} tokens) + tokens_to_generate ({tokens_to_generate}) = "
                             f"{total} exceeds the context of {self.max_sequence} tokens")
        if b > self.max_batch:
            raise ValueError(f"{b} prompts exceed the batch of {self.max_batch} (--inference-max-requests)")
        self.model.eval()
        dev, ctx = self.device, self.parallel
        tokens = torch.full((b, max(total, 1)), pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        prompt_len = torch.tensor(lengths, device=dev)
        final_len = torch.tensor(final, device=dev)
        out_len = prompt_len.clone()  # grows as tokens are generated
        done = prompt_len >= final_len  # tokens_to_generate == 0
        logprobs = torch.zeros(b, max(total - 1, 0), dtype=torch.float32, device=dev) if return_logprobs else None
        stops = torch.tensor(list(stop_token_ids) or [-1], device=dev)
        generator = None
        if ctx.is_last_stage and not sampling.greedy:
            generator = torch.Generator(device=dev).manual_seed(sampling.seed)

        params = None
        if use_cache:
            if self._cache is None:
                self._cache = InferenceParams.for_model(self.model, max_batch=self.max_batch,
                                                        max_sequence=self.max_sequence,
                                                        cache_mla_latents=self.cache_mla_latents)
            params = self._cache
            params.reset()
        start = min(lengths)
        prev = 0
        if tokens_to_generate == 0:  # log-probs of the prompts only: one forward over everything
            start = total
        for cur in range(start, total + 1):
            if cur == total and (tokens_to_generate > 0 or not return_logprobs):
                break
            # positions prev ... cur - 1 go in; the logits of position cur - 1 choose position cur
            if params is not None:
                params.last_logits_only = not return_logprobs
                logits = self._forward(tokens[:, prev:cur], params)
                params.advance(cur - prev)
            else:
                logits = self._forward(tokens[:, :cur], None)
                if logits is not None:
                    logits = logits[:, prev:]
            step = torch.zeros(2, b, dtype=torch.long, device=dev)
            if ctx.is_last_stage:
                if cur < total:
                    new = sample(logits[:, -1], sampling, generator)  # [b]
                    started = (prompt_len <= cur) & ~done
                    new = torch.where(started, new, tokens[:, cur])
                    new = torch.where(done, torch.full_like(new, pad_id), new)
                    tokens[:, cur] = new
                    out_len = torch.where(started, out_len + 1, out_len)
                    ended = started & ((out_len >= final_len) | torch.isin(new, stops))
                    if stop_fn is not None:
                        for i in torch.nonzero(started & ~ended).flatten().tolist():
                            if stop_fn(i, tokens[i, lengths[i]: out_len[i]].tolist()):
                                ended[i] = True
                    done = done | ended
                    step[0], step[1] = new, done.long()
                if logprobs is not None and cur > prev:
                    targets = tokens[:, prev + 1: cur + 1] if cur < total else tokens[:, prev + 1: cur]
                    lp = torch.log_softmax(logits, dim=-1)[:, : targets.size(1)]  # [b, n, V]
                    logprobs[:, prev: prev + targets.size(1)] = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            if cur < total:
                self._broadcast_from_last(step)
                if not ctx.is_last_stage:
                    tokens[:, cur], done = step[0], step[1].bool()
            prev = cur
            if cur < total and bool(done.all()):
                break
        # the last stage knows where each sequence ended and the log-probs: share them with every stage
        lens = self._broadcast_from_last(out_len.clone() if ctx.is_last_stage else torch.zeros_like(out_len))
        if logprobs is not None:
            self._broadcast_from_last(logprobs)
        lens = lens.tolist()
        toks = tokens.tolist()
        seqs = [toks[i][: lens[i]] for i in range(b)]
        lps = None if logprobs is None else [logprobs[i, : max(lens[i] - 1, 0)].tolist() for i in range(b)]
        return GenerationOutput(seqs, lengths, lps)
