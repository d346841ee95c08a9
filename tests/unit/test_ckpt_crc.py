"""CRC-32C of a mapped buffer through the native library, without copies or the GIL."""

from __future__ import annotations

import mmap
import threading

import google_crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainpod.ckpt import crc
from trainpod.ckpt.crc import extend_buffer


def test_the_native_library_is_found_next_to_google_crc32c() -> None:
    assert crc.native(), "google_crc32c's wheel ships libcrc32c: the checksum would hold the GIL"


@given(st.binary(max_size=20_000), st.data())
def test_any_range_of_a_buffer_checksums_as_google_crc32c_does(
    data: bytes, draw: st.DataObject
) -> None:
    buf = bytearray(data)
    start = draw.draw(st.integers(0, len(buf)))
    stop = draw.draw(st.integers(start, len(buf)))
    seed = draw.draw(st.integers(0, 2**32 - 1))
    assert extend_buffer(seed, buf, start, stop) == google_crc32c.extend(seed, data[start:stop])


def test_a_buffer_checksummed_in_pieces_equals_one_pass() -> None:
    mm = mmap.mmap(-1, 3 << 20)
    mm[: 3 << 20] = bytes(range(256)) * (3 << 12)
    whole = extend_buffer(0, mm)
    part = extend_buffer(extend_buffer(0, mm, 0, 12345), mm, 12345)
    assert whole == part == google_crc32c.value(bytes(mm))
    mm.close()


def test_without_the_native_library_the_value_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = bytearray(b"trainpod" * 5000)
    want = extend_buffer(7, buf, 3)
    monkeypatch.setattr(crc, "_native", lambda: None)
    assert extend_buffer(7, buf, 3) == want


def test_read_only_buffers_are_checksummed_by_copy() -> None:
    data = b"x" * 100_000
    assert extend_buffer(0, memoryview(data)) == google_crc32c.value(data)


def test_another_thread_runs_while_a_large_buffer_is_checksummed() -> None:
    """The native call lets the GIL go: a Python thread counts during it. By count, not by
    time: over 20 passes (~10 ms each here) the other thread gets the GIL in at least one."""
    original = crc._native()
    assert original is not None
    mm = mmap.mmap(-1, 64 << 20)
    stop = threading.Event()
    spun = [0]
    during: list[int] = []

    def count() -> None:
        while not stop.is_set():
            spun[0] += 1

    def watched(c: int, addr: int, n: int) -> int:
        before = spun[0]
        out = int(original(c, addr, n))
        during.append(spun[0] - before)
        return out

    th = threading.Thread(target=count)
    th.start()
    try:
        crc._NATIVE = watched
        for _ in range(20):
            extend_buffer(0, mm)
    finally:
        crc._NATIVE = original
        stop.set()
        th.join()
        mm.close()
    assert max(during) > 0, "no Python ran in another thread during any of the 20 passes"
