"""Counting the steps a slow tier skips.

A copy tier (scratch, peer, durable) always takes the newest step committed in the primary
(memory) tier when it is free; the steps committed meanwhile are never copied to it. That
is by design (a tier slower than the saves must not hold training back, nor fall further
and further behind), but it should be visible: :class:`SkipTally` counts, per tier, the
primary-tier steps that tier never got because a newer one went instead. The pipeline's
copier and the agent's persister each keep one; the counts are in ``Progress.steps_skipped``,
the persister's status, and each ``checkpoint_committed`` event (``skipped``: since the
tier's previous commit).
"""

from __future__ import annotations

import bisect

MAX_TRACKED = 4096
"""Primary-tier steps remembered for tiers that have not caught up (oldest dropped first)."""


class SkipTally:
    """Not thread-safe: call it under the caller's lock."""

    def __init__(self, tiers: list[str] | None = None) -> None:
        self._steps: list[int] = []  # primary-tier steps, sorted, distinct
        self._last: dict[str, int] = {}  # tier -> its newest committed step
        self.totals: dict[str, int] = {}
        """Tier -> steps it skipped so far."""
        self.watch(tiers or [])

    def watch(self, tiers: list[str]) -> None:
        """Count for ``tiers`` too (steps are kept until every watched tier is past them)."""
        for t in tiers:
            self.totals.setdefault(t, 0)

    def offered(self, step: int) -> None:
        """``step`` was committed in the primary tier."""
        i = bisect.bisect_left(self._steps, step)
        if i < len(self._steps) and self._steps[i] == step:
            return
        self._steps.insert(i, step)
        if len(self._steps) > MAX_TRACKED:
            del self._steps[0]

    def committed(self, tier: str, step: int) -> int:
        """``tier`` committed ``step``: how many primary-tier steps it skipped since its
        previous commit (they are added to :attr:`totals`)."""
        self.totals.setdefault(tier, 0)
        prev = self._last.get(tier)
        if prev is not None and step <= prev:
            return 0
        lo = 0 if prev is None else bisect.bisect_right(self._steps, prev)
        skipped = max(0, bisect.bisect_left(self._steps, step) - lo)
        self.totals[tier] += skipped
        self._last[tier] = step
        if all(t in self._last for t in self.totals):
            floor = min(self._last.values())
            del self._steps[: bisect.bisect_left(self._steps, floor)]
        return skipped

    def rollback(self, step: int) -> None:
        """A later attempt saves ``step`` again: forget what came at or after it."""
        del self._steps[bisect.bisect_left(self._steps, step) :]
        self._last = {t: s for t, s in self._last.items() if s < step}
