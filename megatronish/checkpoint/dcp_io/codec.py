"""JSON with exact tensors: :class:`~.entries.Obj` values (tensors, numpy arrays, tuples, bytes and
non-string-keyed dicts inside) to and from the bytes stored as a DCP byte entry."""
from __future__ import annotations

import base64
import json

import numpy as np
import torch

from ...errors import CheckpointError


def _tensor_bytes(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()


def encode(x):
    """JSON-able form of ``x``: tensors, numpy arrays, tuples, bytes and non-string-keyed dicts are tagged."""
    if isinstance(x, torch.Tensor):
        return {"__tensor__": str(x.dtype).removeprefix("torch."), "shape": list(x.shape), "b64": _tensor_bytes(x)}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": str(x.dtype), "shape": list(x.shape),
                "b64": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v) for v in x]}
    if isinstance(x, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: encode(v) for k, v in x.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot store a {type(x).__name__} in a checkpoint's JSON state")


def decode(x):
    """Inverse of :func:`encode`."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        dtype = getattr(torch, x["__tensor__"])
        raw = bytearray(base64.b64decode(x["b64"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(x["shape"]).clone()
    if "__ndarray__" in x:
        return np.frombuffer(base64.b64decode(x["b64"]), dtype=np.dtype(x["__ndarray__"])).reshape(x["shape"]).copy()
    if "__tuple__" in x:
        return tuple(decode(v) for v in x["__tuple__"])
    if "__bytes__" in x:
        return base64.b64decode(x["__bytes__"])
    if "__items__" in x:
        return {decode(k): decode(v) for k, v in x["__items__"]}
    return {k: decode(v) for k, v in x.items()}


def dumps(value) -> bytes:
    return json.dumps(encode(value), separators=(",", ":")).encode()


def loads(raw: bytes, what: str):
    try:
        return decode(json.loads(raw.decode()))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON ({e}); the checkpoint file is damaged") from None
