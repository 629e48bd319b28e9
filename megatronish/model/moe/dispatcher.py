"""Token dispatchers: bring each token to the ranks holding its experts, and the results back.

Both follow megatron-core's (``token_dispatcher.py``); docs/moe.md gives the collectives and their bytes.

* :class:`AllGatherDispatcher` (``--moe-token-dispatcher-type allgather``): all-gather every token (with its
  probs and routing row) over the expert-TP x EP group, run the local experts on the tokens routed to them, and
  reduce-scatter the partial outputs back (summing over experts on other ranks and over expert-TP shards).
* :class:`AllToAllDispatcher` (``alltoall``): permute this rank's tokens by expert, all-to-all over EP (each
  token travels only to the ranks of its experts), all-gather over expert-TP, sort by local expert; the way back
  reverses every step (reduce-scatter over expert-TP, all-to-all, un-permute).

Tokens are rows of ``[T, h]`` (``T = s*b`` of this rank). ``dispatch`` returns the rows for the local experts
grouped by expert, the per-expert counts and each row's probability; ``combine`` returns ``[T, h]``.
"""
from __future__ import annotations

import torch

from ...parallel.context import group_rank, group_size
from ...parallel.mappings import (
    all_gather_tensor,
    all_to_all,
    gather_from_sequence_parallel_region,
    gather_rows,
    reduce_scatter_rows,
    reduce_scatter_to_sequence_parallel_region,
)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """Rows of ``tokens`` grouped by expert (expert 0's tokens in order, then expert 1's, ...), their probs,
    and the source row of each (for :func:`unpermute`)."""
    t, e = routing_map.shape
    mask = routing_map.t()  # [E, T]
    index = torch.arange(t, device=tokens.device).expand(e, t).masked_select(mask)
    return tokens.index_select(0, index), probs.t().masked_select(mask), index


def unpermute(rows: torch.Tensor, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum every row back into its source token: ``[num_tokens, h]``."""
    out = rows.new_zeros((num_tokens, rows.size(-1)))
    return out.index_add(0, index, rows)


def _chunk_order_index(sizes: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Row index that lays chunks (``sizes``, consecutive) out in the chunk order ``order``."""
    starts = torch.cumsum(sizes, 0) - sizes
    picked_sizes, picked_starts = sizes[order], starts[order]
    base = torch.repeat_interleave(picked_starts - (torch.cumsum(picked_sizes, 0) - picked_sizes), picked_sizes)
    return base + torch.arange(int(sizes.sum()), device=sizes.device)


class AllGatherDispatcher:
    def __init__(self, num_experts: int, num_local_experts: int, parallel):
        self.num_experts, self.num_local = num_experts, num_local_experts
        self.first = parallel.ep_rank * num_local_experts  # global number of local expert 0
        self.group = parallel.tp_ep_group

    def dispatch(self, tokens, probs, routing_map):
        g = self.group
        self.num_tokens = tokens.size(0)
        if group_size(g) > 1:
            routing_map = all_gather_tensor(routing_map.to(torch.uint8), g).flatten(0, 1).bool()  # [T_all, E]
            probs = gather_from_sequence_parallel_region(probs, True, g)
            tokens = gather_from_sequence_parallel_region(tokens, True, g)
        local = slice(self.first, self.first + self.num_local)
        local_map = routing_map[:, local]
        counts = local_map.sum(dim=0).tolist()
        rows, row_probs, self.index = permute(tokens, local_map, probs[:, local])
        self.gathered = tokens.size(0)
        return rows, counts, row_probs

    def combine(self, rows):
        out = unpermute(rows, self.index, self.gathered)
        if group_size(self.group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.group)
        return out


class AllToAllDispatcher:
    def __init__(self, num_experts: int, num_local_experts: int, parallel):
        self.num_experts, self.num_local = num_experts, num_local_experts
        self.first = parallel.ep_rank * num_local_experts
        self.ep_group, self.etp_group, self.tp_ep_group = parallel.ep_group, parallel.etp_group, parallel.tp_ep_group
        self.ep, self.etp = parallel.ep_size, parallel.etp_size
        self.etp_rank = group_rank(self.etp_group)

    def dispatch(self, tokens, probs, routing_map):
        ep, etp, n_local = self.ep, self.etp, self.num_local
        self.num_tokens = tokens.size(0)
        per_expert = routing_map.sum(dim=0)  # [E] this rank's tokens per (global) expert
        # every rank's counts, laid out [etp rank, ep rank, local expert of mine]
        every = all_gather_tensor(per_expert, self.tp_ep_group).view(ep, etp, -1).transpose(0, 1)
        mine = every[:, :, self.first:self.first + n_local]  # [ETP, EP, E_local]
        self.input_splits = per_expert.view(ep, n_local).sum(dim=1).tolist()  # rows to each EP rank
        self.output_splits = mine[self.etp_rank].sum(dim=-1).tolist()  # rows from each EP rank
        self.etp_counts = mine.sum(dim=(1, 2)).tolist()  # rows each expert-TP rank holds after the all-to-all
        counts = mine.sum(dim=(0, 1)).tolist()
        rows, row_probs, self.index = permute(tokens, routing_map, probs)  # by global expert = by EP rank
        rows = all_to_all(rows, self.ep_group, self.output_splits, self.input_splits)
        row_probs = all_to_all(row_probs.unsqueeze(-1), self.ep_group, self.output_splits, self.input_splits)
        if etp > 1:
            rows = gather_rows(rows, self.etp_group, self.etp_counts)
            row_probs = gather_rows(row_probs, self.etp_group, self.etp_counts)
        self.sort = None
        if n_local > 1:  # chunks arrive as [etp rank][ep rank][expert]: group them by expert
            sizes = mine.reshape(-1)
            order = torch.arange(sizes.numel(), device=sizes.device).view(-1, n_local).t().reshape(-1)
            self.sort = _chunk_order_index(sizes, order)
            rows, row_probs = rows.index_select(0, self.sort), row_probs.index_select(0, self.sort)
        return rows, counts, row_probs.squeeze(-1)

    def combine(self, rows):
        if self.sort is not None:
            rows = torch.empty_like(rows).index_copy(0, self.sort, rows) if rows.size(0) else rows
        if self.etp > 1:
            rows = reduce_scatter_rows(rows, self.etp_group, self.etp_counts)
        rows = all_to_all(rows, self.ep_group, self.input_splits, self.output_splits)
        return unpermute(rows, self.index, self.num_tokens)


DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
