"""Context parallelism: the sequence of every micro-batch split over the ``cp`` group, and causal attention over
the whole sequence computed from the pieces.

Load-balanced split (Megatron's ``get_batch_on_this_cp_rank``): the sequence is cut into ``2N`` chunks of
``c = s / 2N`` tokens and CP rank ``r`` keeps chunks ``r`` and ``2N-1-r`` (early and late tokens, so causal work is
even). Inside attention, tensors are ``[b, heads, 2c, d]``: the rank's two chunks, one after the other.

Communication types (``--cp-comm-type``, Megatron's names):

- ``p2p`` (ring attention): K/V blocks travel round the ring (``N-1`` sends per layer) while each block's attention
  runs; partial outputs are merged with their log-sum-exp. Step 0 is the rank's own K/V (causal); at step ``i`` the
  block came from rank ``j = r - i``: for ``j < r`` every local query sees the block's first chunk (no mask), for
  ``j > r`` only the second local chunk sees it, all of it (no mask). Backward re-circulates K/V and passes the
  accumulated dK/dV along with them, home after ``N`` steps.
- ``a2a`` (Ulysses): all-to-all from sequence-sharded to head-sharded, plain causal attention over the full
  sequence for ``heads/N`` heads, all-to-all back. Local query and key/value heads must divide by ``N``.
- ``allgather``: all-gather K/V, the local query chunks attend to the prefix each needs (causal, bottom-right).
- ``a2a+p2p``: a2a inside the inner groups (``--hierarchical-context-parallel-sizes``), the ring across them.

Inside a block attention runs PyTorch's flash kernels that return the log-sum-exp (CPU and CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm_log as comm
from .context import group_rank, group_size

__all__ = ["CP_COMM_TYPES", "cp_chunk_index", "split_for_context_parallel", "gather_from_context_parallel",
           "context_parallel_attention"]

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


# ================================================================================= the load-balanced split
def cp_chunk_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank ``cp_rank``'s tokens: chunks ``r`` and ``2N-1-r`` of ``2N``."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size {cp_size}")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def split_for_context_parallel(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's tokens of ``x`` along its sequence dimension ``dim`` (identity at CP 1)."""
    if cp_size == 1:
        return x
    return x.index_select(dim, cp_chunk_index(x.size(dim), cp_size, cp_rank, x.device))


def gather_from_context_parallel(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Inverse of :func:`split_for_context_parallel` over ``group`` (no autograd; for tests and evaluation)."""
    n = group_size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    comm.all_gather(parts, x.contiguous(), group=group)
    s = x.size(dim) * n
    out = torch.empty((*x.shape[:dim], s, *x.shape[dim + 1:]), dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        out.index_copy_(dim, cp_chunk_index(s, n, r, x.device), part)
    return out


def _true_order(n: int, s: int, device) -> torch.Tensor:
    """Index that turns rank-ordered tokens (rank 0's two chunks, rank 1's, ...) into sequence order."""
    order = torch.cat([cp_chunk_index(s, n, r, device) for r in range(n)])
    return torch.argsort(order)


# ================================================================================= block attention kernels
def _block_forward(q, k, v, causal: bool, scale: float, mask=None):
    """Attention of one block: ``(out, lse)`` with ``lse`` fp32 ``[b, h, s_q]`` (flash kernels). ``mask``: an
    additive ``[b, 1, s_q, s_k]`` mask in the queries' dtype (document masking)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, causal, scale=scale)[:2]
        return out, lse.float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                          scale=scale)
    return out, lse.float()


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """Gradients of one block given the *merged* output and log-sum-exp (so the block's share is exact)."""
    if q.is_cuda:
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, mask, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: key/value head ``j`` serves query heads ``j*rep ... j*rep+rep-1``."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _reduce_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


def _merge(out, lse, blk_out, blk_lse):
    """Fold a block's normalized output and log-sum-exp into the running ones (fp32); rows that no key reached yet
    (``-inf`` on both sides) stay empty."""
    new = torch.logaddexp(lse, blk_lse)
    empty = torch.isinf(new)
    w_old = torch.where(empty, 0.0, torch.exp(lse - new))
    w_blk = torch.where(empty, 0.0, torch.exp(blk_lse - new))
    return out * w_old.unsqueeze(-1) + blk_out.float() * w_blk.unsqueeze(-1), new


# ================================================================================= the block plan
@dataclass
class _Block:
    """Queries of storage chunks ``[q0, q1)`` against the keys of storage chunks ``k`` (chunk slots of ``c``
    tokens); ``causal`` over the block, or an additive document ``mask`` with the rows it leaves any key."""

    q0: int
    q1: int
    k: list
    causal: bool
    mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # [b, s_q] bool: rows with at least one key in this block


def _plan(q_chunks: list[int], k_chunks: list[int], c: int, docs: torch.Tensor | None, dtype) -> list[_Block]:
    """The attention blocks between the chunks a rank holds (``q_chunks``, in storage order) and a set of key
    chunks (``k_chunks``): a query chunk sees earlier key chunks in full and its own chunk causally, never later
    ones. With ``docs`` (document ids ``[b, s]`` of the whole sequence) every (query chunk, key chunk) pair gets
    the mask "same document" (and causal on the diagonal); pairs sharing no document are skipped."""
    if docs is None:
        if q_chunks == k_chunks and q_chunks == sorted(q_chunks):  # one causal block covers them all
            return [_Block(0, len(q_chunks), list(range(len(k_chunks))), True)]
        blocks = []
        for qi, qc in enumerate(q_chunks):
            earlier = [ki for ki, kc in enumerate(k_chunks) if kc < qc]
            if earlier:
                last = blocks[-1] if blocks else None
                if last is not None and not last.causal and last.q1 == qi and last.k == earlier:
                    last.q1 = qi + 1  # consecutive query chunks seeing the same keys: one block
                else:
                    blocks.append(_Block(qi, qi + 1, earlier, False))
            blocks += [_Block(qi, qi + 1, [ki], True) for ki, kc in enumerate(k_chunks) if kc == qc]
        return blocks
    blocks = []
    tril = torch.ones(c, c, dtype=torch.bool, device=docs.device).tril()
    for qi, qc in enumerate(q_chunks):
        dq = docs[:, qc * c:(qc + 1) * c]
        for ki, kc in enumerate(k_chunks):
            if kc > qc:
                continue
            valid = dq[:, :, None] == docs[:, None, kc * c:(kc + 1) * c]  # [b, c, c]
            if kc == qc:
                valid &= tril
            if valid.any():
                mask = torch.zeros(valid.shape, dtype=dtype, device=docs.device).masked_fill_(~valid, float("-inf"))
                blocks.append(_Block(qi, qi + 1, [ki], False, mask.unsqueeze(1), valid.any(-1)))
    return blocks


def _take(t: torch.Tensor, slots: list[int], c: int) -> torch.Tensor:
    """Chunk slots ``slots`` of ``t`` along dim 2, concatenated (a view when they are consecutive)."""
    if slots == list(range(slots[0], slots[-1] + 1)):
        return t[:, :, slots[0] * c:(slots[-1] + 1) * c].contiguous()
    return torch.cat([t[:, :, i * c:(i + 1) * c] for i in slots], dim=2)


def _attend(q, kv, blocks, c, scale, out, lse) -> None:
    """Forward of ``blocks`` (queries ``q``, stacked keys/values ``kv``), merged into ``out``/``lse`` in place."""
    rep = q.size(1) // kv.size(2)
    for blk in blocks:
        qs = slice(blk.q0 * c, blk.q1 * c)
        kb, vb = (_expand_kv(_take(t, blk.k, c), rep) for t in kv)
        o, blk_lse = _block_forward(q[:, :, qs].contiguous(), kb, vb, blk.causal, scale, blk.mask)
        if blk.rows is not None:  # rows this block leaves without a key: nothing to merge
            blk_lse = blk_lse.masked_fill(~blk.rows[:, None, :], float("-inf"))
        out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, blk_lse)


def _attend_backward(dout, q, kv, out, lse, blocks, c, scale, dq, dkv) -> None:
    """Backward of ``blocks``: adds into ``dq`` and ``dkv`` (fp32) in place."""
    rep = q.size(1) // kv.size(2)
    for blk in blocks:
        qs = slice(blk.q0 * c, blk.q1 * c)
        kb, vb = (_expand_kv(_take(t, blk.k, c), rep) for t in kv)
        gq, gk, gv = _block_backward(dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(), kb, vb,
                                     out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), blk.causal, scale,
                                     blk.mask)
        dq[:, :, qs] += gq.float()
        gk, gv = _reduce_kv(gk.float(), rep), _reduce_kv(gv.float(), rep)
        for j, ki in enumerate(blk.k):
            dkv[0][:, :, ki * c:(ki + 1) * c] += gk[:, :, j * c:(j + 1) * c]
            dkv[1][:, :, ki * c:(ki + 1) * c] += gv[:, :, j * c:(j + 1) * c]


def _empty_like_out(q):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


class _LocalAttention(torch.autograd.Function):
    """The block plan between the chunks of ``q`` and of ``k``/``v`` on this rank (no communication)."""

    @staticmethod
    def forward(ctx, q, k, v, q_chunks, k_chunks, c, scale, docs):
        kv = torch.stack([k, v])
        out, lse = _empty_like_out(q)
        _attend(q, kv, _plan(q_chunks, k_chunks, c, docs, q.dtype), c, scale, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = (q_chunks, k_chunks, c, scale, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        q_chunks, k_chunks, c, scale, docs = ctx.args
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        _attend_backward(dout, q, kv, out, lse, _plan(q_chunks, k_chunks, c, docs, q.dtype), c, scale, dq, dkv)
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None, None


# ================================================================================= ring (p2p)
def _ring_exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank of the ring, receive the previous rank's into a new buffer."""
    n, r = group_size(group), group_rank(group)
    recv = torch.empty_like(send)
    ops = [comm.P2POp(comm.ISEND, send, dist.get_global_rank(group, (r + 1) % n), group),
           comm.P2POp(comm.IRECV, recv, dist.get_global_rank(group, (r - 1) % n), group)]
    return recv, comm.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group``, whose member ``m`` holds the chunks ``chunk_sets[m]`` (``c`` tokens each,
    in storage order). forward: K/V blocks travel round the ring while the block in hand is attended; backward:
    the same ring, dK/dV travelling with their K/V and arriving home after the last step."""

    @staticmethod
    def forward(ctx, q, k, v, group, chunk_sets, c, scale, docs):
        n, r = group_size(group), group_rank(group)
        kv = torch.stack([k, v]).contiguous()  # [2, b, h_kv, chunks*c, d]
        out, lse = _empty_like_out(q)
        for i in range(n):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            _attend(q, kv, _plan(chunk_sets[r], chunk_sets[(r - i) % n], c, docs, q.dtype), c, scale, out, lse)
            if i < n - 1:
                _wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, chunk_sets, c, scale, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, chunk_sets, c, scale, docs = ctx.args
        n, r = group_size(group), group_rank(group)
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i in range(n):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            blocks = _plan(chunk_sets[r], chunk_sets[(r - i) % n], c, docs, q.dtype)
            _attend_backward(dout, q, kv, out, lse, blocks, c, scale, dq, dkv)
            if i < n - 1:
                _wait(reqs)
                kv = nxt
            if n > 1:  # the accumulated dK/dV follow their K/V to the next rank (after the last step: home)
                dkv, reqs = _ring_exchange(dkv, group)
                _wait(reqs)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _local_chunks(n: int, r: int) -> list[int]:
    return [r, 2 * n - 1 - r]


# ================================================================================= all-to-all (Ulysses)
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = group_size(group)
    parts = [t.contiguous() for t in x.chunk(n, dim=scatter_dim)]
    recv = [torch.empty_like(parts[0]) for _ in range(n)]
    comm.all_to_all(recv, parts, group=group)
    return torch.cat(recv, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all scattering ``scatter_dim`` and gathering ``gather_dim`` (sequence-sharded
    ``[b, h, s/N, d]`` <-> head-sharded ``[b, h/N, s, d]``, tokens in rank order); backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad, group, gather_dim, scatter_dim), None, None, None


def _seq_to_heads(x, group):
    return _AllToAll.apply(x, group, 1, 2)


def _heads_to_seq(x, group):
    return _AllToAll.apply(x, group, 2, 1)


def _full_sequence_attention(q, k, v, scale, docs, c):
    """Causal attention over a whole sequence in order: SDPA, or with documents the block plan over its chunks."""
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.size(1) != k.size(1))
    chunks = list(range(q.size(2) // c))
    return _LocalAttention.apply(q, k, v, chunks, chunks, c, scale, docs)


def _a2a_attention(q, k, v, group, scale, docs):
    n, c = group_size(group), q.size(2) // 2
    order = _true_order(n, 2 * c * n, q.device)
    qh, kh, vh = (_seq_to_heads(t, group).index_select(2, order) for t in (q, k, v))  # [b, h/N, s, d]
    out = _full_sequence_attention(qh, kh, vh, scale, docs, c)
    return _heads_to_seq(out.index_select(2, torch.argsort(order)), group)


# ================================================================================= all-gather
class _GatherSeq(torch.autograd.Function):
    """forward: all-gather along the sequence (dim 2, rank order); backward: reduce-scatter (sum) of the grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        comm.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        parts = [t.contiguous() for t in grad.chunk(group_size(ctx.group), dim=2)]
        out = torch.empty_like(parts[0])
        comm.reduce_scatter(out, parts, group=ctx.group)
        return out, None


def _allgather_attention(q, k, v, group, scale, docs):
    """All-gather K/V (in sequence order); each local query chunk attends to its prefix: the keys before it in
    full, its own causally (flash blocks merged by log-sum-exp). Backward reduce-scatters dK/dV."""
    n, r, c = group_size(group), group_rank(group), q.size(2) // 2
    order = _true_order(n, 2 * c * n, q.device)
    kf, vf = (_GatherSeq.apply(t, group).index_select(2, order) for t in (k, v))
    return _LocalAttention.apply(q, kf, vf, _local_chunks(n, r), list(range(2 * n)), c, scale, docs)


# ================================================================================= a2a+p2p
def _hierarchical_chunks(n: int, a: int, o: int) -> list[int]:
    """Chunk ids held, in storage order, by the a2a group ``o`` (CP ranks ``a*o ... a*o+a-1``) after its a2a."""
    return [c for r in range(a * o, a * (o + 1)) for c in _local_chunks(n, r)]


def _hierarchical_attention(q, k, v, inner, outer, scale, docs):
    """a2a inside ``inner`` (adjacent CP ranks: heads scattered, their tokens gathered), then a ring over ``outer``
    whose members each hold one inner group's chunks, then a2a back."""
    a, p = group_size(inner), group_size(outer)
    n, c = a * p, q.size(2) // 2
    chunk_sets = [_hierarchical_chunks(n, a, o) for o in range(p)]
    qh, kh, vh = (_seq_to_heads(t, inner) if a > 1 else t for t in (q, k, v))  # [b, h/a, 2ac, d]
    if p > 1:
        out = _RingAttention.apply(qh, kh, vh, outer, chunk_sets, c, scale, docs)
    else:  # one inner group holds the whole sequence
        out = _LocalAttention.apply(qh, kh, vh, chunk_sets[0], chunk_sets[0], c, scale, docs)
    return _heads_to_seq(out, inner) if a > 1 else out


# ================================================================================= entry point
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, comm_type: str = "p2p",
                               scale: float, inner_group=None, outer_group=None,
                               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``q``: ``[b, heads, 2c, d]``, ``k``/``v``: ``[b, kv_heads, 2c, d]`` (this rank's two chunks); returns
    ``[b, heads, 2c, d]``. ``group``: the context-parallel group; ``a2a+p2p`` also needs ``inner_group`` (a2a) and
    ``outer_group`` (the ring across inner groups). ``document_ids``: ``[b, s]`` of the *whole* sequence (the same
    on every CP rank): a token attends only to earlier tokens of its own document (``--reset-attention-mask``).
    """
    n = group_size(group)
    if n == 1:
        return _full_sequence_attention(q, k, v, scale, document_ids, q.size(2) // 2)
    if comm_type == "p2p":
        chunk_sets = [_local_chunks(n, m) for m in range(n)]
        return _RingAttention.apply(q, k, v, group, chunk_sets, q.size(2) // 2, scale, document_ids)
    if comm_type == "a2a":
        return _a2a_attention(q, k, v, group, scale, document_ids)
    if comm_type == "allgather":
        return _allgather_attention(q, k, v, group, scale, document_ids)
    if comm_type == "a2a+p2p":
        return _hierarchical_attention(q, k, v, inner_group, outer_group, scale, document_ids)
    raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")
