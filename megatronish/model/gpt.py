"""GPTModel: embedding -> transformer layers -> final norm -> output layer -> vocab-parallel loss.

One pipeline stage of the model: ``pre_process`` (first stage) owns the embedding, ``post_process`` (last
stage) the final norm, output layer and loss; ``first_layer``/``num_local_layers`` say which global layers
this stage holds. ``parallel`` is the run's :class:`~megatronish.parallel.context.ParallelContext` (default: one
process); the model reads its process groups from it and nothing else. Parameter names are global
(``decoder.layers.<global number>...``) through :meth:`GPTModel.global_name`, which is what initialization and
checkpoints key on.
"""
from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import ModelConfig
from ..parallel.context import ParallelContext, Shared
from ..parallel.context_parallel import cp_chunk_index
from ..parallel.cross_entropy import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
from ..parallel.init import TensorDesc, initialize_slice, set_desc, split_ranks
from ..parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from ..parallel.mappings import scatter_to_sequence_parallel_region
from ..parallel.random import RNGStatesTracker, tracker_or_current
from .mtp import MultiTokenPrediction, shift_left
from .norms import LayerNorm, RMSNorm
from .rope import RotaryEmbedding, rotary_embedding
from .transformer import TransformerBlock

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    """Word (+ learned position) embeddings and dropout; returns ``[s, b, h]`` (``[s/t, b, h]`` under SP).
    ``rng_tracker``: the run's RNG streams (dropout under SP draws from the model-parallel one)."""

    def __init__(self, config: ModelConfig, padded_vocab: int, sequence_parallel: bool,
                 params_dtype=torch.float32, device=None, tp_group=None, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        c = config
        self.sequence_parallel = sequence_parallel
        self._tp_group = Shared(tp_group)
        self._rng = Shared(tracker_or_current(rng_tracker))
        self.dropout = c.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, c.hidden_size, vocab_size=c.vocab_size,
                                                      sequence_parallel=sequence_parallel,
                                                      init_std=c.init_method_std, params_dtype=params_dtype,
                                                      device=device, tp_group=tp_group)
        self.position_embeddings = None
        if c.attention.position_embedding_type == "learned_absolute":
            w = nn.Parameter(torch.empty(c.max_position_embeddings, c.hidden_size, dtype=params_dtype,
                                         device=device))
            self.position_embeddings = nn.Embedding.from_pretrained(w, freeze=False)
            set_desc(self.position_embeddings.weight,
                     TensorDesc((c.max_position_embeddings, c.hidden_size), None, 1, "normal", c.init_method_std))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [s, b, h] ([s/t, b, h] under SP)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
            pos = self.position_embeddings(position_ids).transpose(0, 1)  # [b, s, h] -> [s, b, h]
            if self.sequence_parallel:
                # this rank's chunk; backward all-gathers the grad
                pos = scatter_to_sequence_parallel_region(pos, self._tp_group.value)
            x = x + pos
        rng = self._rng.value.fork() if self.sequence_parallel and self.training and self.dropout > 0 \
            else contextlib.nullcontext()
        with rng:
            return F.dropout(x, p=self.dropout, training=self.training)


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, *, sequence_parallel: bool = False, pre_process: bool = True,
                 post_process: bool = True, first_layer: int = 0, num_local_layers: int | None = None,
                 label_smoothing: float = 0.0, params_dtype=torch.float32, device=None,
                 parallel: ParallelContext | None = None, rng_tracker: RNGStatesTracker | None = None,
                 mtp_process: bool | None = None, after_mtp: bool = False, message_blocks: int = 1):
        """``rng_tracker``: the run's RNG streams, for dropout and recompute (None: the current tracker,
        :func:`megatronish.parallel.random.get_rng_tracker`).

        A standalone MTP stage (a layout's ``m`` before the stage of ``L``): ``mtp_process`` says this stage runs
        the multi-token-prediction depths, with the final norm and (off the first stage) a copy of the word
        embedding (None: the last stage does, under ``--mtp-num-layers``); ``after_mtp`` marks the stages after
        it (no layers: they pass the depths on, the loss stage splits them off); ``message_blocks`` (``1 + D``)
        is how many ``[s, b, h]`` blocks the pipeline messages carry along the sequence from the MTP stage on."""
        super().__init__()
        c = config
        self.parallel = parallel = parallel or ParallelContext.single()
        rng_tracker = tracker_or_current(rng_tracker)
        tp, tp_group = parallel.tp_size, parallel.tp_group
        self.config, self.pre_process, self.post_process = c, pre_process, post_process
        self.sequence_parallel = sequence_parallel  # resolved: RunConfig.sequence_parallel
        self.label_smoothing = label_smoothing
        self.padded_vocab_size = c.padded_vocab_size(tp)
        self.first_layer = first_layer
        num_local_layers = c.num_layers if num_local_layers is None else num_local_layers
        self.tied = not c.untie_embeddings_and_output_weights
        self.input_tensor: torch.Tensor | None = None  # hidden states from the previous pipeline stage
        self.mtp_process = post_process and bool(c.mtp_num_layers) if mtp_process is None else mtp_process
        self.after_mtp, self.message_blocks = after_mtp, message_blocks

        self.embedding = Embedding(c, self.padded_vocab_size, self.sequence_parallel, params_dtype, device,
                                   tp_group, rng_tracker) if pre_process else None
        self.rotary = rotary_embedding(c)  # None without rotary positions
        final_norm = self.mtp_process or (post_process and not after_mtp)  # the depths read the normed states
        self.decoder = TransformerBlock(c, first_layer, num_local_layers, final_norm, self.sequence_parallel,
                                        params_dtype, device, parallel, rng_tracker)
        # --cross-entropy-loss-fusion: native = the fused PyTorch loss (any device), te = the Triton kernel
        self.loss_fn = vocab_parallel_cross_entropy
        triton_loss = c.kernels.cross_entropy_loss_fusion and c.kernels.cross_entropy_fusion_impl == "te"
        if c.kernels.cross_entropy_loss_fusion:
            self.loss_fn = kernels.vocab_parallel_cross_entropy if triton_loss else fused_vocab_parallel_cross_entropy
        if c.kernels.use_triton_kernels or triton_loss:
            kernels.check_kernels_available([f for f, on in (
                ("--use-triton-kernels", c.kernels.use_triton_kernels),
                ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", triton_loss)) if on])
        self.loss_function = None  # replaces the cross entropy when set (--torch-compile: its compiled form)
        if c.kernels.use_triton_kernels:  # norms and RoPE switch to the fused kernels (the MLP reads the config)
            for m in self.modules():
                if isinstance(m, (LayerNorm, RMSNorm, RotaryEmbedding)):
                    m.use_triton_kernels = True
        self.output_layer = None
        if post_process:
            # Tied and on the embedding's stage: reuse its weight. Tied on a later stage: own a copy that has
            # the embedding's global name, so it starts equal (and the embedding group keeps it equal).
            self.output_layer = ColumnParallelLinear(
                c.hidden_size, self.padded_vocab_size, bias=False, gather_output=False,
                sequence_parallel=self.sequence_parallel, init_std=c.init_method_std,
                skip_weight_param_allocation=self.tied and pre_process, params_dtype=params_dtype, device=device,
                tp_group=tp_group)
            if self.output_layer.weight is not None:
                d = self.output_layer.weight.desc
                set_desc(self.output_layer.weight, TensorDesc(d.global_shape, 0, 1, "normal", d.std,
                                                              valid_rows=c.vocab_size))
        self.mtp = None  # --mtp-num-layers: the depths, on the last stage or their own (model/mtp.py)
        if self.mtp_process and c.mtp_num_layers:
            if not pre_process:  # their token look-ups: a copy of the word embedding, kept equal like a tied one
                self.embedding = Embedding(c, self.padded_vocab_size, self.sequence_parallel, params_dtype, device,
                                           tp_group, rng_tracker)
                if self.tied and post_process:  # the output layer's weight is that copy already
                    self.embedding.word_embeddings.weight = self.output_layer.weight
                else:
                    w = self.embedding.word_embeddings.weight
                    w.shared_embedding = w.embedding_copy = w.is_embedding_or_output_parameter = True
            self.mtp = MultiTokenPrediction(c, self.sequence_parallel, params_dtype, device, parallel, rng_tracker)
        # The input embedding and output layer weights (Megatron's attribute; --decoupled-lr gives them their
        # own LR schedule).
        if pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        # Copies of the tied word embedding on the first and last stage: their grads are summed over the
        # embedding group so they stay equal.
        if pre_process and (self.tied or c.mtp_num_layers):  # (MTP: the last stage's look-ups use a copy)
            self.embedding.word_embeddings.weight.shared_embedding = True
        if self.tied:
            if post_process and not pre_process:
                self.output_layer.weight.shared_embedding = True
                self.output_layer.weight.embedding_copy = True  # the gradient norm counts the embedding once

    # ---- global description -------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """``decoder.layers.<local i>.`` -> ``decoder.layers.<global i>.``; a tied output layer on a stage
        without the embedding is the word embedding."""
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", local_name)
        if m:
            return f"decoder.layers.{self.first_layer + int(m.group(1))}.{m.group(2)}"
        if local_name == "output_layer.weight" and self.tied:
            return WORD_EMBEDDINGS
        return local_name

    def named_global_parameters(self):
        for name, p in self.named_parameters():
            yield self.global_name(name), p

    def init_parameters(self, seed: int) -> None:
        """Fill every parameter with its slice of the global value given by ``(seed, global name)``."""
        for name, p in self.named_global_parameters():
            initialize_slice(p, p.desc, seed, name, *split_ranks(p.desc, self.parallel))

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                inference_params=None):
        """``input_ids``/``labels``: ``[b, s]`` (under context parallelism this rank's tokens, chunks ``r`` and
        ``2N-1-r``; positions default to theirs in the whole sequence). ``document_ids``: ``[b, s]`` of the *whole*
        sequence (``--reset-attention-mask``): attention stays within a document. Returns the per-token loss
        ``[b, s]`` (fp32; with ``--mtp-num-layers`` ``[1 + D, b, s]``, then each depth's, depth ``k``'s at ``i``
        for token ``i + k + 1``) if ``labels`` are given on the last stage, else logits ``[b, s, V_padded/t]``; earlier
        stages return hidden states ``[s, b, h]`` (from a standalone MTP stage on, with labels, ``[(1 + D) s, b, h]``:
        the decoder's, then each depth's).

        ``inference_params`` (generation; ``megatronish.inference.kv_cache.InferenceParams``): the tokens are
        positions ``offset ... offset + s - 1`` of the sequences whose earlier keys/values the layers' caches
        hold; with ``last_logits_only`` the last stage returns the logits of the last position only."""
        p = self.parallel
        offset = 0 if inference_params is None else inference_params.offset
        if position_ids is None and self.pre_process:
            if p.cp_size > 1:  # this CP rank's tokens' global positions
                position_ids = cp_chunk_index(input_ids.size(1) * p.cp_size, p.cp_size, p.cp_rank,
                                              input_ids.device).expand_as(input_ids)
            elif inference_params is not None and self.embedding.position_embeddings is not None:
                position_ids = torch.arange(offset, offset + input_ids.size(1), device=input_ids.device)
                position_ids = position_ids.expand_as(input_ids)  # [b, s]
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        # the depths' hidden states travel only where computed (with labels; generation sends one block)
        blocks = self.message_blocks if labels is not None and inference_params is None else 1
        rotary = None
        if self.rotary is not None:
            s = x.size(0) * (p.tp_size if self.sequence_parallel else 1)  # this CP rank's tokens
            rotary = self.rotary(offset + s * p.cp_size, device=x.device)
            if p.cp_size > 1:
                index = cp_chunk_index(s * p.cp_size, p.cp_size, p.cp_rank, x.device)
                rotary = tuple(t.index_select(0, index) if torch.is_tensor(t) else t for t in rotary)
            elif offset:  # the tables of positions offset ... offset + s - 1: [s, 1, 1, rot]
                rotary = tuple(t[offset:] if torch.is_tensor(t) else t for t in rotary)
        out = self.decoder(x, rotary, document_ids, inference_params)
        if out is x and not (self.pre_process or self.post_process):  # a pass-through stage (no layers): a node
            out = x.clone()  # of its own, as the schedules backpropagate from the output into the input's .grad
        x = out
        depths = []
        if self.mtp is not None and labels is not None and inference_params is None:
            depths = self.mtp(x, input_ids, position_ids, self.embedding, rotary, document_ids)
        if not self.post_process:
            if blocks == 1 or not self.mtp_process:
                return x
            return torch.cat([x, *depths])  # the MTP stage: the decoder's hidden states, then each depth's
        if blocks > 1 and self.after_mtp:  # the loss stage after a standalone MTP stage splits its message
            x, *depths = x.chunk(blocks)
        if inference_params is not None and inference_params.last_logits_only:
            x = x[-1:]  # [1, b, h]
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits, _ = self.output_layer(x, weight)  # [s, b, V/t]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss_fn = self.loss_function or self.loss_fn
        if loss_fn is vocab_parallel_cross_entropy:  # the logits are this call's own: the loss may overwrite them
            loss_fn = functools.partial(loss_fn, logits_owned=True)
        loss = loss_fn(logits, labels.t(), self.label_smoothing, self.config.vocab_size, self.parallel.tp_group)
        if not depths:
            return loss.t().contiguous()  # [b, s]
        losses = [loss]
        for h in depths:  # the shared output layer on each depth's hidden states; labels one more to the left
            logits, _ = self.output_layer(h, weight)
            labels = shift_left(labels, self.parallel.cp_group)
            losses.append(loss_fn(logits, labels.t(), self.label_smoothing, self.config.vocab_size,
                                  self.parallel.tp_group))
        return torch.stack(losses).transpose(1, 2).contiguous()  # [1 + D, b, s]
