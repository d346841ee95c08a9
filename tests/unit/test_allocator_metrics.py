"""The process's native memory by holder (glibc's heaps, mapped chunks, SQLite), as /metrics
serves it: read for real from this process, on this glibc."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from trainpod.telemetry.allocator import AllocatorMetrics, _mallinfo2, _sqlite_memory_used
from trainpod.telemetry.exposition import render


def values() -> dict[str, float]:
    text = render(AllocatorMetrics().collect()).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.labels.get("kind", s.name)] = s.value
    return out


def test_a_large_allocation_shows_as_mapped_and_goes_when_freed() -> None:
    before = values()
    block = bytearray(64 * 2**20)  # above glibc's mmap threshold: a chunk of its own
    during = values()
    del block
    after = values()
    assert during["mmap"] - before["mmap"] >= 64 * 2**20
    assert after["mmap"] < during["mmap"] - 60 * 2**20
    assert min(during["in_use"], during["free"]) >= 0


def test_sqlite_memory_is_the_library_pythons_sqlite3_uses() -> None:
    before = values()["trainpod_process_sqlite_memory_bytes"]
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 1000,)] * 2000)
    during = values()["trainpod_process_sqlite_memory_bytes"]
    conn.close()
    assert during - before > 1_000_000  # the in-memory database's pages, at least


def test_sqlite_is_left_out_when_no_sqlite_library_is_mapped(tmp_path: Path) -> None:
    """A Python that carries SQLite inside its module maps no libsqlite3: no figure, rather
    than another copy's zero."""
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert _sqlite_memory_used(maps) is None
    assert _sqlite_memory_used() is not None  # here: Debian's shared libsqlite3


def test_malloc_is_left_out_when_another_allocator_replaces_glibc_s(tmp_path: Path) -> None:
    """Under ``LD_PRELOAD=libjemalloc.so.2`` glibc's mallinfo2 describes heaps nobody uses
    (it read 0 throughout a 30-minute soak): no figure rather than a wrong one."""
    maps = tmp_path / "maps"
    libc = "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    maps.write_text(libc)
    assert _mallinfo2(maps) is not None
    maps.write_text(
        libc + "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    )
    assert _mallinfo2(maps) is None
