"""Per-rank memory: the theoretical estimate printed at start-up, and what training actually uses.

Weights, gradients and optimizer state, in bytes per parameter, as Megatron-LM documents them for Adam
(docs "distributed optimizer"; ``d`` = data-parallel size):

=============================  ================  ======================
parameters / gradients         plain optimizer   distributed optimizer
=============================  ================  ======================
fp16 params, fp16 grads        20                ``4 + 16/d``
bf16 params, fp32 grads        18                ``6 + 12/d``
fp32 params, fp32 grads        16                ``8 + 8/d``
=============================  ================  ======================

that is: the model parameter (2 or 4) + its DDP gradient buffer (2 or 4) + an fp32 copy of a 16-bit gradient
(4) + an fp32 master parameter for a 16-bit model (4) + Adam's two fp32 moments (8; SGD: 4 with momentum, 0
without); the distributed optimizer divides the last three by ``d``.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2), per transformer layer and microbatch, with 16-bit activations and 1-byte dropout masks (``s`` sequence,
``b`` micro batch, ``h`` hidden, ``a`` heads, ``t`` TP size):

- no parallelism: ``s*b*h*(34 + 5*a*s/h)``
- TP: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``; TP + SP: ``s*b*h*(34/t + 5*a*s/(h*t))``
- selective recompute: TP ``s*b*h*(10 + 24/t)``, TP + SP ``34*s*b*h/t``
- full recompute: the layer input only, ``2*s*b*h`` (``/t`` with SP)

(the "34" assumes multi-head attention and a 4h GeLU MLP; :func:`activation_bytes_per_layer` generalizes it to
GQA, other FFN sizes and SwiGLU term by term). The first pipeline stage is the fullest: with 1F1B it holds
``min(M, p)`` microbatches of its ``L/p`` layers, i.e. the activations of ``L`` layers; the interleaved schedule
multiplies this by ``1 + (p-1)/(p*v)``. Embedding input/dropout (``8sb + sbh`` per microbatch in flight) and, at
``p = 1``, the output layer and loss (``4sbh(1 + V/h)``) are added as Megatron does. Multi-token prediction
(``--mtp-num-layers D``) puts ``D`` depths on the last stage, each a transformer layer, its inputs (the embedded
tokens and the hidden state into ``enorm``/``hnorm``, the ``2h`` concatenation into ``eh_proj``, the input of
``final_layernorm``: ``10sbh``, ``/t`` with SP) and its own logits and loss (``4sbh(1 + V/h)``); the report is then
the fuller of the first stage and the last (which keeps one microbatch of its ``L/p`` layers in flight under 1F1B,
``(v-1)p + 1`` of its chunks interleaved). That closed form is :func:`activation_bytes`; the run's report
(:func:`theoretical_memory`) walks its own schedule on every pipeline rank instead
(:func:`pipeline_activation_bytes`): the same terms, each on the stage that holds it (a layout's uneven stages,
its standalone MTP stage), each schedule's own microbatches in flight (ZB-H1, ZBV and DualPipeV too, with the
split backward's deferred weight-gradient inputs), and the fullest rank reported.

Measured: on CUDA the allocator's peak (``torch.cuda.max_memory_allocated``); on CPU the peak bytes of tensors
saved for backward (``torch.autograd.graph.saved_tensors_hooks``), distinct storages only and parameters
excluded, i.e. exactly what the activation formula counts.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .. import device
from ..config import default_ffn_hidden_size
from ..model.moe.layer import is_moe_layer
from ..optim.clip_grads import is_expert
from ..parallel.pipeline.walk import rank_orders, schedule_of, walk_peak

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------
def bytes_per_parameter(params_dtype=torch.float32, grad_dtype=torch.float32, *, optimizer: str = "adam",
                        sgd_momentum: float = 0.9, distributed: bool = False, dp: int = 1,
                        fsdp: bool = False) -> float:
    """Weights + gradients + optimizer bytes per parameter (see the module docstring's table). ``fsdp``
    (``--use-torch-fsdp2``): fp32 parameter shards (the master weights; 16-bit is the compute dtype only), fp32
    gradient shards and the optimizer states, all divided by ``dp`` (the all-gathered units of the layers in
    flight come and go with the forward and backward and are not counted)."""
    if fsdp:
        return (4 + 4 + (8 if optimizer == "adam" else (4 if sgd_momentum else 0))) / dp
    p, g = _BYTES[params_dtype], _BYTES[grad_dtype]
    main_grad = 4 if g != 4 else 0  # fp32 copy of a 16-bit gradient
    main_param = 4 if p != 4 else 0
    states = 8 if optimizer == "adam" else (4 if sgd_momentum else 0)
    sharded = main_grad + main_param + states
    return p + g + (sharded / dp if distributed else sharded)


def _modules(recompute: str | None, modules) -> tuple:
    """The modules selective recompute covers (``--recompute-modules``; None: core attention)."""
    if recompute != "selective":
        return ()
    return ("core_attn",) if modules is None else tuple(modules)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False,
                               recompute: str | None = None, ffn_hidden_size: int | None = None,
                               kv_hidden_size: int | None = None, swiglu: bool = False,
                               recompute_modules=None, scores: bool = True) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks), one layer, one microbatch.
    ``scores=False``: an attention core that keeps no score matrix (flash-type kernels) has no ``5*a*s/h`` term.

    The 34 of the paper is 10 replicated bytes per ``s*b*h`` (two norm inputs 4, the QKV and FC1 inputs 4, two
    dropout masks 2) plus 24 TP-sharded ones (Q and K 4, V 2, projection input 2, activation input 8, FC2 input
    8). With ``kv_hidden_size`` (GQA: query groups x head size) K and V shrink to ``2*kv/h`` each; with FFN size
    ``f`` the MLP terms are ``4*f/h``, or ``6*f/h`` with SwiGLU (its input holds gate and up).
    ``sequence_parallel`` is the resolved one (``RunConfig.sequence_parallel``).

    Selective recompute drops the terms of its ``recompute_modules`` (None: ``core_attn``): ``core_attn`` the
    ``5*a*s/h`` of the scores; ``mlp`` the MLP's sharded terms (its input, the norm's output, stays);
    ``layernorm`` the two norms' outputs (the QKV and FC1 inputs, 4 of the replicated 10). ``mla_up_proj``,
    ``moe_act``, ``moe`` and ``shared_experts`` are not modelled: the formula is the dense multi-head layer's."""
    f = default_ffn_hidden_size(h, swiglu) if ffn_hidden_size is None else ffn_hidden_size
    kv = h if kv_hidden_size is None else kv_hidden_size
    modules = _modules(recompute, recompute_modules)
    mlp = 0.0 if "mlp" in modules else (6 if swiglu else 4) * f / h
    sharded = 4 + 4 * kv / h + mlp  # 24 for MHA, f = 4h, no SwiGLU
    replicated = 6.0 if "layernorm" in modules else 10.0
    attn = 0.0 if "core_attn" in modules or not scores else 5 * a * s / h  # scores, softmax, dropout mask, output
    sp = sequence_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if t == 1 or sp:
        return s * b * h * (replicated + sharded + attn) / t
    return s * b * h * (replicated + sharded / t + attn / t)


def cpu_activation_bytes_per_layer(s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False,
                                   recompute: str | None = None, ffn_hidden_size: int | None = None,
                                   kv_hidden_size: int | None = None, swiglu: bool = False,
                                   recompute_modules=None) -> float:
    """What this implementation saves per layer in 16-bit on CPU: :func:`activation_bytes_per_layer` plus three
    known deviations (accounted for tensor by tensor with the saved-tensor hooks):

    - CPU ``F.dropout`` keeps its mask in the activation dtype (2 bytes, not 1): ``+2*s*b*h`` for the layer's two
      hidden dropouts (``/t`` under SP);
    - under SP the column-parallel linears (QKV, FC1) keep their all-gathered input for the weight gradient,
      where Megatron keeps the shard and all-gathers again in backward: ``+2 * 2*s*b*h*(1 - 1/t)``;
    - without selective recompute, the CPU SDPA (math) kernel upcasts q, k, v to fp32 and saves fp32 copies of
      them (4 bytes more per element: ``+(2 + 4*kv/h)*s*b*h/t``, 6 for multi-head attention) and fp32
      probabilities, dropout mask and dropped probabilities (12 bytes per score instead of 5: ``+7*a*s*s*b/t``);
    - SwiGLU as ``silu(gate) * up`` also keeps ``silu(gate)`` for the product's backward: ``+2*f/h * s*b*h/t``.
    (``full`` recompute is the formula's; with ``recompute_modules``, the deviations of the modules recomputed
    go with them, for ``t = 1``.)"""
    base = activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=sequence_parallel, recompute=recompute,
                                      ffn_hidden_size=ffn_hidden_size, kv_hidden_size=kv_hidden_size,
                                      swiglu=swiglu, recompute_modules=recompute_modules)
    modules = _modules(recompute, recompute_modules)
    if recompute == "full":
        return base
    sp = sequence_parallel
    sbh = s * b * h
    extra = 2 * sbh / (t if sp else 1)
    if sp:
        extra += 4 * sbh * (1 - 1 / t)
    kv = h if kv_hidden_size is None else kv_hidden_size
    if "core_attn" not in modules:
        extra += (2 + 4 * kv / h) * sbh / t + 7 * a * s * s * b / t
    if swiglu and "mlp" not in modules:
        f = default_ffn_hidden_size(h, swiglu) if ffn_hidden_size is None else ffn_hidden_size
        extra += 2 * f / h * sbh / t
    return base + extra


def interleave_factor(p: int, v: int) -> float:
    """Extra activation memory of the interleaved schedule on the first stage: ``1 + (p-1)/(p*v)``."""
    return 1.0 + (p - 1) / (p * v) if v > 1 else 1.0


def attention_sizes(m) -> tuple[float, float, float, float]:
    """Per token: the elements of the attention's query, key, value (the tensors its core keeps) and output
    projection input, summed over heads. Standard attention: ``h``, ``kv``, ``kv``, ``h`` (as the formula counts);
    MLA: ``a (d_nope + d_rope)`` for the query and the (RoPE-completed) key, the value a view of the
    key/value up-projection's output ``a (d_nope + d_v)``, and ``a d_v``."""
    if not m.attention.multi_latent_attention:
        kv = m.num_query_groups * m.kv_channels
        return m.hidden_size, kv, kv, m.hidden_size
    at, a = m.attention, m.num_attention_heads
    dq = at.qk_head_dim + at.qk_pos_emb_head_dim
    return a * dq, a * dq, a * (at.qk_head_dim + at.v_head_dim), a * at.v_head_dim


def mla_latents(m) -> tuple[float, int]:
    """MLA's replicated latents kept per token, in 16-bit bytes, and how many latent norms there are: the query
    down-projection's output (and its norm's output), the key/value down-projection's whole output (the latent
    and the RoPE key; the norm's input is a view of it) and the key/value norm's output."""
    at = m.attention
    norms = 2 if at.qk_layernorm and at.q_lora_rank is not None else (1 if at.qk_layernorm else 0)
    q = 0 if at.q_lora_rank is None else 2 * at.q_lora_rank * (2 if at.qk_layernorm else 1)
    kv = 2 * (at.kv_lora_rank + at.qk_pos_emb_head_dim) + (2 * at.kv_lora_rank if at.qk_layernorm else 0)
    return q + kv, norms


def _activation_terms(m, *, micro_batch_size: int, tp: int, cp: int, sequence_parallel: bool,
                      padded_vocab_size: int | None, scores: bool) -> tuple[float, float, float, float]:
    """The formula's bytes for one microbatch: a transformer layer, the embedding's input and dropout (``8sb +
    sbh``), the output layer's input and the loss's logits (``4sbh(1 + V/h)/t``), and one MTP depth's layer and
    inputs (``10sbh``, ``/t`` with SP)."""
    s, b, h = m.seq_length // cp, micro_batch_size, m.hidden_size
    per_layer = activation_bytes_per_layer(s, b, h, m.num_attention_heads, t=tp,
                                           sequence_parallel=sequence_parallel,
                                           recompute=m.recompute.recompute_granularity,
                                           recompute_modules=m.recompute.recompute_modules,
                                           ffn_hidden_size=m.ffn_hidden_size,
                                           kv_hidden_size=m.num_query_groups * m.kv_channels, swiglu=m.swiglu,
                                           scores=scores)
    if m.attention.multi_latent_attention and m.recompute.recompute_granularity != "full":
        q, k, v, proj = attention_sizes(m)  # MLA's tensors in place of the formula's Q, K, V and projection input
        kv = m.num_query_groups * m.kv_channels
        per_layer += 2 * (q + k + v + proj - 2 * h - 2 * kv) * s * b / tp
        per_layer += mla_latents(m)[0] * s * b / (tp if sequence_parallel else 1)
    sbh = s * b * h / (tp if sequence_parallel else 1)
    vocab = padded_vocab_size or m.padded_vocab_size(tp)
    output = 4 * s * b * h * (1 + vocab / h) / tp  # output layer input and the loss's logits
    return per_layer, 8 * s * b + sbh, output, per_layer + 10 * sbh


def activation_bytes(model_cfg, *, micro_batch_size: int, tp: int = 1, pp: int = 1, vp: int = 1, cp: int = 1,
                     sequence_parallel: bool = False, num_microbatches: int | None = None,
                     padded_vocab_size: int | None = None, stage_layers: tuple[int, int] | None = None,
                     scores: bool = True) -> float:
    """Peak activation bytes of the fullest pipeline stage's rank for one iteration, in closed form from the
    degrees alone: the first stage, or with ``--mtp-num-layers`` the last if its depths make it fuller (the run's
    own report walks its schedule instead, :func:`pipeline_activation_bytes`, which equals this on the first
    stage for 1F1B and interleaving). Under context parallelism a rank holds ``s / cp`` tokens of every sequence.
    ``stage_layers``: the first and the last pipeline rank's transformer layers (all their chunks) when the split
    is uneven; by default ``L / pp`` each. ``scores``: whether the attention core keeps its score matrix
    (:func:`activation_bytes_per_layer`). Multi-latent attention's query, key, value and projection input
    (:func:`attention_sizes`) replace the formula's, and its replicated latents (:func:`mla_latents`) are added."""
    m = model_cfg
    per_layer, embedding, output, depth = _activation_terms(
        m, micro_batch_size=micro_batch_size, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
        padded_vocab_size=padded_vocab_size, scores=scores)
    if pp == 1:
        in_flight = 1.0
    elif vp > 1:
        in_flight = pp * interleave_factor(pp, vp)
    else:
        in_flight = min(num_microbatches or pp, pp)
    first_layers, last_layers = stage_layers or (m.num_layers / pp, m.num_layers / pp)
    total = (per_layer * first_layers + embedding) * in_flight
    if pp == 1:
        total += output
    depths = m.mtp_num_layers or 0
    if not depths:
        return total
    mtp = depths * (depth + output)  # on the last stage
    if pp == 1:
        return total + mtp
    chunks = min((vp - 1) * pp + 1, (num_microbatches or pp) * vp) if vp > 1 else 1  # in flight on the last stage
    last = per_layer * last_layers / vp * chunks + output + mtp
    return max(total, last)


def pipeline_activation_bytes(cfg, *, scores: bool = True) -> list[float]:
    """The formula's peak activations on each pipeline rank of ``cfg``'s layout and schedule.
    Each of a rank's chunks holds, per microbatch, the formula's layers (``ParallelDims.layer_range``: uneven and
    layout splits), global stage 0's chunk the embedding's input and dropout, the last stage's the output layer and
    loss and each MTP depth's logits and loss, and the MTP depths' stage (a layout's standalone ``m`` stage, else
    the last) the depths' layers and inputs; the schedule's order is walked (``parallel/pipeline/walk.py``), so
    1F1B, interleaving, ZB-H1, ZBV and DualPipeV each count their own chunk-microbatches in flight, and under a
    split backward each ``B`` keeps its deferred weight-gradient inputs (:func:`deferred_weight_bytes`, 16-bit as
    the formula) until its ``W``."""
    from ..parallel.pipeline.zero_bubble import SCHEDULES

    m, par = cfg.model, cfg.parallel
    per_layer, embedding, output, depth = _activation_terms(
        m, micro_batch_size=cfg.train.micro_batch_size, tp=par.tp, cp=par.cp,
        sequence_parallel=cfg.sequence_parallel, padded_vocab_size=None, scores=scores)
    depths = m.mtp_num_layers or 0
    last = par.pp * par.vp - 1
    mtp_stage = last if par.mtp_stage is None else par.mtp_stage
    split = schedule_of(par.pipeline_schedule, par.vp) in SCHEDULES
    orders = rank_orders(par.pipeline_schedule, par.pp, par.vp, cfg.num_microbatches)
    peaks = []
    for r in range(par.pp):
        held, deferred = [], []
        for c in range(par.vp):
            stage, layers = par.stage_of(r, c), par.layer_range(m.num_layers, r, c)
            held.append(per_layer * len(layers) + (embedding if stage == 0 else 0.0)
                        + ((1 + depths) * output if stage == last else 0.0)
                        + (depths * depth if stage == mtp_stage else 0.0))
            deferred.append(deferred_weight_bytes(cfg, layers, loss_stage=stage == last, itemsize=2) if split
                            else 0.0)
        fb, bw, _ = walk_peak(orders[r], held, deferred)
        peaks.append(sum(n * x for n, x in zip(fb, held)) + sum(n * x for n, x in zip(bw, deferred)))
    return peaks


def deferred_weight_bytes(cfg, layers, *, loss_stage: bool = False, itemsize: int | None = None) -> float:
    """Bytes one microbatch of a chunk holds from its ``B`` to its ``W`` under a split backward: for each linear
    whose weight GEMM is deferred, its input ``X`` and output gradient ``dY`` (``dW = dY^T X``), in the parameters'
    dtype. Per token of a dense layer: QKV ``h`` (the gathered input under SP) and ``(h + 2 kv) / t``; projection
    ``h_attn / t`` and ``h``; FC1 ``h`` and ``f' / t`` (``f' = 2f`` with SwiGLU); FC2 ``f / t`` and ``h``. MLA
    replaces QKV by its query projection (or up-projection from the query latent) and its key/value up-projection
    (the down-projections are replicated and not deferred). ``loss_stage``: the output layer, ``h`` and ``V / t``,
    and each MTP depth's projection (``2h``, ``h / t``), layer and output layer. A mixture-of-experts layer's
    routed experts are not deferred. ``itemsize``: bytes an element (None: the parameters')."""
    m, par = cfg.model, cfg.parallel
    s, b, h, t = m.seq_length // par.cp, cfg.train.micro_batch_size, m.hidden_size, par.tp
    at = m.attention
    if at.multi_latent_attention:
        a, dq = m.num_attention_heads, at.qk_head_dim + at.qk_pos_emb_head_dim
        q_in = at.q_lora_rank if at.q_lora_rank is not None else h
        attn = q_in + a * dq / t + at.kv_lora_rank + a * (at.qk_head_dim + at.v_head_dim) / t
        attn += a * at.v_head_dim / t + h
    else:
        kv, h_attn = m.num_query_groups * m.kv_channels, m.num_attention_heads * m.kv_channels
        attn = h + (h_attn + 2 * kv) / t + h_attn / t + h
    f = m.ffn_hidden_size
    mlp = h + f * (2 if m.swiglu else 1) / t + f / t + h
    per_token = sum(attn + (0.0 if is_moe_layer(m, i) else mlp) for i in layers)
    if loss_stage:
        vocab = m.padded_vocab_size(t) / t
        per_token += h + vocab + (m.mtp_num_layers or 0) * (2 * h + h / t + attn + mlp + h + vocab)
    return per_token * s * b * (cfg.optim.params_dtype.itemsize if itemsize is None else itemsize)


def theoretical_memory(cfg, num_params: int, num_expert_params: int = 0) -> dict:
    """This rank's estimate: ``weights_and_optimizer`` and ``activations`` bytes, and the inputs used.

    ``num_params`` counts every parameter this rank holds, ``num_expert_params`` the expert weights among them
    (each rank holds ``E/EP`` experts of every MoE layer of its stage, split over expert-TP). Under the
    distributed optimizer the expert weights' optimizer state is sharded over their own replicas, the
    expert-data-parallel group (``TP*CP*DP / (ETP*EP)`` ranks), the rest over data parallelism (as Megatron-LM's
    ``compute_weight_and_optimizer_memory``). Activations use the dense formula for every layer, without the
    score matrix where the run's attention core keeps none (flash-type kernels on this device:
    :func:`~megatronish.model.attention.attention_core_kind`)."""
    from ..model.attention import attention_core_kind

    o, par = cfg.optim, cfg.parallel
    fsdp = cfg.fsdp_active

    def per_param(dp: int) -> float:
        return bytes_per_parameter(o.params_dtype, o.grad_dtype, optimizer=o.optimizer,
                                   sgd_momentum=o.sgd_momentum, distributed=o.use_distributed_optimizer, dp=dp,
                                   fsdp=fsdp)

    bpp, expert_bpp = per_param(par.dp * par.cp if fsdp else par.dp), per_param(par.expert_dp)
    scores = attention_core_kind(cfg.model, par.cp, device.current_device().type) != "flash"
    act, fullest = activation_bytes(cfg.model, micro_batch_size=cfg.train.micro_batch_size, tp=par.tp, cp=par.cp,
                                    sequence_parallel=cfg.sequence_parallel, scores=scores), 0
    if par.pp > 1:
        peaks = pipeline_activation_bytes(cfg, scores=scores)
        fullest = peaks.index(max(peaks))
        act = peaks[fullest]
    weights = bpp * (num_params - num_expert_params) + expert_bpp * num_expert_params
    return {"num_params": num_params, "num_expert_params": num_expert_params, "bytes_per_param": bpp,
            "bytes_per_expert_param": expert_bpp, "weights_and_optimizer": weights, "activations": act,
            "fullest_pp_rank": fullest}


def _mb(x: float) -> str:
    return f"{x / 2 ** 20:.2f} MB"


def report_theoretical_memory(cfg, optimizer, models, print_fn=print) -> dict:
    """Print the start-up estimate for this rank (weights + grads + optimizer, activations)."""
    params = [p for m in models for p in m.parameters()]
    n = sum(p.numel() for p in params)
    n_expert = sum(p.numel() for p in params if is_expert(p))
    est = theoretical_memory(cfg, n, n_expert)
    est["num_mtp_params"] = sum(p.numel() for m in models for name, p in m.named_parameters()
                                if name.startswith("mtp.") or ".mtp." in name)  # the last stage's depths
    o = cfg.optim
    par = cfg.parallel
    stage = "one stage" if par.pp == 1 else \
        f"the fullest pipeline rank {est['fullest_pp_rank']} under {schedule_of(par.pipeline_schedule, par.vp)}"
    kind = ("distributed " if o.use_distributed_optimizer else "") + o.optimizer
    experts = ""
    if n_expert:
        experts = (f"; {n_expert} of them expert params x {est['bytes_per_expert_param']:.2f} B/param, "
                   f"optimizer state over expert-DP {cfg.parallel.expert_dp}")
    if est["num_mtp_params"]:
        experts += f"; {est['num_mtp_params']} of them in the multi-token-prediction depths"
    if cfg.fsdp_active:
        kind += f", FSDP2 over {cfg.parallel.dp * cfg.parallel.cp} ranks"
    print_fn(f"theoretical memory per rank: weights+grads+optimizer {_mb(est['weights_and_optimizer'])} "
             f"({n} params x {est['bytes_per_param']:.2f} B/param{experts}; "
             f"{str(o.params_dtype).replace('torch.', '')} "
             f"params, {str(o.grad_dtype).replace('torch.', '')} grads, {kind}); activations (Korthikanti et al., "
             f"{stage}) {_mb(est['activations'])}; "
             f"total {_mb(est['weights_and_optimizer'] + est['activations'])}")
    return est


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------
def measured_state_bytes(chunks, optimizer) -> int:
    """Bytes this rank holds, measured, for parameters, gradients and optimizer state: the distinct storages of
    the parameters (FSDP2: their local shards, padding included), their gradients (DDP's buffer, or FSDP2's
    gradient shards) and the optimizer's states and master copies. Call after a step (gradients present)."""
    from ..parallel.fsdp import local_shard

    tensors = []
    for chunk in chunks:
        for p in getattr(chunk, "module", chunk).parameters():
            tensors.append(local_shard(p))
            for g in (p.grad, getattr(p, "main_grad", None)):
                if g is not None:
                    tensors.append(local_shard(g))
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            tensors.append(p.detach())
            tensors += [t for t in inner.state.get(p, {}).values() if torch.is_tensor(t)]
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


class _Packed:
    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor, counter, key):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        if self.key is not None:
            self.counter._release(self.key)


class SavedActivationCounter:
    """Peak (and current) bytes of tensors autograd saves for backward inside ``with counter:``.

    Each storage is counted once while any saved reference to it lives (a tensor saved by two nodes, or views
    of one buffer, are one allocation); parameters (and views of them) are not activations and are skipped.
    """

    def __init__(self, params=()):
        from ..parallel.fsdp import local_shard  # FSDP2 parameters: their local shards' storage

        self._param_storages = {local_shard(p).untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list] = {}  # storage ptr -> [refs, bytes]
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or t.device.type == "meta":
            # a parameter or a view of one (FSDP2's gathered parameters are not in the storages known up front)
            return _Packed(t, self, None)
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._param_storages or st.nbytes() == 0:
            return _Packed(t, self, None)
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [1, st.nbytes()]
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
            else:
                entry[0] += 1
        return _Packed(t, self, key)

    @staticmethod
    def _unpack(packed: _Packed):
        return packed.tensor

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self._live[key]

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        return False


class ActivationMeter:
    """Measures the first training iteration: CUDA allocator peak, or saved-activation peak on CPU."""

    def __init__(self, params=(), enabled: bool = True, estimate: float | None = None):
        self.params = list(params)
        self.enabled = enabled
        self.estimate = estimate
        self.measured: float | None = None
        self.kind = "allocator peak" if device.device_type() == "cuda" else "saved activations (peak)"
        self._reported = False

    @contextlib.contextmanager
    def measure(self):
        if not self.enabled or self.measured is not None:
            yield
            return
        if device.device_type() == "cuda":
            device.reset_peak_memory()
            yield
            self.measured = float(device.max_memory_allocated())
        else:
            counter = SavedActivationCounter(self.params)
            with counter:
                yield
            self.measured = float(counter.peak)

    def report(self, print_fn=print) -> None:
        if self.measured is None or self._reported:
            return
        self._reported = True
        extra = ""
        if self.estimate and self.kind.startswith("saved"):
            extra = f" (formula {_mb(self.estimate)}, measured/formula {self.measured / self.estimate:.2f})"
        print_fn(f"measured memory (first iteration, {self.kind}): {_mb(self.measured)}{extra}")


__all__ = ["bytes_per_parameter", "activation_bytes_per_layer", "activation_bytes", "interleave_factor",
           "pipeline_activation_bytes", "deferred_weight_bytes",
           "attention_sizes", "mla_latents",
           "theoretical_memory", "report_theoretical_memory", "measured_state_bytes", "SavedActivationCounter",
           "ActivationMeter"]
