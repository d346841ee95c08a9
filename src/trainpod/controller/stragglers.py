"""Persistent stragglers: a rank whose step time stays well above its peers'.

Pure functions over the step times the ranks' progress beacons report; the controller's
watchdog evaluates them once per fresh report (:func:`trainpod.controller.progress.stragglers`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping


def find_stragglers(
    step_times: Mapping[int, float], *, factor: float = 1.5, min_peers: int = 2
) -> list[int]:
    """Ranks whose step time exceeds ``factor`` x the median step time of the *other* ranks.

    A rank is judged only against at least ``min_peers`` other ranks (so with two ranks and
    the default, nobody is a straggler: it is not clear which one is slow). Comparing to the
    others' median keeps one slow rank from raising its own bar. Pure; O(n log n); returns
    ranks ascending.
    """
    n = len(step_times)
    if n - 1 < max(min_peers, 1):
        return []
    values = sorted(step_times.values())
    m = n - 1  # size of "the others"
    lo, hi = (m - 1) // 2, m // 2
    out = []
    for rank, v in step_times.items():
        i = bisect.bisect_left(values, v)  # remove one copy of v: others[j] = values[j + (j >= i)]
        others_median = (values[lo + (lo >= i)] + values[hi + (hi >= i)]) / 2
        if others_median > 0 and v > factor * others_median:
            out.append(rank)
    return sorted(out)


class StragglerTracker:
    """Flags a rank once it has been a straggler in ``persistent`` consecutive evaluations.

    A rank is un-flagged (and its streak reset) by the first evaluation in which it is not a
    straggler, or in which it has no step time. Not thread-safe; one per attempt.
    """

    def __init__(self, *, factor: float = 1.5, min_peers: int = 2, persistent: int = 3) -> None:
        if persistent < 1:
            raise ValueError(f"persistent must be >= 1, got {persistent}")
        self.factor = factor
        self.min_peers = min_peers
        self.persistent = persistent
        self._streaks: dict[int, int] = {}

    def update(self, step_times: Mapping[int, float]) -> list[int]:
        """Evaluate once; returns the flagged ranks, ascending."""
        now = set(find_stragglers(step_times, factor=self.factor, min_peers=self.min_peers))
        self._streaks = {r: self._streaks.get(r, 0) + 1 for r in now}
        return self.flagged

    @property
    def flagged(self) -> list[int]:
        """Ranks flagged after the last :meth:`update`, ascending."""
        return sorted(r for r, n in self._streaks.items() if n >= self.persistent)
