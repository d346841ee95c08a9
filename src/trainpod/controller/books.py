"""What the controller keeps in memory between heartbeats, per attempt or per node.

Each book is evicted when what it is keyed by ends, so a controller that runs for months
holds only what live jobs and nodes need. Nothing here is durable: what must survive a
restart is in the store (events), and a book refills from the next heartbeats.
"""

from __future__ import annotations

from trainpod.api.models import ChaosOrder, RankBeacon
from trainpod.controller.history import ProgressHistory
from trainpod.controller.progress import Book
from trainpod.controller.stragglers import StragglerTracker


class BeaconBook:
    """Progress beacons by attempt and rank, with the controller time they arrived; the
    jobs' progress over time in ``history`` (the dashboard's curves)."""

    def __init__(self) -> None:
        self.history = ProgressHistory()
        self.by_attempt: dict[int, dict[int, tuple[RankBeacon, float]]] = {}
        self.first_logged: set[int] = set()  # attempts whose first_beacon is in the store
        self.straggling: dict[int, tuple[StragglerTracker, float]] = {}
        self.idle_since: dict[int, dict[int, float]] = {}
        """attempt -> rank -> since when (controller time) the running rank has used no CPU,
        as its agent last measured it (ADR 0049)."""

    def of(self, attempt_id: int) -> Book:
        return self.by_attempt.get(attempt_id, {})

    def record(self, attempt_id: int, beacons: list[RankBeacon], now: float) -> None:
        book = self.by_attempt.setdefault(attempt_id, {})
        for b in beacons:
            book[b.rank] = (b, now)

    def record_idle(self, attempt_id: int, rank: int, idle_s: float | None, now: float) -> None:
        """A running rank's idle time as its agent reported it (None: it works)."""
        if idle_s is None:
            ranks = self.idle_since.get(attempt_id)
            if ranks is not None:
                ranks.pop(rank, None)
            return
        self.idle_since.setdefault(attempt_id, {})[rank] = now - idle_s

    def forget(self, attempt_id: int) -> Book:
        """The attempt ended: drop everything kept for it; returns its last beacons."""
        self.first_logged.discard(attempt_id)
        self.idle_since.pop(attempt_id, None)
        self.straggling.pop(attempt_id, None)
        return self.by_attempt.pop(attempt_id, {})


class ChaosBook:
    """Chaos orders waiting for a node's agent to acknowledge them."""

    def __init__(self) -> None:
        self._pending: dict[str, list[ChaosOrder]] = {}

    def add(self, node: str, order: ChaosOrder) -> None:
        self._pending.setdefault(node, []).append(order)

    def pending(self, node: str) -> list[ChaosOrder]:
        return list(self._pending.get(node, []))

    def acknowledged(self, node: str, done: list[str]) -> None:
        if done and node in self._pending:
            ids = set(done)
            self._pending[node] = [c for c in self._pending[node] if c.id not in ids]
            if not self._pending[node]:
                del self._pending[node]

    def drop(self, node: str) -> None:
        """A new agent instance: the orders were for the old one (a kill-agent order must
        not kill its replacement)."""
        self._pending.pop(node, None)
