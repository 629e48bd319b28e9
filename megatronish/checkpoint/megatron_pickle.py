"""Megatron-LM's pickles read without running their code: ``torch.load(weights_only=True)`` with an allow-list
(:func:`safe_load`); objects outside it come back as :class:`Opaque` stand-ins, Megatron's enums as
:class:`EnumValue` s."""
from __future__ import annotations

import argparse
import io

import torch

from .dcp_io import CheckpointError


class Opaque:
    """Stands in for an allowed object whose content is not needed here (RNG states' numpy arrays, Transformer
    Engine's extra state): accepts any arguments and state, keeps nothing, runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __reduce__(self):
        return (Opaque, ())


class EnumValue:
    """Stands in for a Megatron enum member (``AttnBackend.auto`` and the like) without importing Megatron."""

    def __init__(self, value=None):
        self.value = value

    def __setstate__(self, state):
        pass

    def __repr__(self):
        return f"EnumValue({self.value!r})"


_OPAQUE_MODULES = ("numpy", "transformer_engine")  # and io's BytesIO alone (a file opener is refused)
# Megatron's enums that its args and common state hold (AttnBackend in args, RerunMode/RerunState in the rerun
# state machine's common state, ...), read as their values without importing Megatron
MEGATRON_ENUMS = frozenset((
    "AttnBackend", "AttnMaskType", "AttnType", "ModelType", "LayerType", "Fp8Recipe", "Fp4Recipe", "CudaGraphScope",
    "RerunMode", "RerunState", "RerunDiagnostic", "RerunValidationStatus", "TransformerEngineConfigType",
    "ShardingStrategy", "DType", "StrictHandling"))


def _allowed(name: str):
    """What a global named in a Megatron checkpoint is loaded as, or None (refused)."""
    if name == "argparse.Namespace":
        return argparse.Namespace
    if name in ("_io.BytesIO", "io.BytesIO"):
        return Opaque
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] in _OPAQUE_MODULES:
        return Opaque
    if module.startswith("megatron.") and attr in MEGATRON_ENUMS:
        return EnumValue
    return None


def safe_load(source, where: str):
    """``torch.load(weights_only=True)`` of a Megatron file (path or bytes) with an allow-list of exactly what such
    files hold: ``argparse.Namespace`` (the args), Megatron's enums (as :class:`EnumValue`), and numpy / I/O objects
    of RNG and extra states (as :class:`Opaque`, content dropped). Anything else is refused, naming it."""
    f = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as e:
        raise CheckpointError(f"cannot read {where}: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None
    allow = []
    for name in names:
        obj = _allowed(name)
        if obj is None:
            raise CheckpointError(f"{where} holds a {name} object, which is not among the types Megatron checkpoints "
                                  "hold; refusing to unpickle it")
        allow.append(obj if obj is argparse.Namespace else (obj, name))
    if hasattr(f, "seek"):
        f.seek(0)
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(f, map_location="cpu", weights_only=True, mmap=isinstance(f, str))
    except Exception as e:
        raise CheckpointError(f"cannot read {where}: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None
