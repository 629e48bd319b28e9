"""The checkpoint file writer underneath :class:`~.writer.Writer`: ordered background writes, ``O_DIRECT``
out of a pool of page-aligned blocks where the file system takes it, one fsync at the end."""
from __future__ import annotations

import errno
import mmap
import os
import queue
import threading

import numpy as np
import torch

from ...errors import CheckpointError

_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of this


class BouncePool:
    """Page-aligned host blocks that O_DIRECT writes go out of, allocated on first use and kept for every later
    save of the process (their pages stay resident: a first touch of fresh memory costs a page fault per page, and
    in a virtual machine that returns freed memory to its host, one on the host as well). A process forked later
    shares them copy-on-write, which costs one fault per page of these 16 MiB at the first save after the fork
    (marking them ``MADV_DONTFORK`` instead would leave a forked child with pool objects whose memory it does not
    have)."""

    COUNT = 4

    def __init__(self, block: int = 4 << 20):
        self.block = block  # a multiple of _ALIGN
        self.lock = threading.Lock()
        self.free: list[mmap.mmap] = []

    def take(self, n: int) -> list:
        with self.lock:
            got, self.free = self.free[:n], self.free[n:]
        while len(got) < n:
            # private: a forked process gets its own copy of a page when either side writes it
            block = mmap.mmap(-1, self.block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            block.write(bytes(self.block))  # resident now, not in the middle of a save
            got.append(block)
        return got

    def give(self, blocks: list) -> None:
        with self.lock:
            self.free.extend(blocks)


PROCESS_POOL = BouncePool()  # the blocks every save of the process writes out of


def open_direct(path: str) -> int | None:
    """A second descriptor of ``path`` opened with ``O_DIRECT``, or None where that is unknown to the OS or refused
    by the file system (tmpfs, some FUSE and network mounts)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n}")
        done += n


class OrderedFile:
    """A write-only file whose bytes reach the disk in order on background threads, with one fsync at the end.

    Writes of at least ``LENT`` bytes that lie inside a tensor handed to :meth:`lend` are queued as they are (no
    copy; the tensor is kept until :meth:`sync`); smaller writes are gathered into ``GATHER``-byte blocks. Where
    the file system takes ``O_DIRECT``, one thread copies the queued bytes into page-aligned blocks
    (:class:`BouncePool`) and a second writes each full block with ``O_DIRECT`` (the disk reads it by DMA; no
    page-cache page is allocated or copied into); the last partial block's unaligned tail goes through the page
    cache. Elsewhere one thread writes the queued bytes through the page cache. The copy into a block takes the
    place of the kernel's copy into the page cache: no byte is copied more often than with plain writes."""

    LENT = 1 << 18
    GATHER = 1 << 22

    def __init__(self, path: str, direct_io: bool = True, pool: BouncePool | None = None):
        """``direct_io``: write with ``O_DIRECT`` where the file system allows it; ``pool``: the aligned blocks
        to write out of (the process's :data:`PROCESS_POOL` when None)."""
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd = open_direct(path) if direct_io else None
        self.pos = 0
        self.small = bytearray()
        self.lent: list[torch.Tensor] = []
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        if self.direct_fd is None:
            self.threads = [threading.Thread(target=self._drain, name="checkpoint-file-writer", daemon=True)]
        else:
            self.pool = PROCESS_POOL if pool is None else pool
            self.blocks = self.pool.take(BouncePool.COUNT)
            self.empty: queue.Queue = queue.Queue()
            for block in self.blocks:
                self.empty.put(block)
            self.full: queue.Queue = queue.Queue()
            self.threads = [threading.Thread(target=self._fill, name="checkpoint-file-copier", daemon=True),
                            threading.Thread(target=self._write_blocks, name="checkpoint-file-writer",
                                             daemon=True)]
        for t in self.threads:
            t.start()

    def _drain(self) -> None:
        """Page-cache writes of the queued bytes, in order."""
        offset = 0
        while True:
            buf = self.queue.get()
            if buf is None:
                return
            view = memoryview(buf).cast("B")
            if self.error is None:
                try:
                    _pwrite_all(self.fd, view, offset)
                except BaseException as e:
                    self.error = e
            offset += len(view)

    def _fill(self) -> None:
        """Copy the queued bytes into aligned blocks, in order; hand each full block (and the last) to the
        writer thread."""
        block, fill, offset, size = None, 0, 0, 0
        while True:
            buf = self.queue.get()
            if buf is None:
                break
            src = np.frombuffer(buf, dtype=np.uint8)
            i = 0
            while i < len(src) and self.error is None:
                if block is None:
                    block, fill = self.empty.get(), 0
                    dst = np.frombuffer(block, dtype=np.uint8)
                    size = len(dst)
                n = min(size - fill, len(src) - i)
                dst[fill:fill + n] = src[i:i + n]
                fill, i = fill + n, i + n
                if fill == size:
                    self.full.put((block, size, offset))
                    offset += size
                    block = None
        if block is not None:
            self.full.put((block, fill, offset))
        self.full.put(None)

    def _write_blocks(self) -> None:
        """``O_DIRECT`` writes of the full blocks; a block's unaligned tail (only the last block has one) through
        the page cache. A file system that refuses an ``O_DIRECT`` write gets this and every later block through
        the page cache."""
        while True:
            item = self.full.get()
            if item is None:
                return
            block, n, offset = item
            try:
                if self.error is None:
                    view = memoryview(block)[:n]
                    done = 0
                    if self.direct_fd is not None:
                        try:
                            _pwrite_all(self.direct_fd, view[: n - n % _ALIGN], offset)
                            done = n - n % _ALIGN
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            os.close(self.direct_fd)
                            self.direct_fd = None
                    _pwrite_all(self.fd, view[done:], offset + done)
            except BaseException as e:
                self.error = e
            finally:
                self.empty.put(block)

    def lend(self, tensor: torch.Tensor) -> None:
        self.lent.append(tensor)

    def _inside_lent(self, view: memoryview) -> bool:
        if not self.lent or len(view) == 0:
            return False
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data
        t = self.lent[-1]
        base = t.untyped_storage().data_ptr()
        return base <= start and start + len(view) <= base + t.untyped_storage().nbytes()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n >= self.LENT and self._inside_lent(view):
            self._flush_small()
            self.queue.put(view)
        else:
            self.small += view
            if len(self.small) >= self.GATHER:
                self._flush_small()
        self.pos += n
        return n

    def _flush_small(self) -> None:
        if self.small:
            self.queue.put(self.small)
            self.small = bytearray()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        """Called by ``torch.save`` after each archive; small records keep gathering across archives."""

    def _stop(self) -> None:
        self.queue.put(None)
        for t in self.threads:
            t.join()

    def sync(self) -> None:
        """Write everything, fsync, and raise the first write error."""
        self._flush_small()
        self._stop()
        if self.error is not None:
            raise self.error
        os.fsync(self.fd)  # the inode: data written either way, and the metadata

    def __enter__(self) -> "OrderedFile":
        return self

    def __exit__(self, *exc) -> None:
        if any(t.is_alive() for t in self.threads):  # an exception before sync(): stop the threads, keep the error
            self.small = bytearray()
            self.error = self.error or CheckpointError("write abandoned")
            self._stop()
        self.lent.clear()
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        if hasattr(self, "blocks"):
            self.pool.give(self.blocks)
        os.close(self.fd)
