"""CRC-32C of a large writable buffer (a mapped file) without copying it and without the GIL.

``google_crc32c.extend`` takes ``bytes`` only: checksumming a mapping through it costs a copy
of every byte into ``bytes`` objects, under the GIL, and a training thread of the same
process stands still for those copies (the framed file's pass over 1.2 GB held a training
loop at 72-75% of its rate, measured, ADR 0053). The wheel ships the C library it wraps
(``crc32c_extend(crc, data, size)``); called through ``ctypes``, which lets the GIL go for
the call, it reads the buffer where it lies. Where that library cannot be found the
checksum goes through ``google_crc32c`` as before (same value, slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any

import google_crc32c

_PIECE = 8 << 20
_NATIVE: Any = None
_LOOKED = False


def _native() -> Any:
    """``crc32c_extend`` of the library ``google_crc32c`` was built with, or None."""
    global _NATIVE, _LOOKED
    if _LOOKED:
        return _NATIVE
    _LOOKED = True
    libs = Path(google_crc32c.__file__).resolve().parent.parent / "google_crc32c.libs"
    found = sorted(libs.glob("libcrc32c*.so*")) if libs.is_dir() else []
    names = [str(p) for p in found] + [n for n in [ctypes.util.find_library("crc32c")] if n]
    for name in names:
        try:
            fn = ctypes.CDLL(name).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        fn.restype = ctypes.c_uint32
        _NATIVE = fn
        break
    return _NATIVE


def native() -> bool:
    """Whether :func:`extend_buffer` runs without the GIL here."""
    return _native() is not None


def extend_buffer(crc: int, buf: Any, start: int = 0, stop: int | None = None) -> int:
    """``crc`` extended by ``buf[start:stop]``; ``buf`` is a writable buffer (an ``mmap``, a
    ``bytearray``): its address is taken, nothing is copied."""
    view = memoryview(buf).cast("B")
    try:
        stop = len(view) if stop is None else stop
        if stop <= start:
            return crc
        fn = _native()
        if fn is None or view.readonly:
            for at in range(start, stop, _PIECE):
                crc = google_crc32c.extend(crc, bytes(view[at : min(at + _PIECE, stop)]))
            return crc
        arr = (ctypes.c_char * (stop - start)).from_buffer(view, start)
        try:
            return int(fn(crc, ctypes.addressof(arr), stop - start))
        finally:
            del arr
    finally:
        view.release()
