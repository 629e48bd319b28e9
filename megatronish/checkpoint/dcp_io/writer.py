"""DCP's file writer, in DCP's format, over :class:`~.buffers.OrderedFile`."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import (
    SavePlan,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from .. import tensor_archive
from .buffers import BouncePool, OrderedFile
from .faults import WriteFault


class Writer(FileSystemWriter):
    """DCP's file writer, one ``__<rank>_0.distcp`` file per rank, in DCP's format and item order (each tensor a
    ``torch.save`` archive, JSON entries as raw bytes), written through :class:`OrderedFile`: the small zip records
    are gathered into large writes, each tensor's data is written straight from its memory by a background thread
    (which releases the GIL in ``write``) while ``torch.save`` checksums the next bytes, and the file is fsync'd
    once at the end."""

    def __init__(self, path: str, *, direct_io: bool = True, pool: BouncePool | None = None,
                 fault: WriteFault | None = None):
        """``direct_io`` and ``pool``: :class:`OrderedFile`'s; ``fault``: a test's :class:`WriteFault`."""
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.direct_io, self.pool, self.fault = direct_io, pool, fault

    def write_data(self, plan: SavePlan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results: list = []
        rank = dist.get_rank() if dist.is_initialized() else 0
        fault = self.fault if self.fault is not None and self.fault.applies(str(self.path), rank) else None
        plain = not self.transforms.extensions and self.serialization_format == dcp_fs.SerializationFormat.TORCH_SAVE
        with OrderedFile(os.path.join(str(self.path), name), self.direct_io, self.pool) as out:
            # DCP's order: the byte entries, then the tensors in plan order
            for i, item in enumerate(sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)):
                if fault is not None and i == len(plan.items) // 2:
                    out.sync()  # half of this rank's file is on disk
                    fault.inject()
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = data.detach() if data.device.type == "cpu" else data.detach().cpu()
                    out.lend(data)
                    if plain:  # torch.save's bytes, checksummed without holding the GIL
                        offset = out.tell()
                        if tensor_archive.write(out, data):
                            length = out.tell() - offset
                            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                                       storage_data=dcp_fs._StorageInfo(name, offset, length)))
                            continue
                # DCP's own item writer (torch.save of the tensor, or the raw bytes) into our file
                results.append(dcp_fs._write_item(self.transforms, out, data, item, name, self.serialization_format))
            out.sync()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut
