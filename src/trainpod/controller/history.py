"""A bounded history of each job's progress, for the dashboard's loss and step-rate curves.

The beacon book keeps only the latest summary per rank; this keeps a ring of points per live
job (one per heartbeat that moved the job's step), by controller time. When a job ends its
ring is evicted and a thinned copy kept (at most ``KEPT_POINTS`` points, for the newest
``KEPT_JOBS`` ended jobs), so a job page still shows its curves after the end and memory
stays bounded however long the controller runs. Nothing here is durable: the
``attempt_progress`` events in the store are the record; a restarted controller's curves
start again from the next beacons.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from trainpod.api.models import RankBeacon

RING_POINTS = 1_000
"""Points kept per live job (a point per heartbeat that moved the step: ~17 min at 1 s)."""
KEPT_POINTS = 200
KEPT_JOBS = 200


@dataclass(frozen=True)
class ProgressPoint:
    t: float
    """Controller time the beacons arrived."""
    attempt: int
    step: int
    loss: float | None
    step_time_s: float | None
    tokens_total: float | None


class ProgressHistory:
    """Not thread-safe: used under the controller's lock."""

    def __init__(self, ring: int = RING_POINTS) -> None:
        self._ring = ring
        self._live: dict[int, deque[ProgressPoint]] = {}
        self._ended: OrderedDict[int, tuple[ProgressPoint, ...]] = OrderedDict()

    def add(self, job_id: int, attempt: int, beacons: list[RankBeacon], now: float) -> None:
        """The ranks' latest summaries (one node's) arrived: a point if the step moved.

        The step is the lowest of the reporting ranks (the one every rank finished); loss
        and tokens come from the lowest rank that reports them (rank 0, usually)."""
        steps = [b.last_step for b in beacons if b.last_step is not None]
        if not steps:
            return
        ring = self._live.setdefault(job_id, deque(maxlen=self._ring))
        step = min(steps)
        if ring and ring[-1].attempt == attempt and ring[-1].step == step:
            return
        ordered = sorted(beacons, key=lambda b: b.rank)
        times = sorted(b.step_time_s for b in ordered if b.step_time_s)
        ring.append(
            ProgressPoint(
                t=now,
                attempt=attempt,
                step=step,
                loss=_first_number(ordered, "loss"),
                step_time_s=times[len(times) // 2] if times else None,
                tokens_total=_first_number(ordered, "tokens_total"),
            )
        )

    def of(self, job_id: int) -> list[ProgressPoint]:
        live = self._live.get(job_id)
        return list(live) if live is not None else list(self._ended.get(job_id, ()))

    def keep_only(self, live_jobs: set[int]) -> None:
        """Jobs not in ``live_jobs`` ended: evict their rings, keep a thinned copy."""
        for job_id in [j for j in self._live if j not in live_jobs]:
            points = list(self._live.pop(job_id))
            stride = max(1, -(-len(points) // KEPT_POINTS))
            kept = points[::stride]
            if points and kept[-1] is not points[-1]:
                kept = [*kept[: KEPT_POINTS - 1], points[-1]]
            self._ended[job_id] = tuple(kept)
            while len(self._ended) > KEPT_JOBS:
                self._ended.popitem(last=False)

    def live_jobs(self) -> int:
        return len(self._live)


def _first_number(beacons: list[RankBeacon], key: str) -> float | None:
    for b in beacons:
        v = b.metrics.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None
