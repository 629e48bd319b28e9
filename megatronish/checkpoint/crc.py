"""The CRC-32 of checkpoint archives (zip's polynomial, the value ``zlib.crc32`` gives), from the fastest
implementation installed: ISA-L's (``isal``, a dependency; vectorised, ~5x zlib's speed on this project's CPUs),
else zlib-ng's, else zlib's. Saves checksum every record and loads verify them, so this runs over every byte of a
checkpoint at disk speed."""
from __future__ import annotations

import zlib


def _fastest():
    try:
        from isal import isal_zlib

        return isal_zlib.crc32, "isal"
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        return zlib.crc32, "zlib"


crc32, IMPLEMENTATION = _fastest()
