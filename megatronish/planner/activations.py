"""Activation bytes of one pipeline stage's rank at its peak, from ``training/memory.py``'s per-layer formulas
(Korthikanti et al. 2022 generalized to GQA, SwiGLU and FFN size; ``cpu=True``: the same plus this
implementation's known CPU deviations, what the saved-tensor hooks measure here).

Per stage: ``in_flight`` microbatches (:func:`in_flight`: 1F1B and zb-h1 rank ``r`` of ``p``: ``min(M, p - r)``;
interleaved: the warm-up forwards plus one, ``min(M v, 2 (p - r - 1) + (v - 1) p + 1)`` model chunks; zbv:
``min(2M, M + 1 + r, 2p)`` chunks; no pipeline: 1) each hold the stage's layers' activations (the layers
``ParallelDims.layer_range`` gives, uneven first and last stages included; MLA's query, key, value and latents,
:func:`_attention_sizes`); the first stage adds the token ids (8 bytes a token) and the embedding dropout mask,
the stage holding the loss (rank 0 under zbv) the final norm's and output layer's inputs and the loss's fp32
softmax over its vocabulary shard (``4 s b V / t``), and each MTP depth's layer, norms, projection input and
logits. Under context parallelism a rank holds ``s / cp`` tokens. A mixture-of-experts
layer's MLP part is replaced by the router (its input and fp32 logits) and the experts' share of the routed
tokens (``k`` copies of each token, spread over the ``EP`` ranks, times the capacity factor when the experts' input
is padded to capacity): each routed copy keeps its expert's FC1 input and activation input, as a dense MLP of the
expert FFN size does, plus about ``3h`` bytes for the permutation (the permuted copy and the weighted expert
output; measured on the saved-tensor hooks). Full recompute keeps each recomputed block's
input and, during the backward, one block's full activations. Activations are in the parameters' dtype (fp32
models: twice the 16-bit bytes). The formula's score terms stay only where the attention core runs an unfused path
(:func:`attention_core_path`); a flash-type kernel keeps its fp32 log-sum-exp instead, and what its inputs hold
alive (:func:`_flash_extra`).

The zero-bubble schedules (``zb-h1``, ``zbv``, ``dualpipev``) split each backward into ``B`` and ``W``: after a
chunk-microbatch's ``B`` its activations are freed except what its deferred weight GEMMs need, the input ``X`` and
output gradient ``dY`` of every tensor-parallel linear (:func:`deferred_weight_bytes`: QKV, projection, FC1, FC2,
the output layer on the loss stage; MLA's up-projections), held until its ``W``. The peak is found by walking the
rank's action list (``parallel/pipeline/walk.py``): ``F`` adds a chunk-microbatch's
activations, ``B`` trades them for its deferred bytes, ``W`` frees those; the largest sum is the stage's peak,
``StageActivations.deferred`` the deferred part of it.

Another stack's runs (:func:`stage_activations`' keywords; docs/planner.md, "Another stack's activations"): its
loss's fp32 copies of the logits (:func:`loss_fp32_copies`), torchtitan's per-op selective policy
(:func:`per_op_selective_layer`), and torch.distributed.pipelining's outputs kept on the loss stage.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.moe.layer import is_moe_layer
from ..parallel.pipeline.walk import rank_orders, walk_peak
from ..training.memory import activation_bytes_per_layer, cpu_activation_bytes_per_layer, deferred_weight_bytes
from ..training.memory import attention_sizes as _attention_sizes
from ..training.memory import mla_latents as _mla_latents


@dataclass(frozen=True)
class StageActivations:
    """One stage's peak: ``layers`` (all in-flight microbatches), ``embedding``, ``output`` (logits and loss) bytes,
    and ``in_flight`` (microbatches, or model chunks when interleaved)."""

    layers: float
    embedding: float
    output: float
    in_flight: int
    recompute: float = 0.0  # full recompute: one block's activations, rebuilt during the backward
    deferred: float = 0.0  # zero-bubble schedules: deferred W's linear inputs and output gradients at the peak
    kept_outputs: float = 0.0  # torch.distributed.pipelining: the loss stage's outputs kept until the step's end

    @property
    def total(self) -> float:
        """The peak: the recomputed block comes after the last stage's loss activations are freed."""
        return self.layers + self.embedding + max(self.output, self.recompute) + self.deferred + self.kept_outputs


def in_flight(p: int, v: int, r: int, m: int, schedule: str | None = None) -> int:
    """Microbatches (more than one chunk a rank: chunk-microbatches) whose activations pipeline rank ``r`` holds at
    once, counted from a forward to its backward's input-gradient step ``B``: 1F1B and ``zb-h1`` ``min(m, p - r)``;
    interleaved ``min(m v, 2 (p - r - 1) + (v - 1) p + 1)``; ``zbv`` ``min(2m, m + 1 + r, 2p)`` (its ``2p``
    chunks-in-flight rule; before the steady state rank ``r`` holds the ``m`` forwards of its first chunk and the
    ``r + 1`` of its second that the V lets through)."""
    if p == 1:
        return 1
    if schedule == "zbv":
        return min(2 * m, m + 1 + r, 2 * p)
    if v == 1:
        return min(m, p - r)
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)


def attention_core_path(cfg, *, cpu: bool) -> str:
    """The attention core's kernel family a run takes on CPU or on CUDA, by what it keeps for the backward:
    ``"flash"``, ``"math"`` or ``"local"`` (:func:`~megatronish.model.attention.attention_core_kind`, the one
    rule the memory report reads too)."""
    from ..model.attention import attention_core_kind

    return attention_core_kind(cfg.model, cfg.parallel.cp, "cpu" if cpu else "cuda")


def _flash_extra(cfg) -> float:
    """Elements per token (over TP) a flash-type core keeps beyond the query, key, value and output projection
    input that :func:`_attention_sizes` counts (its fp32 log-sum-exp is the caller's). Standard attention: the
    value is a view of the fused QKV output, so that whole output stays (``h + 2 kv``), and the query and key are
    new tensors when rotated or normalized (the query also when a rank's query groups hold several heads: its
    reshape copies); the output is the projection's input, but under context parallelism (whose blocks merge into
    a new output tensor) a copy of it. MLA under context parallelism: the query, key, value and output padded to
    one head size ``max(d_nope + d_rope, d_v)``."""
    m, par = cfg.model, cfg.parallel
    at = m.attention
    if at.multi_latent_attention:
        if par.cp == 1:
            return 0.0
        q, k, v, proj = _attention_sizes(m)
        return 4 * max(q, proj) - (q + k + v)
    kv, hpg = m.num_query_groups * m.kv_channels, m.num_attention_heads // m.num_query_groups
    new = at.rotary or at.qk_layernorm
    q_copy = new or (m.num_query_groups // par.tp > 1 and hpg > 1)
    return m.hidden_size * (q_copy + (par.cp > 1)) + kv * new


def _layer(cfg, *, moe: bool, cpu: bool, recompute: str | None) -> float:
    """One layer, one microbatch, in the parameters' dtype."""
    m, par = cfg.model, cfg.parallel
    s, b, h, t, a = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size, par.tp, m.num_attention_heads
    sp = cfg.sequence_parallel
    kv = m.num_query_groups * m.kv_channels
    fn = cpu_activation_bytes_per_layer if cpu else activation_bytes_per_layer
    kw = dict(t=t, sequence_parallel=sp, recompute=recompute, kv_hidden_size=kv, swiglu=m.swiglu)
    value = fn(s, b, h, a, ffn_hidden_size=0 if moe else m.ffn_hidden_size, **kw)
    q, k, v, proj = _attention_sizes(m)
    mla = m.attention.multi_latent_attention
    keeps_scores = recompute is None
    flash = keeps_scores and attention_core_path(cfg, cpu=cpu) == "flash"
    upcast = 2 * (q + k + v) * s * b / t  # the CPU SDPA's fp32 copies of q, k, v (bytes over the 16-bit ones)
    if mla and recompute != "full":  # MLA's query, key, value, projection input and latents for the formula's
        value += 2 * (q + k + v + proj - 2 * h - 2 * kv) * s * b / t + _mla_latents(m)[0] * s * b / (t if sp else 1)
        if cpu and recompute != "selective" and not flash:
            value += upcast - 2 * (h + 2 * kv) * s * b / t
    if moe:  # the router and the experts' share of the routed token copies
        mo, etp = m.moe, par.expert_tp
        capacity = mo.moe_expert_capacity_factor if mo.moe_pad_expert_input_to_capacity else 1.0
        routed = s * b * mo.moe_router_topk * capacity * etp / t  # copies whose expert runs here (ETP shares one)
        f = mo.moe_ffn_hidden_size / etp
        # FC1's input and the activation's input (a dense MLP's), plus what the permutation keeps: ~3h a copy
        per_copy = 5 * h + (6 if m.swiglu else 4) * f + (2 * f if cpu and m.swiglu else 0)
        value += s * b / (t if sp else 1) * (2 * h + 4 * mo.num_experts) + routed * per_copy
        shared = mo.moe_shared_expert_intermediate_size
        if shared and recompute != "full":  # a dense MLP of that size on every token (its input is the router's)
            value += s * b / t * shared * ((6 if m.swiglu else 4) + (2 if cpu and m.swiglu else 0))
    sbh = s * b * h / (t if sp else 1)
    scores = a * s * s * b / t
    if flash:  # no score matrix (nor, on CPU, the math path's fp32 copies of q, k, v)
        value -= (12 if cpu else 5) * scores + (2 * (h + 2 * kv) * s * b / t if cpu else 0.0)
    elif keeps_scores and not m.attention.attention_dropout:  # softmax output only: no mask, no dropped copy
        value -= (8 if cpu else 3) * scores
    if not m.hidden_dropout:  # the two hidden dropouts' masks
        value -= (4 if cpu else 2) * sbh
    fp32 = cfg.optim.params_dtype.itemsize == 4
    if cpu and fp32 and not flash:  # everything doubles but the fp32 scores; SDPA's fp32 copies shrink to its scaled
        # query (MLA's: none; the kernel's scaled query and reshaped key are the copies of q and k counted above)
        score_bytes = (12 if m.attention.attention_dropout else 4) * scores if keeps_scores else 0.0
        value = 2 * (value - score_bytes) - ((2 if mla else 1) * upcast if keeps_scores else 0.0) + score_bytes
    elif fp32:
        value *= 2
    if flash:  # the fp32 log-sum-exp [b, a, s] and what the kernel's inputs keep alive (_flash_extra)
        value += (4 * a + cfg.optim.params_dtype.itemsize * _flash_extra(cfg)) * s * b / t
    if cpu and m.normalization == "RMSNorm":  # fp32 input and output copies, and the rstd, of the norms
        latent = 0.0
        if mla and recompute != "full":
            at, norms = m.attention, _mla_latents(m)[1]
            width = (at.q_lora_rank or 0) * (norms == 2) + at.kv_lora_rank * (norms > 0)
            latent = ((4 if fp32 else 6) * width + 4 * norms) * s * b / (t if sp else 1)
        value += 2 * ((4 if fp32 else 6) * sbh + 4 * sbh / h) + latent
    return value


SELECTIVE_POLICIES = ("megatron", "per-op")
LOSSES = ("megatron", "torchtitan")


def loss_fp32_copies(cfg, loss: str = "megatron") -> int:
    """The fp32 ``[tokens, V / t]`` tensors the loss holds at its peak. ``"megatron"`` (our vocab-parallel cross
    entropy): 1, the softmax it computes in place and turns into its gradient in place. ``"torchtitan"``
    (``F.cross_entropy`` on the logits its model upcasts, ``self.output(h).float()``): without TP 3, at the
    backward's start the saved log-softmax, ``nll_loss``'s gradient and the log-softmax's input gradient (the
    forward's upcast logits and log-softmax are 2); with TP its ``loss_parallel`` (torch's
    ``distributed/tensor/parallel/loss.py``) 4, the fused backward ``(grad_input + exp(x)) * grad_output`` holding
    the saved log-softmax ``x``, the zeros-and-scatter ``grad_input``, ``exp(x)`` and their sum (its forward 3:
    the upcast logits, ``shifted`` and ``exp(shifted)``)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} not in {LOSSES}")
    if loss == "megatron":
        return 1
    return 4 if cfg.parallel.tp > 1 else 3


def per_op_selective_layer(cfg) -> float:
    """One dense layer, one microbatch, under torchtitan's per-op selective checkpointing
    (``torchtitan/models/llama/parallelize_llama.py``: ``_save_list`` and ``_custom_policy``): the block's input
    (the checkpoint's argument) and the outputs of the ops it saves; everything else is recomputed in the
    backward. Saved: every other ``aten.mm`` of the block, counted from the first (Llama's order wq, wk, wv, wo,
    w1, w3, w2 keeps wq, wv, w1, w2; without SwiGLU q, v, fc1), SDPA's output and its fp32 log-sum-exp, and under
    SP with TP the ``reduce_scatter_tensor`` outputs after the two row-parallel GEMMs. A row-parallel GEMM's
    output is the full-width partial sum (``h`` a token); a column-parallel one's is ``1/t`` of its width."""
    m, par = cfg.model, cfg.parallel
    if m.attention.multi_latent_attention or m.moe.num_experts:
        raise ValueError("the per-op selective policy is modelled for dense standard-attention layers")
    s, b, h, t, a = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size, par.tp, m.num_attention_heads
    sp = cfg.sequence_parallel
    kv, h_attn, f = m.num_query_groups * m.kv_channels, m.num_attention_heads * m.kv_channels, m.ffn_hidden_size
    mms = [h_attn / t, kv / t, kv / t, h] + [f / t] * (2 if m.swiglu else 1) + [h]
    saved = sum(mms[0::2]) + (h / t if sp else h) + h_attn / t + (2 * h / t if sp else 0.0)
    return (cfg.optim.params_dtype.itemsize * saved + 4 * a / t) * s * b


def final_norm_bytes(cfg, *, cpu: bool = False) -> float:
    """What the final norm keeps for its backward, one microbatch: its input, ``s/t`` tokens under SP (the residual
    stream it normalizes is split over TP; the output layer gathers the norm's output), all ``s`` otherwise. On CPU
    an RMSNorm keeps fp32 copies of its input and output and the fp32 ``rstd`` instead."""
    m, par = cfg.model, cfg.parallel
    tokens = m.seq_length // par.cp * cfg.train.micro_batch_size / (par.tp if cfg.sequence_parallel else 1)
    if cpu and m.normalization == "RMSNorm":
        return 8 * tokens * m.hidden_size + 4 * tokens
    return 2 * tokens * m.hidden_size * (2.0 if cfg.optim.params_dtype.itemsize == 4 else 1.0)


def stage_activations(cfg, pp_rank: int = 0, *, cpu: bool = False, loss: str = "megatron",
                      selective: str = "megatron", pipelining_outputs: bool = False) -> StageActivations:
    """Peak activation bytes of a rank of pipeline stage ``pp_rank`` (module docstring). ``loss``: whose loss
    computes the cross entropy, :func:`loss_fp32_copies`. ``pipelining_outputs`` (torch.distributed.pipelining
    under PP, with ``loss="torchtitan"``): the loss stage keeps every microbatch's output, the fp32 logits
    ``4 s b V / t`` each, in its stage's ``output_chunks`` until the step's end, to merge them; under the loss's
    backward peak the ``M - 1`` earlier ones and the microbatch's own. ``selective``: what
    ``--recompute-granularity selective`` keeps, ``"megatron"`` (everything but the attention core) or
    ``"per-op"`` (torchtitan's op policy, :func:`per_op_selective_layer`; one layer's full activations are
    rebuilt during its backward)."""
    if selective not in SELECTIVE_POLICIES:
        raise ValueError(f"selective policy {selective!r} not in {SELECTIVE_POLICIES}")
    copies = loss_fp32_copies(cfg, loss)
    m, par = cfg.model, cfg.parallel
    p, v = par.pp, par.vp
    s, b, h, t = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size, par.tp
    scale = 2.0 if cfg.optim.params_dtype.itemsize == 4 else 1.0
    rec = m.recompute
    flight = in_flight(p, v, pp_rank, cfg.num_microbatches, par.pipeline_schedule)
    per_chunk = 0.0
    chunk_bytes = []  # each chunk's layers, one microbatch
    peak_extra = 0.0
    vocab = m.padded_vocab_size(t) / t
    norm = final_norm_bytes(cfg, cpu=cpu)
    depths = m.mtp_num_layers or 0
    standalone = par.mtp_stage if depths else None  # the MTP depths on a stage of their own, before the loss's
    for c in range(v):
        layers = list(par.layer_range(m.num_layers, pp_rank, c))
        before = per_chunk
        if standalone is not None and par.stage_of(pp_rank, c) == standalone:  # the final norm and the depths
            per_chunk += norm + depths * _mtp_depth(cfg, cpu=cpu, norm=norm, vocab=vocab)[0]
        full = [_layer(cfg, moe=is_moe_layer(m, i), cpu=cpu, recompute=None) for i in layers]
        if rec.recompute_granularity == "full":
            k = rec.recompute_num_layers or 1
            keep = 2 * s * b * h / (t if cfg.sequence_parallel else 1) * scale  # a block's input
            if rec.recompute_method == "uniform":
                blocks = [full[j:j + k] for j in range(0, len(full), k)]
                per_chunk += len(blocks) * keep
                peak_extra = max([peak_extra] + [sum(bl) for bl in blocks])
            else:
                k = min(k, len(full))
                per_chunk += k * keep + sum(full[k:])
                peak_extra = max([peak_extra] + full[:k])
        elif rec.recompute_granularity == "selective" and selective == "per-op":
            per_chunk += len(layers) * per_op_selective_layer(cfg)
            peak_extra = max([peak_extra] + full)
        else:
            per_chunk += sum(_layer(cfg, moe=is_moe_layer(m, i), cpu=cpu, recompute=rec.recompute_granularity)
                             for i in layers)
        chunk_bytes.append(per_chunk - before)
    per_chunk /= v
    embedding = output = 0.0
    sbh = s * b * h / (t if cfg.sequence_parallel else 1)
    one_embedding = 8 * s * b + (sbh * (2 if cpu else 1) * scale if m.hidden_dropout else 0)
    if pp_rank == 0:
        embedding = flight * one_embedding
    if pp_rank == par.loss_pp_rank:
        # the final norm's input (on the MTP stage when that stands alone), the output layer's input and the
        # loss's fp32 [tokens, V / t] tensors at its peak; each MTP depth's (all of it, or its output layer's and
        # loss's where its layers stand alone)
        depth, depth_output = _mtp_depth(cfg, cpu=cpu, norm=norm, vocab=vocab)
        output = (norm if standalone is None else 0.0) + 2 * s * b * h * scale + 4 * copies * s * b * vocab
        output += depths * (depth_output + (depth if standalone is None else 0.0))
    if _split_backward(par.pipeline_schedule):
        if pipelining_outputs:
            raise ValueError("torch.distributed.pipelining's kept outputs are modelled for 1F1B and interleaving")
        return _walked_stage(cfg, pp_rank, chunk_bytes, one_embedding, output, peak_extra, split=True)
    if v > 1 and not pipelining_outputs:
        return _walked_stage(cfg, pp_rank, chunk_bytes, one_embedding, output, peak_extra, split=False)
    kept = 0.0
    if pipelining_outputs and par.pp > 1 and pp_rank == par.loss_pp_rank:
        kept = cfg.num_microbatches * 4 * s * b * m.padded_vocab_size(t) / t
    return StageActivations(per_chunk * flight, embedding, output, flight, peak_extra, kept_outputs=kept)


def _split_backward(schedule: str | None) -> bool:
    from ..parallel.pipeline.zero_bubble import SCHEDULES

    return schedule in SCHEDULES


def _walked_stage(cfg, pp_rank: int, chunk_bytes: list[float], one_embedding: float, output: float,
                  recompute: float, *, split: bool) -> StageActivations:
    """A stage whose peak is its schedule's walk (``parallel/pipeline/walk.py``): interleaving, or with ``split`` a
    zero-bubble schedule's action list (module docstring). Each chunk holds its own layers (chunks need not be
    equal: a layout's), the embedding with global stage 0 and the output layer and loss with the last stage, each as
    many times as that chunk has microbatches between their forward and backward at the peak; under ``split`` each
    ``B`` keeps its deferred weight-gradient inputs until its ``W``."""
    m, par = cfg.model, cfg.parallel
    v, last = len(chunk_bytes), par.pp * par.vp - 1
    stages = [par.stage_of(pp_rank, c) for c in range(v)]
    emb = [one_embedding if st == 0 else 0.0 for st in stages]
    out = [output if st == last else 0.0 for st in stages]
    deferred = [deferred_weight_bytes(cfg, par.layer_range(m.num_layers, pp_rank, c), loss_stage=st == last)
                if split else 0.0 for c, st in enumerate(stages)]
    held = [x + e + o for x, e, o in zip(chunk_bytes, emb, out)]
    steps = rank_orders(par.pipeline_schedule, par.pp, v, cfg.num_microbatches)[pp_rank]
    fb, bw, most = walk_peak(steps, held, deferred)
    return StageActivations(sum(n * x for n, x in zip(fb, chunk_bytes)), sum(n * e for n, e in zip(fb, emb)),
                            sum(n * o for n, o in zip(fb, out)), most, recompute,
                            sum(n * d for n, d in zip(bw, deferred)))


def _mtp_depth(cfg, *, cpu: bool, norm: float, vocab: float) -> tuple[float, float]:
    """One multi-token-prediction depth, one microbatch, as (its layers' part, its output's part): its transformer
    layer, the two input norms' and the final norm's inputs (``norm`` bytes each) and the projection's
    concatenated input (``2h``); and as the decoder's output, the output layer's input and the fp32 softmax over
    the vocabulary shard (on the loss stage, also when the layers stand on a stage of their own)."""
    from ..model.mtp import mtp_layer_config

    m, par = cfg.model, cfg.parallel
    s, b, h = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size
    scale = 2.0 if cfg.optim.params_dtype.itemsize == 4 else 1.0
    layer_cfg = cfg if not m.moe.num_experts else dataclasses.replace(cfg, model=mtp_layer_config(m))
    moe = bool(layer_cfg.model.moe.num_experts)
    layer = _layer(layer_cfg, moe=moe, cpu=cpu, recompute=m.recompute.recompute_granularity)
    return layer + 3 * norm + 4 * s * b * h * scale, 2 * s * b * h * scale + 4 * s * b * vocab


__all__ = ["StageActivations", "stage_activations", "per_op_selective_layer", "SELECTIVE_POLICIES",
           "LOSSES", "loss_fp32_copies", "in_flight", "final_norm_bytes"]
