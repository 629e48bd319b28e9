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

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    dist.all_gather(parts, x.contiguous(), group=group)
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
def _block_forward(q, k, v, causal: bool, scale: float):
    """Attention of one block: ``(out, lse)`` with ``lse`` fp32 ``[b, h, s_q]`` (flash kernels)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse.float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block given the *merged* output and log-sum-exp (so the block's share is exact)."""
    if q.is_cuda:
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: key/value head ``j`` serves query heads ``j*rep ... j*rep+rep-1``."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _reduce_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


def _merge(out, lse, blk_out, blk_lse):
    """Fold a block's normalized output and log-sum-exp into the running ones (fp32)."""
    if out is None:
        return blk_out.float(), blk_lse
    new = torch.logaddexp(lse, blk_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + blk_out.float() * torch.exp(blk_lse - new).unsqueeze(-1)
    return out, new


# ================================================================================= ring (p2p)
def _ring_exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank of the ring, receive the previous rank's into a new buffer."""
    n, r = group_size(group), group_rank(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (r + 1) % n), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group)]
    return recv, dist.batch_isend_irecv(ops)


def _ring_steps(n: int, r: int, c: int):
    """Per ring step: (step, query slice, key/value slice, causal) of the block this rank computes."""
    full, first, second = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    yield 0, full, full, True
    for i in range(1, n):
        j = (r - i) % n
        yield (i, full, first, False) if j < r else (i, second, full, False)


class _RingAttention(torch.autograd.Function):
    """forward: causal attention over the whole sequence with K/V passed round the ring; backward: the same ring,
    dK/dV travelling with their K/V back to their owner."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        n, r = group_size(group), group_rank(group)
        b, hq, s2, d = q.shape
        c, rep = s2 // 2, hq // k.size(1)
        kv = torch.stack([k, v]).contiguous()  # [2, b, h_kv, 2c, d]
        out = torch.zeros(b, hq, s2, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, s2), float("-inf"), dtype=torch.float32, device=q.device)
        for i, qs, ks, causal in _ring_steps(n, r, c):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            kb, vb = (_expand_kv(t[:, :, ks].contiguous(), rep) for t in kv)
            o, l = _block_forward(q[:, :, qs].contiguous(), kb, vb, causal, scale)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, l)
            if i < n - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r = group_size(group), group_rank(group)
        c, rep = q.size(2) // 2, q.size(1) // k.size(1)
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i, qs, ks, causal in _ring_steps(n, r, c):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            kb, vb = (_expand_kv(t[:, :, ks].contiguous(), rep) for t in kv)
            gq, gk, gv = _block_backward(dout[:, :, qs], q[:, :, qs].contiguous(), kb, vb,
                                         out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale)
            dq[:, :, qs] += gq.float()
            dkv[0][:, :, ks] += _reduce_kv(gk.float(), rep)
            dkv[1][:, :, ks] += _reduce_kv(gv.float(), rep)
            if i < n - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
            if n > 1:  # the accumulated dK/dV follow their K/V to the next rank (after the last step: home)
                dkv, reqs = _ring_exchange(dkv, group)
                for req in reqs:
                    req.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# ================================================================================= all-to-all (Ulysses)
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = group_size(group)
    parts = [t.contiguous() for t in x.chunk(n, dim=scatter_dim)]
    recv = [torch.empty_like(parts[0]) for _ in range(n)]
    dist.all_to_all(recv, parts, group=group)
    return torch.cat(recv, dim=gather_dim)


class _SeqToHeads(torch.autograd.Function):
    """forward: all-to-all from ``[b, h, s/N, d]`` to ``[b, h/N, s, d]`` (tokens in rank order); backward: the
    reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=1, gather_dim=2)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, scatter_dim=2, gather_dim=1), None


class _HeadsToSeq(torch.autograd.Function):
    """forward: all-to-all from ``[b, h/N, s, d]`` back to ``[b, h, s/N, d]``; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=2, gather_dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, scatter_dim=1, gather_dim=2), None


def _a2a_attention(q, k, v, group, scale):
    n = group_size(group)
    s = q.size(2) * n
    order = _true_order(n, s, q.device)
    back = torch.argsort(order)
    qh, kh, vh = (_SeqToHeads.apply(t, group).index_select(2, order) for t in (q, k, v))  # [b, h/N, s, d]
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=qh.size(1) != kh.size(1))
    return _HeadsToSeq.apply(out.index_select(2, back), group)


# ================================================================================= all-gather
def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence (dim 2): rank order."""
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


def _allgather_blocks(n: int, r: int, c: int):
    """Per local query chunk: (query slice, key slice, causal) blocks over the gathered sequence (sequence order):
    the keys before the chunk in full, the chunk's own keys causally."""
    for chunk, qs in ((r, slice(0, c)), (2 * n - 1 - r, slice(c, 2 * c))):
        if chunk:
            yield qs, slice(0, chunk * c), False
        yield qs, slice(chunk * c, (chunk + 1) * c), True


class _AllGatherAttention(torch.autograd.Function):
    """forward: all-gather K/V, each local query chunk attends to its prefix (flash blocks merged by log-sum-exp);
    backward: the blocks' dK/dV reduce-scattered back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        n, r = group_size(group), group_rank(group)
        c, rep = q.size(2) // 2, q.size(1) // k.size(1)
        order = _true_order(n, 2 * c * n, q.device)
        kf, vf = (_gather_seq(t, group).index_select(2, order) for t in (k, v))  # [b, h_kv, s, d], sequence order
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for qs, ks, causal in _allgather_blocks(n, r, c):
            kb, vb = (_expand_kv(t[:, :, ks].contiguous(), rep) for t in (kf, vf))
            o, l = _block_forward(q[:, :, qs].contiguous(), kb, vb, causal, scale)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kf, vf, out, lse, order)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kf, vf, out, lse, order = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r = group_size(group), group_rank(group)
        c, rep = q.size(2) // 2, q.size(1) // kf.size(1)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *kf.shape), dtype=torch.float32, device=q.device)
        for qs, ks, causal in _allgather_blocks(n, r, c):
            kb, vb = (_expand_kv(t[:, :, ks].contiguous(), rep) for t in (kf, vf))
            gq, gk, gv = _block_backward(dout[:, :, qs], q[:, :, qs].contiguous(), kb, vb,
                                         out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale)
            dq[:, :, qs] += gq.float()
            dkv[0][:, :, ks] += _reduce_kv(gk.float(), rep)
            dkv[1][:, :, ks] += _reduce_kv(gv.float(), rep)
        dkv = dkv.index_select(3, torch.argsort(order))  # back to rank order
        parts = [t.contiguous() for t in dkv.chunk(n, dim=3)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=group)
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None


def _allgather_attention(q, k, v, group, scale):
    return _AllGatherAttention.apply(q, k, v, group, scale)


# ================================================================================= entry point
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, comm_type: str = "p2p",
                               scale: float, inner_group=None, outer_group=None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``q``: ``[b, heads, 2c, d]``, ``k``/``v``: ``[b, kv_heads, 2c, d]`` (this rank's two chunks); returns
    ``[b, heads, 2c, d]``. ``group``: the context-parallel group; ``a2a+p2p`` also needs ``inner_group`` (a2a) and
    ``outer_group`` (the ring across inner groups).
    """
    if group_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.size(1) != k.size(1))
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, scale)
    if comm_type == "a2a":
        return _a2a_attention(q, k, v, group, scale)
    if comm_type == "allgather":
        return _allgather_attention(q, k, v, group, scale)
    if comm_type == "a2a+p2p":
        return _hierarchical_attention(q, k, v, inner_group, outer_group, scale)
    raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")


def _hierarchical_chunks(n: int, a: int, o: int) -> list[int]:
    """Chunk ids held, in storage order, by the a2a group ``o`` (CP ranks ``a*o ... a*o+a-1``) after its a2a."""
    return [c for r in range(a * o, a * (o + 1)) for c in (r, 2 * n - 1 - r)]


def _chunk_blocks(q_chunks: list[int], k_chunks: list[int]):
    """The attention blocks between two sets of chunks: per query chunk, the strictly earlier key chunks (no mask)
    and the same chunk (causal); later key chunks are never seen."""
    for qi, qc in enumerate(q_chunks):
        earlier = [ki for ki, kc in enumerate(k_chunks) if kc < qc]
        same = [ki for ki, kc in enumerate(k_chunks) if kc == qc]
        if earlier:
            yield qi, earlier, False
        if same:
            yield qi, same, True


def _take(t: torch.Tensor, chunks: list[int], c: int) -> torch.Tensor:
    """Chunks ``chunks`` (storage positions) of ``t`` along dim 2, concatenated."""
    if len(chunks) == 1:
        return t[:, :, chunks[0] * c:(chunks[0] + 1) * c].contiguous()
    return torch.cat([t[:, :, i * c:(i + 1) * c] for i in chunks], dim=2)


class _ChunkRingAttention(torch.autograd.Function):
    """Ring attention over ``group`` where member ``o`` holds the chunks ``chunk_sets[o]`` (any set, in storage
    order, ``c`` tokens each): the ring of ``a2a+p2p``. Same protocol as :class:`_RingAttention`."""

    @staticmethod
    def forward(ctx, q, k, v, group, chunk_sets, c, scale):
        n, r = group_size(group), group_rank(group)
        rep = q.size(1) // k.size(1)
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(n):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            for qi, kis, causal in _chunk_blocks(chunk_sets[r], chunk_sets[(r - i) % n]):
                qs = slice(qi * c, (qi + 1) * c)
                kb, vb = (_expand_kv(_take(t, kis, c), rep) for t in kv)
                o, l = _block_forward(q[:, :, qs].contiguous(), kb, vb, causal, scale)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, l)
            if i < n - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.chunk_sets, ctx.c, ctx.scale = group, chunk_sets, c, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, chunk_sets, c, scale = ctx.group, ctx.chunk_sets, ctx.c, ctx.scale
        n, r = group_size(group), group_rank(group)
        rep = q.size(1) // k.size(1)
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i in range(n):
            if i < n - 1:
                nxt, reqs = _ring_exchange(kv, group)
            for qi, kis, causal in _chunk_blocks(chunk_sets[r], chunk_sets[(r - i) % n]):
                qs = slice(qi * c, (qi + 1) * c)
                kb, vb = (_expand_kv(_take(t, kis, c), rep) for t in kv)
                gq, gk, gv = _block_backward(dout[:, :, qs], q[:, :, qs].contiguous(), kb, vb,
                                             out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale)
                dq[:, :, qs] += gq.float()
                gk, gv = _reduce_kv(gk.float(), rep), _reduce_kv(gv.float(), rep)
                for j, ki in enumerate(kis):
                    dkv[0][:, :, ki * c:(ki + 1) * c] += gk[:, :, j * c:(j + 1) * c]
                    dkv[1][:, :, ki * c:(ki + 1) * c] += gv[:, :, j * c:(j + 1) * c]
            if i < n - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
            if n > 1:
                dkv, reqs = _ring_exchange(dkv, group)
                for req in reqs:
                    req.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _hierarchical_attention(q, k, v, inner, outer, scale):
    """a2a inside ``inner`` (adjacent CP ranks: heads scattered, their tokens gathered), then a ring over ``outer``
    whose members each hold one inner group's chunks, then a2a back."""
    a, p = group_size(inner), group_size(outer)
    n, c = a * p, q.size(2) // 2
    chunk_sets = [_hierarchical_chunks(n, a, o) for o in range(p)]
    qh, kh, vh = (_SeqToHeads.apply(t, inner) if a > 1 else t for t in (q, k, v))  # [b, h/a, 2ac, d]
    if p > 1:
        out = _ChunkRingAttention.apply(qh, kh, vh, outer, chunk_sets, c, scale)
    else:  # one inner group holds the whole sequence: reorder and run plain causal attention
        order = torch.argsort(torch.tensor(chunk_sets[0], device=q.device))
        perm = torch.cat([torch.arange(i * c, (i + 1) * c, device=q.device) for i in order.tolist()])
        out = F.scaled_dot_product_attention(qh.index_select(2, perm), kh.index_select(2, perm),
                                             vh.index_select(2, perm), is_causal=True, scale=scale,
                                             enable_gqa=qh.size(1) != kh.size(1)).index_select(2, torch.argsort(perm))
    return _HeadsToSeq.apply(out, inner) if a > 1 else out
