"""The checkpoint CRC-32 (``megatronish.checkpoint.crc``) is zip's: equal to ``zlib.crc32`` on any bytes, whole or
folded chunk by chunk, and the fast implementation is the one in use where installed."""
import importlib.util
import os
import zlib

from megatronish.checkpoint import crc


def test_equals_zlib_whole_and_folded():
    data = os.urandom((3 << 20) + 17)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(b"") == zlib.crc32(b"") == 0
    state = 0
    for at in range(0, len(data), 1 << 20):  # folded as the reader does, chunk after chunk
        state = crc.crc32(memoryview(data)[at:at + (1 << 20)], state)
    assert state == zlib.crc32(data)


def test_fastest_installed_is_used():
    want = "isal" if importlib.util.find_spec("isal") else "zlib-ng" if importlib.util.find_spec("zlib_ng") \
        else "zlib"
    assert crc.IMPLEMENTATION == want
