"""The scheduling order: priority class, then the team's fair-share standing, then age.

A team's standing is Slurm's classic fair-share factor ``F = 2 ** (-U / S)``: ``U`` its share
of all (decayed) usage, ``S`` its share of the weights. ``F`` is 1 for a team that used
nothing, 0.5 for one that used exactly its share, and less the more it used beyond it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from trainpod.scheduler.base import QueuedJob


def standing(usage: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Team -> fair-share factor in (0, 1] for every team in ``weights``."""
    total_usage = sum(max(0.0, u) for u in usage.values())
    total_weight = sum(weights.values())
    out: dict[str, float] = {}
    for team, weight in weights.items():
        if total_usage <= 0 or total_weight <= 0:
            out[team] = 1.0
            continue
        used = max(0.0, usage.get(team, 0.0)) / total_usage
        share = weight / total_weight
        out[team] = 2.0 ** (-used / share)
    return out


def weights_for(
    configured: Mapping[str, float], queue: Iterable[QueuedJob], usage: Mapping[str, float]
) -> dict[str, float]:
    """The configured weights; with no teams configured, weight 1 for every team seen."""
    if configured:
        return dict(configured)
    seen = {q.team for q in queue} | set(usage)
    return {team: 1.0 for team in sorted(seen)}


def order(queue: Sequence[QueuedJob], factors: Mapping[str, float]) -> list[QueuedJob]:
    """Highest priority first; then the team that used least relative to its weight; then
    the oldest; then the lowest id. Teams without a factor come last among equals."""
    return sorted(
        queue,
        key=lambda q: (-q.priority, -factors.get(q.team, 0.0), q.submitted_at, q.id),
    )
