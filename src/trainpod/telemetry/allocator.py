"""A process's native memory by who holds it, for ``/metrics``: the controller runs for
months, and its resident memory alone does not say whether it grows because of objects it
keeps, memory the C allocator keeps after peaks, or SQLite (ADR 0045).

* glibc's allocator (``mallinfo2``, glibc 2.33 and later): bytes in use in its heaps, bytes
  free but kept there (fragmentation, or room for the next peak), and bytes in chunks it
  mapped on their own (large allocations, returned at once when freed);
* SQLite's own allocations (``sqlite3_memory_used``) in the library Python's ``sqlite3``
  module loaded (its page cache, statements, temporary B-trees), found among the process's
  mapped files.

Each family is left out where it cannot be read (another C library, an allocator put in
glibc's place such as jemalloc through ``LD_PRELOAD``, a Python whose SQLite is linked in
statically): a missing series, never a wrong zero.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes of the heaps (sbrk and mmapped arenas)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in chunks mapped on their own
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the heaps
            "fordblks",  # bytes free in the heaps
            "keepcost",
        )
    ]


_OTHER_MALLOCS = ("libjemalloc", "libtcmalloc", "libmimalloc")
"""Allocators that replace glibc's malloc when mapped (``LD_PRELOAD``): glibc's mallinfo2
would then describe heaps nobody uses."""


def _mapped(maps: Path) -> set[str] | None:
    """The files this process has mapped (None: unreadable)."""
    try:
        return {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    except OSError:
        return None


def _mallinfo2(maps: Path = Path("/proc/self/maps")) -> Callable[[], _MallInfo2] | None:
    mapped = _mapped(maps)
    if mapped is None or any(Path(p).name.startswith(_OTHER_MALLOCS) for p in mapped):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


def _sqlite_memory_used(maps: Path = Path("/proc/self/maps")) -> Callable[[], int] | None:
    """``sqlite3_memory_used`` of the SQLite library this process has mapped, which Python's
    ``sqlite3`` loaded; None when that module carries SQLite inside itself (no such library
    mapped: another copy's counter would read zero)."""
    import sqlite3  # noqa: F401  (loads its library, if it uses a shared one)

    mapped = _mapped(maps)
    if mapped is None:
        return None
    libs = sorted(p for p in mapped if Path(p).name.startswith("libsqlite3.so"))
    if not libs:
        return None
    try:
        fn = ctypes.CDLL(libs[0]).sqlite3_memory_used
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = []
    return fn


class AllocatorMetrics(Collector):
    """``trainpod_process_malloc_bytes{kind}`` and ``trainpod_process_sqlite_memory_bytes``
    of this process, read at each scrape (a few microseconds: ``mallinfo2`` walks the free
    lists of every arena)."""

    def __init__(self) -> None:
        self._mallinfo = _mallinfo2()
        self._sqlite = _sqlite_memory_used()

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not read anything

    def collect(self) -> Iterable[Metric]:
        if self._mallinfo is not None:
            m = self._mallinfo()
            g = GaugeMetricFamily(
                "trainpod_process_malloc_bytes",
                "The C allocator's memory in this process (glibc mallinfo2): in_use and free "
                "in its heaps (free: kept after peaks), mmap: chunks mapped on their own",
                labels=["kind"],
            )
            g.add_metric(["in_use"], float(m.uordblks))
            g.add_metric(["free"], float(m.fordblks))
            g.add_metric(["mmap"], float(m.hblkhd))
            yield g
        if self._sqlite is not None:
            yield GaugeMetricFamily(
                "trainpod_process_sqlite_memory_bytes",
                "Memory SQLite's library holds in this process (sqlite3_memory_used)",
                value=float(self._sqlite()),
            )
