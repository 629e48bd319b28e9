"""The storage layer: rectangular pieces of global tensors in and out of ``torch.distributed.checkpoint``.

Every rank describes what it holds as :class:`Sharded` entries — a global shape plus a list of
:class:`Piece` s, each a local tensor and its offsets in the global tensor — and JSON-able :class:`Obj`
entries. DCP plans the writes (a piece held by several ranks, e.g. a DP replica, is written once: DCP's
dedup keys on ``(name, offsets)``) and, on load, computes which stored chunks overlap each requested
piece, so any layout reads any other.

A tensor-parallel split with ``partition_stride > 1`` (fused ``[gate; up]``) gives a rank ``stride``
separate blocks along the split dimension; each is its own piece.

Loading is weights-only: tensors are read with ``torch.load(weights_only=True)`` (or, for a plain contiguous chunk,
its ``data.pkl`` is unpickled weights-only onto the meta device and the data read straight into the destination),
JSON entries are decoded as JSON, and DCP's ``.metadata`` index is unpickled with an allow-list of DCP's own
classes. Every tensor item is checked against the CRC-32s of its archive as it is read (``verify``, the default).

Files are DCP's (``__<rank>_0.distcp``, byte for byte what ``FileSystemWriter`` writes): :class:`Writer` writes each
rank's file with large sequential writes straight from tensor memory on a background thread and one fsync;
:class:`Reader` reads chunks with one ``preadv`` into the destination where the layout allows.

The modules: :mod:`.entries` (what a rank hands over), :mod:`.codec` (JSON with exact tensors), :mod:`.planner`
(DCP's planners for our entries), :mod:`.index` (the index read safely, the files checked), :mod:`.archive` (a
stored chunk's ``torch.save`` archive parsed and read into place), :mod:`.verify` (the CRC-32 checks on load),
:mod:`.reader`, :mod:`.buffers` (ordered,
``O_DIRECT`` file writes), :mod:`.writer`, :mod:`.faults` (a test's write fault), :mod:`.api` (save and load).
"""
from ...errors import CheckpointError
from .api import first_failure, load, save
from .buffers import BouncePool
from .codec import decode, dumps, encode, loads
from .entries import METADATA_FILE, Obj, Piece, Sharded, check_shape, gc_paused, narrow
from .faults import SAVE_FAULT_ENV, WriteFault
from .index import check_files, read_index
from .planner import LoadPlanner, SavePlanner
from .reader import Reader, load_item, read_ahead_own_shard, read_bytes_entry, read_range, read_tensor
from .verify import archive_problem, item_name, verify_directory
from .writer import Writer

__all__ = ["METADATA_FILE", "SAVE_FAULT_ENV", "BouncePool", "CheckpointError", "LoadPlanner", "Obj", "Piece", "Reader",
           "SavePlanner", "Sharded", "WriteFault", "Writer", "archive_problem", "check_files", "check_shape",
           "decode", "dumps", "encode", "first_failure", "gc_paused", "item_name", "load", "load_item", "loads",
           "narrow", "read_ahead_own_shard", "read_bytes_entry", "read_index", "read_range", "read_tensor", "save",
           "verify_directory"]
