"""DCP planners for our entries: write items for each :class:`~.entries.Piece` and :class:`~.entries.Obj`,
and read items that fill each piece in place from every stored chunk it overlaps."""
from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list

from ...errors import CheckpointError
from .codec import dumps, loads
from .entries import Obj, Sharded, check_shape, narrow


def _storage_ok(t: torch.Tensor) -> torch.Tensor:
    """What DCP writes: ``torch.save`` of a view stores its whole storage, so copy views of larger tensors."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()  # a fresh storage of exactly this size
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


class SavePlanner(DefaultSavePlanner):
    """Write items for our :class:`Sharded` / :class:`Obj` entries (plain tensors count as whole pieces)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._pieces: dict[MetadataIndex, torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, entry in self.state_dict.items():
            if isinstance(entry, torch.Tensor):
                entry = Sharded.whole(entry)
            if isinstance(entry, Obj):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            if not isinstance(entry, Sharded):
                raise TypeError(f"{key}: unsupported checkpoint entry {type(entry).__name__}")
            for piece in entry.pieces:
                index = MetadataIndex(key, torch.Size(piece.offsets))
                self._pieces[index] = piece.tensor
                items.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.size()),
                        properties=TensorProperties(dtype=piece.tensor.dtype),
                        size=torch.Size(entry.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return self.state_dict[index.fqn]
        return self._pieces[MetadataIndex(index.fqn, index.offset)]

    def transform_object(self, write_item: WriteItem, obj):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(dumps(obj.value))
        return _storage_ok(obj)


class LoadPlanner(DefaultLoadPlanner):
    """Read items for our entries: each :class:`Piece` is filled in place from every stored chunk it
    overlaps; :class:`Obj` entries are decoded into :attr:`objects`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._pieces: dict[tuple, torch.Tensor] = {}
        self._aliases: dict[tuple, list] = {}

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for key, entry in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise CheckpointError(f"the checkpoint has no entry {key!r}")
            if isinstance(entry, Obj):
                requests.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
                continue
            if isinstance(entry, torch.Tensor):
                entry = Sharded.whole(entry)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint entry {key!r} is not a tensor")
            check_shape(key, tuple(md.size), entry)
            chunks = []
            for piece in entry.pieces:
                if entry.resizable_rows and md.size[0] < piece.offsets[0] + piece.tensor.size(0):
                    with torch.no_grad():  # rows the checkpoint does not have: padding, zero
                        start = max(0, md.size[0] - piece.offsets[0])
                        for t in [piece.tensor, *piece.aliases]:
                            t[start:].zero_()
                # the widest destination is read into and the others copied from it: an fp32 master copy loaded
                # alongside its bf16 model parameter gets the stored fp32 values, not their bf16 rounding
                targets = sorted([piece.tensor, *piece.aliases], key=lambda t: -t.element_size())
                self._pieces[(key, tuple(piece.offsets))] = targets[0]
                if piece.aliases:
                    self._aliases[(key, tuple(piece.offsets))] = targets[1:]
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.size()))
            requests += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.objects[key] = loads(value.getvalue(), f"checkpoint entry {key!r}")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(index.fqn, tuple(index.offset))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        index = read_item.dest_index
        for alias in self._aliases.get((index.fqn, tuple(index.offset)), ()):
            self.transform_tensor(read_item, alias).copy_(tensor)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor):
        # narrow to the overlap; the reader copies the stored data into this view
        return narrow(tensor, read_item.dest_offsets, read_item.lengths)
