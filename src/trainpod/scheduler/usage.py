"""Teams' past use, decayed: the fair-share input.

Each interval is some nodes held by a team from ``start`` to ``end`` (None: still held).
Use at time ``t`` counts ``2 ** (-(now - t) / half_life)`` of its weight at ``now``, the
continuous form of Slurm's ``PriorityDecayHalfLife``; :func:`decayed_usage` integrates that
exactly over every interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class UsageInterval:
    team: str
    nodes: int
    start: float
    end: float | None = None  # None: still running at ``now``


def decayed_usage(
    intervals: Iterable[UsageInterval], now: float, half_life_s: float
) -> dict[str, float]:
    """Team -> decayed node-seconds as of ``now`` (use after ``now`` does not count yet)."""
    if not half_life_s > 0:
        raise ValueError(f"half_life_s is {half_life_s!r}; give a half-life above 0 seconds")
    rate = math.log(2) / half_life_s
    out: dict[str, float] = {}
    for iv in intervals:
        end = now if iv.end is None else min(iv.end, now)
        if iv.nodes < 0 or (iv.end is not None and iv.end < iv.start):
            raise ValueError(f"bad usage interval {iv}: nodes and length must be 0 or more")
        value = 0.0
        if end > iv.start:
            # integral of nodes * e^(-rate (now - t)) dt from start to end
            value = iv.nodes * (math.exp(-rate * (now - end)) - math.exp(-rate * (now - iv.start)))
            value /= rate
        out[iv.team] = out.get(iv.team, 0.0) + value
    return out
