"""What each rank contributes to a checkpoint, built from the one global description of every tensor.

* model parameters: ``model.<global name>``, this rank's tensor-parallel slice(s) with their global offsets
  (from the parameter's :class:`~megatronish.parallel.init.TensorDesc`);
* optimizer state per parameter: ``optimizer.<global name>.<state>``, same slices, through the optimizer's
  ``sharded_param_state`` / ``load_sharded_param_state`` (plain ``torch.optim`` optimizers are adapted by
  :class:`TorchOptimizerState`);
* RNG generators of this rank (JSON).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import weakref

import numpy as np
import torch

from .. import device
from ..parallel.fsdp import local_shard, shard_rows
from ..parallel.init import TensorDesc, expert_range, split_ranks
from ..parallel.random import RNGStatesTracker
from .common import MODEL, OPTIMIZER
from .dcp_io import Piece, Sharded


# ---------------------------------------------------------------------------------------------------------------
# Slices of a tensor-parallel tensor
# ---------------------------------------------------------------------------------------------------------------
def _tp_blocks(shape, desc: TensorDesc, tp_rank: int, tp: int, ep_rank: int = 0,
               ep: int = 1) -> list[tuple[int | None, int, int, tuple[int, ...]]]:
    """``(dim, start, length, global offsets)`` of each block of a local tensor of ``shape``: one per stride
    block along the split dimension ``dim`` (local range ``[start, start + length)``, the layout of
    :func:`megatronish.parallel.init.local_indices`), or ``(None, 0, 0, offsets)`` for the whole tensor when it is
    not split. An expert weight starts at its first expert's row (``ep_rank``'s block of dim 0)."""
    ndim = len(desc.global_shape)
    first = [0] * ndim
    first[0] = expert_range(desc, ep_rank, ep)[0]
    if desc.partition_dim is None or tp == 1:
        return [(None, 0, 0, tuple(first))]
    dim, stride = desc.partition_dim, desc.partition_stride
    block = desc.global_shape[dim] // stride
    part = block // tp
    out = []
    for k in range(stride):
        offsets = list(first)
        offsets[dim] = k * block + tp_rank * part
        out.append((dim, k * part, part, tuple(offsets)))
    return out


def tp_pieces(local: torch.Tensor, desc: TensorDesc, tp_rank: int, tp: int, ep_rank: int = 0,
              ep: int = 1) -> list[Piece]:
    """This rank's blocks of the global tensor (see :func:`_tp_blocks`), as views of ``local``."""
    return [Piece(local if dim is None else local.narrow(dim, start, n), offsets)
            for dim, start, n, offsets in _tp_blocks(local.shape, desc, tp_rank, tp, ep_rank, ep)]


def param_pieces(p, tensor: torch.Tensor, desc: TensorDesc, parallel) -> list[Piece]:
    """This rank's pieces of ``tensor`` (the value, gradient or optimizer state of parameter ``p``, shaped like
    this rank's data of ``p``) with their global offsets. A plain parameter holds its tensor-parallel slice
    (:func:`tp_pieces`); an FSDP2 parameter holds rows ``[first, first + n)`` of that slice: the slice's blocks
    cut to those rows (empty cuts dropped)."""
    rows = shard_rows(p)
    if rows is None:
        return tp_pieces(tensor, desc, *split_ranks(desc, parallel))
    first, full_shape = rows
    last = first + tensor.shape[0]
    pieces = []
    for dim, start, n, offsets in _tp_blocks(full_shape, desc, *split_ranks(desc, parallel)):
        b_lo, b_hi = (start, start + n) if dim == 0 else (0, full_shape[0])
        lo, hi = max(first, b_lo), min(last, b_hi)
        if lo >= hi:
            continue
        part = tensor.narrow(0, lo - first, hi - lo)
        if dim not in (None, 0):
            part = part.narrow(dim, start, n)
        offsets = list(offsets)
        offsets[0] += lo - b_lo
        pieces.append(Piece(part, tuple(offsets)))
    return pieces


class Entries(dict):
    """Checkpoint entries of one rank. Adding a key twice (a tied weight held twice on one rank) keeps one
    copy for saving and makes the second an alias filled by the same read on loading."""

    def add(self, key: str, entry: Sharded) -> None:
        have = self.get(key)
        if have is None:
            self[key] = entry
            return
        known = {tuple(p.offsets): p for p in have.pieces}
        for p in entry.pieces:
            if tuple(p.offsets) in known:
                known[tuple(p.offsets)].aliases.append(p.tensor)
            else:
                have.pieces.append(p)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mmap.restype = ctypes.c_void_p
        _LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def _unmap(addr: int, nbytes: int, owner: int) -> None:
    if os.getpid() == owner:  # a forked child never had the mapping; the address may hold another one there
        _libc().munmap(addr, nbytes)


def _host_buffer(src: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like ``src``: page-locked for a CUDA source; else its own anonymous mapping marked
    ``MADV_DONTFORK``, so that processes forked later (data loader workers) do not share its pages and the first
    copy after the fork is not a copy-on-write fault per page. The mapping is released only by the process that
    made it (a forked child that frees the tensor must not unmap whatever its own allocator put at that address)."""
    if src.device.type == "cuda":
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    nbytes = src.numel() * src.element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_DONTFORK"):
        return torch.empty(src.shape, dtype=src.dtype)
    libc = _libc()
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {nbytes} bytes for an async-save staging buffer: {os.strerror(err)}")
    libc.madvise(addr, nbytes, mmap.MADV_DONTFORK)
    region = (ctypes.c_uint8 * nbytes).from_address(addr)
    weakref.finalize(region, _unmap, addr, nbytes, os.getpid())
    return torch.frombuffer(region, dtype=torch.uint8).view(src.dtype).view(src.shape)


class StagingBuffers:
    """Host copies of a rank's checkpoint pieces for asynchronous saves, allocated once and reused by every later
    save: :meth:`stage` copies each piece of the entries into its buffer (same key, offsets, shape and dtype; a
    piece whose shape or dtype changed gets a new one) and points the piece at it. Page-locked when the pieces
    live on a CUDA device (one DMA per piece, one synchronize at the end), plain host memory otherwise. The
    caller must not stage again while a write of the previous snapshot is still reading the buffers, and a process
    forked after the buffers exist does not have them (see :func:`_host_buffer`)."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # buffers allocated so far (a steady run allocates only for its first save)

    def _buffer(self, key: str, offsets, src: torch.Tensor) -> torch.Tensor:
        index = (key, tuple(offsets))
        buf = self.buffers.get(index)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = _host_buffer(src)
            self.buffers[index] = buf
            self.allocations += 1
        return buf

    def reserve(self, entries: dict) -> None:
        """Allocate the buffers of the entries' pieces now and copy the pieces in once (the pages are then
        resident), so that no save pays for them. The entries keep their own tensors."""
        self.stage({key: Sharded(e.global_shape, [Piece(p.tensor, p.offsets) for p in e.pieces])
                    for key, e in entries.items() if isinstance(e, Sharded)})

    def stage(self, entries: dict, defer=None) -> "DeferredCopies":
        """Substitute every piece of the :class:`Sharded` entries with its staging buffer and copy the piece in —
        now, or, for the keys ``defer(key)`` accepts, later: those copies are returned, to be run (on any thread)
        before the sources change."""
        on_device = False
        later = []
        with torch.no_grad():
            for key, entry in entries.items():
                if not isinstance(entry, Sharded):
                    continue
                deferred = defer is not None and defer(key)
                for piece in entry.pieces:
                    src = piece.tensor.detach()
                    buf = self._buffer(key, piece.offsets, src)
                    if deferred:
                        later.append((src, buf))
                    else:
                        on_device |= src.device.type != "cpu"
                        buf.copy_(src, non_blocking=src.device.type == "cuda")
                    piece.tensor = buf
        if on_device:
            device.synchronize()  # the copies are complete before the training step changes the sources
        return DeferredCopies(later)


class DeferredCopies:
    """Copies of live tensors into staging buffers, taken at one moment (the :meth:`StagingBuffers.stage` call) and
    run later, on a background thread, while the sources do not change (the training loop waits for them before
    its next update: :meth:`~megatronish.checkpoint.manager.Checkpointer.wait_for_snapshot`). Device sources are
    copied on a side stream that first waits for the work queued before the snapshot moment."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs
        self.ready = None
        if any(src.device.type == "cuda" for src, _ in pairs):
            self.ready = device.record_event()  # the queued work (the last optimizer step) comes before the copies

    def __len__(self) -> int:
        return len(self.pairs)

    def run(self) -> None:
        with torch.no_grad():
            if self.ready is None:
                for src, buf in self.pairs:
                    buf.copy_(src)
            else:
                device.copy_on_side_stream(self.pairs, self.ready,
                                           next(s.device for s, _ in self.pairs if s.device.type == "cuda"))
        self.pairs = []


def named_params(models) -> list[tuple[str, torch.nn.Parameter]]:
    """``(global name, parameter)`` of every model chunk of this rank."""
    return [(name, p) for m in models for name, p in m.named_global_parameters()]


def model_entries(named, parallel, *, entries: Entries | None = None) -> Entries:
    """``parallel``: the run's ParallelContext (which slice of each tensor this rank holds)."""
    entries = Entries() if entries is None else entries
    for name, p in named:
        desc = p.desc
        pieces = [Piece(x.tensor.detach(), x.offsets) for x in param_pieces(p, local_shard(p), desc, parallel)]
        entries.add(MODEL + name, Sharded(desc.global_shape, pieces, resizable_rows=desc.valid_rows is not None))
    return entries


def optimizer_entries(param_state, names: dict[int, tuple[str, TensorDesc]], parallel, *,
                      entries: Entries | None = None) -> Entries:
    """``param_state``: ``[(param, {state key: tensor shaped like param})]`` (the optimizer contract)."""
    entries = Entries() if entries is None else entries
    for p, states in param_state:
        name, desc = names[id(p)]
        for key, t in states.items():
            shape = tuple(local_shard(p).shape)
            if tuple(t.shape) != shape:
                raise ValueError(f"optimizer state {key} of {name} has shape {tuple(t.shape)}, the parameter "
                                 f"{shape}")
            pieces = [Piece(x.tensor.detach(), x.offsets) for x in param_pieces(p, t, desc, parallel)]
            entries.add(f"{OPTIMIZER}{name}.{key}",
                        Sharded(desc.global_shape, pieces, resizable_rows=desc.valid_rows is not None))
    return entries


# ---------------------------------------------------------------------------------------------------------------
# Optimizer: the checkpoint contract, and an adapter for plain torch optimizers
# ---------------------------------------------------------------------------------------------------------------
class TorchOptimizerState:
    """``sharded_param_state`` / ``load_sharded_param_state`` / ``scalar_state_dict`` /
    ``load_scalar_state_dict`` for a ``torch.optim`` Adam, AdamW or SGD."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            self.keys = ("exp_avg", "exp_avg_sq")
        elif isinstance(optimizer, torch.optim.SGD):
            self.keys = ("momentum_buffer",) if any(g.get("momentum", 0) for g in optimizer.param_groups) else ()
        else:
            raise TypeError(f"no checkpoint support for optimizer {type(optimizer).__name__}")

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def sharded_param_state(self):
        out = []
        for p in self._params():
            st = self.optimizer.state.get(p, {})
            out.append((p, {k: st[k] if st.get(k) is not None else torch.zeros(p.shape, dtype=torch.float32,
                                                                                device=p.device)
                            for k in self.keys}))
        return out

    def load_sharded_param_state(self, get) -> None:
        self._loaded = {p: get(p) for p in self._params()}

    def scalar_state_dict(self) -> dict:
        steps = [float(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        started = any(st.get(k) is not None for st in self.optimizer.state.values() for k in self.keys)
        return {"step": int(max(steps)) if steps else 0, "started": started}

    def load_scalar_state_dict(self, d: dict) -> None:
        loaded = getattr(self, "_loaded", None) or {}
        self._loaded = None
        if not d.get("started", d.get("step", 0) > 0):
            self.optimizer.state.clear()
            return
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                st = self.optimizer.state[p]
                for k, t in loaded.get(p, {}).items():  # buffers this adapter handed out: no copy needed
                    st[k] = t.to(device=p.device, dtype=p.dtype)
                if "step" in self.optimizer.defaults or isinstance(self.optimizer, (torch.optim.Adam,
                                                                                    torch.optim.AdamW)):
                    st["step"] = torch.tensor(float(d["step"]), dtype=torch.float32,
                                              device=p.device if on_device else None)


def optimizer_state(optimizer):
    """The optimizer itself when it implements the checkpoint contract, else an adapter."""
    if optimizer is None or hasattr(optimizer, "sharded_param_state"):
        return optimizer
    return TorchOptimizerState(optimizer)


# ---------------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------------
def capture_rng(tracker: RNGStatesTracker) -> dict:
    """This process's generators: python, numpy, torch, the device's and the run's ``tracker`` streams."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "device": device.get_rng_state() if device.device_type() != "cpu" else None,
            "tracker": tracker.get_states()}


def restore_rng(state: dict, tracker: RNGStatesTracker) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("device") is not None and device.device_type() != "cpu":
        device.set_rng_state(state["device"])
    tracker.set_states(state["tracker"])
