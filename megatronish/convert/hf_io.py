"""Hugging Face model directories: ``config.json`` plus ``model.safetensors``, or shards listed in
``model.safetensors.index.json``.

Reading opens each file with ``safetensors.safe_open`` and loads one tensor at a time. Writing streams: the
file layout (header with every tensor's dtype, shape and byte range) is planned first from the shapes alone,
then each tensor's bytes are appended as it arrives, so only the tensor being written is in memory. Files are
in the safetensors format (8-byte little-endian header length, JSON header padded to 8 bytes, raw
little-endian data), read back by ``safetensors`` and ``transformers``.
"""
from __future__ import annotations

import json
import os
import re

import torch

from .hf_config import ConvertError

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FROM_CODE = {v: k for k, v in _DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(s: str | int) -> int:
    """``"5GB"`` / ``"500MiB"`` / ``1000`` -> bytes (HF's ``max_shard_size`` units)."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).upper() not in _UNITS:
        raise ConvertError(f"--max-shard-size {s!r}: give a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class HFReader:
    """Tensors of a HF model directory, one at a time."""

    def __init__(self, path: str, flag: str = "--load-dir"):
        """``flag``: the command-line flag that named ``path`` (for the error lines)."""
        self.path = path
        cfg = os.path.join(path, CONFIG)
        if not os.path.isfile(cfg):
            raise ConvertError(f"{flag} {path}: no {CONFIG} there; give a Hugging Face model directory")
        try:
            with open(cfg) as f:
                self.config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{flag} {path}: cannot read {cfg} ({e}); give a Hugging Face model "
                               "directory with a valid config.json") from None
        if not isinstance(self.config, dict):
            raise ConvertError(f"{flag} {path}: {cfg} is not a JSON object")
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.file_of = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConvertError(f"{flag} {path}: cannot read the weight map of {index} ({e!r})") from None
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.file_of = {k: SINGLE for k in f.keys()}
        else:
            raise ConvertError(f"{flag} {path}: neither {SINGLE} nor {INDEX}; save the model with "
                               "safe_serialization (pytorch_model.bin is not read)")
        self._open: dict = {}
        self.bytes_read = 0  # data bytes handed out by read()

    def names(self) -> list[str]:
        return list(self.file_of)

    def _handle(self, fname: str):
        if fname not in self._open:
            from safetensors import safe_open

            full = os.path.join(self.path, fname)
            if not os.path.isfile(full):
                raise ConvertError(f"{full}: missing shard (listed in {INDEX})")
            self._open[fname] = safe_open(full, "pt")
        return self._open[fname]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(name)
        self._handle(self.file_of[name])  # checks that the shard exists
        from safetensors import safe_open

        # A fresh handle per tensor: pages of the memory-mapped file read through a long-lived handle stay
        # mapped (and counted in the resident size) until it closes; this keeps them to about one tensor.
        with safe_open(os.path.join(self.path, self.file_of[name]), "pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Only the elements of tensor ``name`` at ``index`` (one slice per leading dimension): ``safe_open``'s
        ``get_slice`` reads just their bytes. The files stay open until :meth:`close`."""
        t = self._handle(self.file_of[name]).get_slice(name)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def dtype(self, name: str) -> torch.dtype:
        code = self._handle(self.file_of[name]).get_slice(name).get_dtype()
        return _FROM_CODE[code]

    def close(self) -> None:
        self._open.clear()


def safetensors_header(tensors: list[tuple[str, tuple[int, ...], torch.dtype, int, int]]) -> bytes:
    """The start of a safetensors file holding ``[(name, shape, dtype, begin, end)]`` (byte ranges of its data
    part): the 8-byte little-endian header length and the JSON header, padded to 8 bytes. The data follows."""
    header = {name: {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [b, e]}
              for name, shape, dtype, b, e in tensors}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class HFWriter:
    """Stream tensors into safetensors files planned from ``[(name, shape, dtype)]`` (in arrival order).

    Files hold at most ``max_shard_size`` bytes of data (a bigger tensor gets a file of its own); one file is
    ``model.safetensors``, more are ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.
    """

    def __init__(self, path: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int):
        self.path = path
        shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            n = torch.Size(shape).numel() * dtype.itemsize
            if shards[-1] and (size + n > max_shard_size or size % dtype.itemsize):
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, size, size + n))
            size += n
        k = len(shards)
        self.files = [SINGLE] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
        self.shards = shards
        self.order = [(i, e) for i, s in enumerate(shards) for e in s]
        self.pos = 0
        self.total = sum(e[4] - e[3] for s in shards for e in s)
        self._f = None
        self._cur = -1
        os.makedirs(path, exist_ok=True)

    def _start(self, i: int) -> None:
        if self._f is not None:
            self._f.close()
        self._f = open(os.path.join(self.path, self.files[i]), "wb")
        self._f.write(safetensors_header(self.shards[i]))
        self._cur = i

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.pos >= len(self.order):
            raise ConvertError(f"unexpected extra tensor {name!r}")
        i, (pname, shape, dtype, b, e) = self.order[self.pos]
        if name != pname or tuple(t.shape) != shape or t.dtype != dtype:
            raise ConvertError(f"tensor {name!r} {list(t.shape)} {t.dtype} arrived where {pname!r} {list(shape)} "
                               f"{dtype} was planned")
        if i != self._cur:
            self._start(i)
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(memoryview(data))
        self.pos += 1

    def close(self, config: dict) -> None:
        if self.pos != len(self.order):
            raise ConvertError(f"only {self.pos} of {len(self.order)} tensors were written")
        if self._f is not None:
            self._f.close()
            self._f = None
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {e[0]: self.files[i] for i, e in self.order}}
            with open(os.path.join(self.path, INDEX), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(self.path, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
