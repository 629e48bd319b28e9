"""This rank's model chunks: one :class:`GPTModel` per virtual pipeline stage.

With ``p`` pipeline ranks and ``v`` virtual stages per rank the ``L`` layers form ``p*v`` stages of ``L/(p*v)``
layers (or of the numbers an uneven split, a ``--pipeline-model-parallel-layout`` or the account-for splits give:
``ParallelDims.stage_layer_counts``; a stage may hold none next to the embedding or the loss). Virtual stage
``c`` on pipeline rank ``r`` is global stage ``c*p + r`` and holds layers ``c*L/v + r*L/(p*v)`` onward
(Megatron's assignment, :meth:`ParallelDims.layer_range`), so a microbatch visits ranks ``0..p-1`` ``v`` times.
Under ``--pipeline-schedule zbv`` the two chunks form a V: chunk 1 on rank ``r`` is stage ``2p-1-r``
(:meth:`ParallelDims.stage_of`), so a microbatch goes ``0..p-1`` and back. The embedding lives on global stage 0
(rank 0, chunk 0); the final norm, output layer and loss on global stage ``p*v-1`` (rank ``p-1``, chunk ``v-1``;
in a V rank 0, chunk 1). A layout may put the multi-token-prediction layers on a stage of their own before the
loss's (``ParallelDims.mtp_stage``): that chunk runs them, with the final norm and a copy of the word embedding,
and the messages from it on carry ``ParallelDims.message_blocks`` blocks along the sequence. Parameters take
global names, so ``init_parameters(seed)`` gives every chunk its piece of
the one-process model and a checkpoint of one layout loads into any other.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..parallel.context import ParallelContext
from ..parallel_config import check_layer_split, check_stage_split  # the layer-split checks, re-exported here
from .gpt import GPTModel

__all__ = ["build_model_chunks", "check_layer_split", "check_stage_split"]


def build_model_chunks(config: ModelConfig, parallel: ParallelContext, *, sequence_parallel: bool = False,
                       device=None, **kw) -> list[GPTModel]:
    """This rank's ``vp`` chunks under ``parallel`` (uninitialized: call ``init_parameters(seed)``).

    Extra keywords (``label_smoothing``, ``params_dtype``, ``rng_tracker``: the run's RNG streams) go to every
    :class:`GPTModel`.
    """
    dims, pp_rank = parallel.dims, parallel.pp_rank
    check_stage_split(dims, config.num_layers)
    chunks, mtp = [], dims.mtp_stage
    for c in range(dims.vp):
        layers = dims.layer_range(config.num_layers, pp_rank, c)
        stage = dims.stage_of(pp_rank, c)
        post_process = stage == dims.pp * dims.vp - 1
        standalone = {} if mtp is None else {"mtp_process": stage == mtp, "after_mtp": stage > mtp,
                                             "message_blocks": dims.message_blocks}
        chunks.append(GPTModel(config, sequence_parallel=sequence_parallel, pre_process=stage == 0,
                               post_process=post_process, first_layer=layers.start, num_local_layers=len(layers),
                               device=device, parallel=parallel, **standalone, **kw))
    return chunks
