r"""``torch.save``'s bytes around a tensor's data, without the data (ADR 0053).

A framed file (:mod:`trainpod.ckpt.inplace`) holds each tensor as ``torch.save`` would have
written it: these bytes before and after the data, the data copied in between by the stall.
DCP's reader ``torch.load``\ s exactly those bytes, so it cannot tell the difference.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainpod.ckpt.writefs import zip_crc_off

if TYPE_CHECKING:
    import torch

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
"""A zip local file header (30 bytes): its name and extra-field lengths are the last two."""


@dataclass(frozen=True)
class Framing:
    """What ``torch.save`` writes before and after the data of one contiguous tensor."""

    head: bytes
    nbytes: int
    """The data's length: every element, in the tensor's dtype."""
    tail: bytes

    @property
    def size(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


_FRAMINGS: dict[tuple[str, tuple[int, ...]], Framing | None] = {}
_FRAMINGS_LOCK = threading.Lock()


def framing(dtype: torch.dtype, shape: Sequence[int]) -> Framing | None:
    """``torch.save``'s bytes around the data of a contiguous ``shape`` tensor of ``dtype``,
    as it writes them with the zip CRCs off (the file's CRC-32C covers them; ADR 0048).
    None when its data is not one stored record of that length (no elements, say): such a
    tensor is written as DCP writes it. Cached per dtype and shape; the first call runs
    ``torch.save`` once, into a writer that keeps all but the data (whose pages are never
    touched: a large tensor costs no memory here)."""
    import torch

    key = (str(dtype), tuple(int(n) for n in shape))
    with _FRAMINGS_LOCK:
        if key in _FRAMINGS:
            return _FRAMINGS[key]
    try:
        blank = torch.empty(key[1], dtype=dtype)  # its bytes are passed over, never read
        nbytes = blank.numel() * blank.element_size()
        rec = _Recorder(nbytes if nbytes >= _LARGE else None)
        with zip_crc_off():
            torch.save(blank if rec.skip is not None else torch.zeros_like(blank), rec)
        del blank
        found = _split(rec, nbytes)
    except (RuntimeError, TypeError, ValueError, zipfile.BadZipFile):  # a dtype torch.save
        found = None  # or zipfile does not take as expected: written as DCP writes it
    with _FRAMINGS_LOCK:
        _FRAMINGS[key] = found
    return found


_LARGE = 1 << 20
"""A record this long is the tensor's data: the zip headers and the pickled tensor are a
few hundred bytes."""


class _Recorder:
    """What ``torch.save`` writes (a file-like object it writes into), less one chunk of
    ``skip`` bytes (the data of a large tensor), whose place is noted instead."""

    def __init__(self, skip: int | None) -> None:
        self.skip = skip
        self.parts: list[bytes] = []
        self.size = 0
        self.at: list[int] = []
        """Where chunks of ``skip`` bytes were written (one, for a plain tensor)."""

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n == self.skip:
            self.at.append(self.size)
            self.parts.append(b"")
        else:
            self.parts.append(bytes(view))
        self.size += n
        return n

    def flush(self) -> None:
        pass


class _Sparse(io.RawIOBase):
    """A read-only file of ``head``, ``gap`` zero bytes, ``tail``: enough for ``zipfile``
    to read the directory of a zip whose largest record was not kept."""

    def __init__(self, head: bytes, gap: int, tail: bytes) -> None:
        self._head, self._gap, self._tail = head, gap, tail
        self._size = len(head) + gap + len(tail)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        out = bytearray(n)
        for start, chunk in ((0, self._head), (len(self._head) + self._gap, self._tail)):
            lo, hi = max(self._pos, start), min(self._pos + n, start + len(chunk))
            if lo < hi:
                out[lo - self._pos : hi - self._pos] = chunk[lo - start : hi - start]
        view[:n] = out
        self._pos += n
        return n


def _split(rec: _Recorder, nbytes: int) -> Framing | None:
    if nbytes == 0:
        return None
    raw = b"".join(rec.parts)
    if rec.skip is None:  # small: kept whole, data included
        at = _data_offset(io.BytesIO(raw), nbytes)
        if at is None or at + nbytes > len(raw):
            return None
        return Framing(raw[:at], nbytes, raw[at + nbytes :])
    if len(rec.at) != 1:
        return None
    head, tail = raw[: rec.at[0]], raw[rec.at[0] :]
    at = _data_offset(_Sparse(head, nbytes, tail), nbytes)
    return Framing(head, nbytes, tail) if at == rec.at[0] else None


def _data_offset(f: io.IOBase, nbytes: int) -> int | None:
    """Where the data of the zip's one storage record starts (64-byte aligned, stored, of
    ``nbytes``); None when the zip is not that."""
    with zipfile.ZipFile(f) as z:
        # The storages' records are ``<archive>/data/<key>``: one for a plain tensor.
        records = [i for i in z.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
    if len(records) != 1:
        return None
    rec = records[0]
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != nbytes:
        return None
    f.seek(rec.header_offset)
    fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    at = rec.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    return at if at % 64 == 0 else None
