"""Megatron's checkpoint directory layout.

::

    <save>/latest_checkpointed_iteration.txt   "100" (or "release"); written last, atomically
    <save>/iter_0000100/                        one torch.distributed.checkpoint directory
        .metadata                               DCP's index (global shapes, chunks, file offsets)
        __<rank>_0.distcp                       each rank's data
    <save>/release/                             a converted checkpoint (tracker says "release")

The tracker is replaced only after every rank's files of the new iteration are complete (also for
asynchronous saves), so a save that dies half-way is never picked: ``--load <save>`` follows the tracker, and names
the directories such a save left (:func:`incomplete_dirs`) in a warning.
"""
from __future__ import annotations

import os

from .dcp_io import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iter_dir_name(iteration: int | None) -> str:
    """``iter_0000100`` (``release`` for ``None``)."""
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int | None) -> str:
    return os.path.join(root, iter_dir_name(iteration))


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)


def read_tracker(root: str) -> int | None | bool:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt``: an int, ``None`` for "release", or
    ``False`` when there is no tracker. A tracker that names no iteration is an error."""
    path = tracker_path(root)
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return None
    try:
        value = int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number or 'release'; fix or delete "
                              "the file") from None
    if value < 0:
        raise CheckpointError(f"{path} holds {value}; an iteration must be >= 0")
    return value


def write_tracker(root: str, iteration: int | None) -> None:
    """Atomically point ``root``'s tracker at ``iteration`` (``None``: release)."""
    os.makedirs(root, exist_ok=True)
    tmp = tracker_path(root) + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(RELEASE if iteration is None else str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker_path(root))


def is_iteration_dir(path: str) -> bool:
    name = os.path.basename(os.path.normpath(path))
    return name == RELEASE or (name.startswith("iter_") and name[5:].isdigit())


def resolve(path: str) -> tuple[str, int | None] | None:
    """``(iteration directory, iteration)`` for a ``--load`` path: a checkpoint root (follow its tracker) or
    an ``iter_XXXXXXX``/``release`` directory itself. ``None`` when the root has no tracker."""
    if is_iteration_dir(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        name = os.path.basename(os.path.normpath(path))
        return path, (None if name == RELEASE else int(name[5:]))
    if not os.path.isdir(path) and not os.path.exists(path):
        return None
    iteration = read_tracker(path)
    if iteration is False:
        return None
    target = checkpoint_dir(path, iteration)
    if not os.path.isdir(target):
        raise CheckpointError(f"{tracker_path(path)} names iteration "
                              f"{RELEASE if iteration is None else iteration}, but {target} does not exist; "
                              "restore that directory or point the tracker at an existing iteration")
    return target, iteration


def incomplete_dirs(root: str, iteration: int | None | bool) -> list[str]:
    """Iteration directories under ``root`` that the tracker (pointing at ``iteration``; False: no tracker) does
    not vouch for: newer than it, or without DCP's ``.metadata`` index. They are what a save that did not finish
    (a killed process, a full disk) leaves; ``--load`` ignores them."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not (name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(path)):
            continue
        it = int(name[5:])
        if it == iteration:
            continue
        newer = iteration is False or (iteration is not None and it > iteration)
        if newer or not os.path.isfile(os.path.join(path, ".metadata")):
            out.append(path)
    return out


def is_hf_model_dir(path: str | None) -> bool:
    """Whether ``path`` is a Hugging Face model directory (``config.json`` beside ``model.safetensors`` or
    ``model.safetensors.index.json``) rather than one of our checkpoints (no tracker, not an iteration directory)."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(tracker_path(path)):
        return False
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))
