"""A cache bounded by the bytes its values take, not by how many there are.

The controller keeps caches of one entry per job (the views' decoded specs and ended jobs'
JSON) or per distinct orders (sealed orders, their encoded replies). A bound by count alone
holds whatever the entries weigh: a hundred thousand specs of ~0.5 KB each are ~370 MB
decoded, and one job with a large ``env`` makes orders that weigh what a hundred others do.
Here every value comes with its (estimated) size, and the oldest entries go once the sum
passes ``max_bytes``: the newest are kept, which are the ones asked for again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteBoundedCache(Generic[K, V]):
    """Values by key, kept in insertion order, their sizes summed to at most ``max_bytes``
    (a value larger than that on its own is not kept). Safe to share between threads."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0
        """Entries let go to stay under ``max_bytes`` (replaced ones are not counted)."""

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` (of ``size`` bytes) as the newest entry, letting the oldest go
        while the sum is over the bound."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self._bytes += size
            self._evict()

    def resize(self, max_bytes: int) -> None:
        """A new bound; the oldest entries go at once while the sum is over it."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, not {max_bytes}")
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            _, (_, gone) = self._entries.popitem(last=False)
            self._bytes -= gone
            self.evicted += 1

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """The sum of the kept values' sizes."""
        return self._bytes
