"""Checking stored items against the CRC-32 their ``torch.save`` archives carry (each zip record's, in its data
descriptor and in the archive's central directory): the data of a tensor read straight into its destination is
checksummed chunk by chunk as it arrives (``checkpoint.crc.crc32`` over the bytes just read, no second pass over the
file), and an item read whole is checked record by record before it is decoded. A mismatch is one error naming the shard
file and the item."""
from __future__ import annotations

import concurrent.futures
import io
import os
import struct
import zipfile

from ...errors import CheckpointError
from ..crc import crc32

READ_CHUNK = 8 << 20  # bytes read (and checksummed) per call: the CRC runs on bytes still in the cache
_DESCRIPTOR = struct.Struct("<4sIII")  # a zip data descriptor (32-bit sizes)
SKIP_HINT = "restore the file from a copy or load an earlier iteration (--no-verify-checkpoint skips this check)"


def damaged(path: str, key: str, what: str) -> CheckpointError:
    """The one error for a stored item that fails its check."""
    return CheckpointError(f"checkpoint shard {path} is damaged: item {key!r} {what}; {SKIP_HINT}")


def item_name(index) -> str:
    """A storage index (DCP's ``MetadataIndex``) as the item's name: the entry, and its chunk's offsets if any."""
    offsets = getattr(index, "offset", None)
    return index.fqn if offsets is None else f"{index.fqn} at {list(offsets)}"


def stored_crc(fd: int, data_end: int, size: int) -> int | None:
    """The CRC-32 in the data descriptor right after a record's data (``data_end``: its file offset), or None
    when no descriptor for ``size`` bytes is there."""
    raw = os.pread(fd, _DESCRIPTOR.size, data_end)
    if len(raw) != _DESCRIPTOR.size:
        return None
    sig, crc, csize, usize = _DESCRIPTOR.unpack(raw)
    return crc if sig == b"PK\x07\x08" and csize == usize == size else None


class Checksums:
    """The CRC-32 checks of one batch of direct reads: each chunk read into its destination is checksummed on a
    helper thread (the CRC releases the GIL) while the next chunk is read, so the check runs beside the
    reads instead of after them; :meth:`finish` waits for the last ones and raises the first mismatch."""

    def __init__(self, chunk: int = READ_CHUNK):
        self.chunk = chunk
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc")
        self.last: concurrent.futures.Future | None = None
        self.errors: list[CheckpointError] = []

    def read(self, fd: int, buf: memoryview, offset: int, size: int, start: int, expected: int,
             where: tuple[str, str]) -> None:
        """Read the ``size``-byte record at ``offset``, its bytes ``[start, start + len(buf))`` into ``buf`` and the
        others (a record read whole to check a block of it) through one scratch chunk, and check the CRC-32 of all
        of them against ``expected``. Raises at once when the file ends early; a mismatch is raised by
        :meth:`finish`."""
        state = [0]

        def fold(piece) -> None:
            state[0] = crc32(piece, state[0])

        scratch = memoryview(bytearray(min(self.chunk, size - len(buf)))) if size > len(buf) else None
        done = 0
        while done < size:
            inside = start <= done < start + len(buf)
            if inside:
                piece = buf[done - start:min(done - start + self.chunk, len(buf))]
            else:
                piece = scratch[:min(self.chunk, (start if done < start else size) - done)]
                if self.last is not None:
                    self.last.result()  # the scratch chunk is free once the thread is done with it
            got = 0
            while got < len(piece):
                n = os.preadv(fd, [piece[got:]], offset + done + got)
                if n <= 0:
                    raise damaged(*where, f"ends {size - done - got} bytes early: the file is truncated")
                got += n
            if inside:
                self.last = self.pool.submit(fold, piece)
            else:
                fold(piece)
            done += len(piece)

        def compare() -> None:
            if state[0] != expected:
                self.errors.append(damaged(*where, f"fails its CRC-32 check (stored {expected:08x}, read "
                                                   f"{state[0]:08x})"))

        self.last = self.pool.submit(compare)

    def finish(self) -> None:
        """Wait for every check; raise the first mismatch."""
        self.pool.shutdown(wait=True)
        if self.errors:
            raise self.errors[0]


def archive_problem(raw) -> str | None:
    """What is wrong with one stored ``torch.save`` archive (``raw``: its bytes): a record whose bytes do not match
    the CRC-32 of its directory entry, or a damaged zip structure; None when every record checks."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    return f"record {info.filename} is compressed, which torch.save never writes"
                z.read(info)  # checksummed while read: a mismatch raises BadZipFile
    except zipfile.BadZipFile as e:
        text = str(e)
        if text.startswith("Bad CRC-32 for file"):
            return f"record {text.rsplit(' ', 1)[-1].strip(chr(39))} fails its CRC-32 check"
        return f"is not an intact archive ({text})"
    except (ValueError, OSError, EOFError, struct.error, NotImplementedError) as e:
        return f"is not an intact archive ({type(e).__name__}: {e})"
    return None


def verify_directory(iter_dir: str, md) -> tuple[int, int, list[str]]:
    """Check every tensor item of a checkpoint directory (``md``: its index, already read and its files checked)
    against its CRC-32s, one item read at a time: ``(items checked, bytes read, one line per damaged item)``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    items = nbytes = 0
    problems: list[str] = []
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if index.fqn not in tensors:
            continue
        path = os.path.join(iter_dir, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        items, nbytes = items + 1, nbytes + len(raw)
        problem = "is truncated" if len(raw) != info.length else archive_problem(raw)
        if problem is not None:
            problems.append(str(damaged(path, item_name(index), problem)))
    return items, nbytes, problems
