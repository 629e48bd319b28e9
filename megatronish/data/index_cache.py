"""On-disk cache of dataset index arrays, named by the md5 of the dataset's JSON description.

Files: ``{md5}-{Class}-{split}-description.txt`` and ``{md5}-{Class}-{split}-{name}.npy``. Each
``.npy`` is written under a temporary name and renamed, and the description is written last, so
a cache hit (every file present) never sees a half-written array. Hits are memory-mapped.

Arrays are read with ``allow_pickle=False`` (a file planted in a shared ``--data-cache-path`` cannot run code).
A hit whose description file does not hold this dataset's description, whose arrays do not load as plain numeric
arrays, or that the caller's ``check`` rejects is named in a warning and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from typing import Callable, Optional, Sequence, Tuple

import numpy

from ..errors import ConfigError

__all__ = ["IndexCache"]


class IndexCache:
    def __init__(self, directory: Optional[str], base: str, description: str, digest: str) -> None:
        self.directory = directory
        self.base = base
        self.description = description
        self.hash = digest

    @classmethod
    def for_description(cls, directory: Optional[str], class_name: str, split_name: str, identifiers) -> "IndexCache":
        description = json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
        digest = hashlib.md5(description.encode("utf-8")).hexdigest()
        return cls(directory, f"{digest}-{class_name}-{split_name}", description, digest)

    def path(self, affix: str) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"{self.base}-{affix}")

    def hit(self, names: Sequence[str]) -> bool:
        if self.directory is None:
            return False
        files = [self.path("description.txt")] + [self.path(f"{n}.npy") for n in names]
        return all(os.path.isfile(f) for f in files)

    def load(self, names: Sequence[str]) -> Tuple[numpy.ndarray, ...]:
        """The cached arrays (memory-mapped); ``ValueError`` naming the file when one is not what was written."""
        with open(self.path("description.txt"), "rb") as f:
            if f.read() != self.description.encode("utf-8"):
                raise ValueError(f"{self.path('description.txt')} does not hold this dataset's description")
        arrays = []
        for n in names:
            path = self.path(f"{n}.npy")
            try:
                arr = numpy.load(path, allow_pickle=False, mmap_mode="r")
            except (ValueError, OSError, EOFError) as err:
                raise ValueError(f"{path} is not a readable index array ({err})") from None
            if not isinstance(arr, numpy.ndarray) or arr.dtype.kind not in "iu":
                raise ValueError(f"{path} does not hold integers")
            arrays.append(arr)
        return tuple(arrays)

    def load_or_build(self, names: Sequence[str], build: Callable[[], Tuple[numpy.ndarray, ...]],
                      check: Optional[Callable[[Tuple[numpy.ndarray, ...]], Optional[str]]] = None):
        """The cached arrays when present and sound (``check(arrays)`` returns a problem or None), else
        ``build()``'s, written to the cache."""
        if self.hit(names):
            try:
                arrays = self.load(names)
                problem = check(arrays) if check is not None else None
            except ValueError as err:
                problem = str(err)
            if problem is None:
                return arrays
            sys.stderr.write(f"WARNING: dataset index cache {self.path('*')} in --data-cache-path does not match "
                             f"its description ({problem}); rebuilding it\n")
        arrays = build()
        if self.directory is not None:
            self._save(names, arrays)
        return arrays

    def _save(self, names: Sequence[str], arrays: Sequence[numpy.ndarray]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name, arr in zip(names, arrays):
                self._atomic_write(f"{name}.npy", lambda f, a=arr: numpy.save(f, a, allow_pickle=False))
            self._atomic_write("description.txt", lambda f: f.write(self.description.encode("utf-8")))
        except OSError as err:
            raise ConfigError(
                f"--data-cache-path: cannot write the dataset index cache in '{self.directory}' ({err}); pass a "
                f"writable directory"
            ) from None

    def _atomic_write(self, affix: str, write) -> None:
        final = self.path(affix)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.base}-{affix}.", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
