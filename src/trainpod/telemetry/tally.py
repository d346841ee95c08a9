"""Counters and histograms folded from the event log, for ``/metrics``.

The log already says everything a counter would count (attempts, faults, checkpoints), so
nothing is counted on the hot paths: at each scrape :meth:`EventTally.fold` reads the
events appended since the last one (by id) and adds them in. A restarted controller folds
the whole log again from its first scrape (Prometheus sees a counter reset, which ``rate``
and ``increase`` handle). Events removed by retention before a restart are not counted.

Durations:

* detection: ``fault_detected``'s time minus the fault's own time (``fault_at``);
* recovery: from ``fault_detected`` to the job's next attempt running (``attempt_state``
  -> running), per fault class;
* queue wait: ``job_first_start`` minus the job's submission.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from trainpod.model.events import (
    AttemptCreated,
    AttemptStateChanged,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointSaved,
    CheckpointTierFull,
    FaultDetected,
    JobFirstStart,
    JobStateChanged,
    Recorded,
)
from trainpod.model.states import AttemptState

KINDS = (
    AttemptCreated.kind,
    AttemptStateChanged.kind,
    CheckpointCommitted.kind,
    CheckpointFailed.kind,
    CheckpointSaved.kind,
    CheckpointTierFull.kind,
    FaultDetected.kind,
    JobFirstStart.kind,
    JobStateChanged.kind,
)
"""The kinds :meth:`EventTally.fold` reads (the scan asks the store for these only)."""

DETECTION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECOVERY_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
COMMIT_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SIZE_BUCKETS = tuple(float(2**20 * 4**k) for k in range(11))  # 1 MiB .. 1 TiB
QUEUE_WAIT_BUCKETS = (1.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 10800.0, 43200.0)
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Prometheus' histogram: counts per upper bound (not cumulative here), sum, count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as prometheus_client's HistogramMetricFamily takes them."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append((_le(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


def _le(bound: float) -> str:
    return repr(bound) if bound != int(bound) else f"{bound:.1f}"


@dataclass(frozen=True, slots=True)
class JobMeta:
    """What the metrics label a job's series with (fixed at submission). One is kept for
    every job of the store, so it is small: slots, and its strings interned (a few teams,
    classes, partitions and users are shared by every job): ~160 bytes with its dict slot,
    not ~410 (tracemalloc)."""

    team: str
    priority_class: str
    partition: str
    user: str
    submitted_at: float


UNKNOWN = JobMeta("unknown", "unknown", "unknown", "unknown", 0.0)


@dataclass
class EventTally:
    last_id: int = 0
    attempts: Counter[str] = field(default_factory=Counter)  # team
    restarts: Counter[str] = field(default_factory=Counter)  # team
    faults: Counter[str] = field(default_factory=Counter)  # fault class
    detection: dict[str, Histogram] = field(default_factory=dict)  # fault class
    recovery: dict[str, Histogram] = field(default_factory=dict)  # fault class
    queue_wait: dict[str, Histogram] = field(default_factory=dict)  # partition
    stall: Histogram = field(default_factory=lambda: Histogram(STALL_BUCKETS))
    size: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS))
    commit: dict[str, Histogram] = field(default_factory=dict)  # tier
    failures: Counter[str] = field(default_factory=Counter)  # tier
    full: Counter[str] = field(default_factory=Counter)  # tier found full or unwritable
    _detected: dict[int, tuple[float, str]] = field(default_factory=dict)  # job -> (ts, fault)

    def seed(
        self,
        faults: Iterable[str],
        tiers: Iterable[str],
        partitions: Iterable[str],
        teams: Iterable[str],
    ) -> None:
        """Zero series for the label values known up front, so that ``rate`` and
        ``increase`` see a counter from 0 and a dashboard query has data before the first
        fault, checkpoint or restart."""
        for f in faults:
            self.faults[f] += 0
            _hist(self.detection, f, DETECTION_BUCKETS)
            _hist(self.recovery, f, RECOVERY_BUCKETS)
        for t in tiers:
            self.failures[t] += 0
            self.full[t] += 0
            _hist(self.commit, t, COMMIT_BUCKETS)
        for p in partitions:
            _hist(self.queue_wait, p, QUEUE_WAIT_BUCKETS)
        for team in teams:
            self.attempts[team] += 0
            self.restarts[team] += 0

    def fold(self, events: Sequence[Recorded], meta: Callable[[int], JobMeta]) -> None:
        """Add ``events`` (ids above :attr:`last_id`, in order) to the tallies."""
        for r in events:
            self.last_id = max(self.last_id, r.id)
            e = r.event
            if isinstance(e, AttemptCreated):
                team = meta(e.job_id).team
                self.attempts[team] += 1
                if e.attempt > 1:
                    self.restarts[team] += 1
            elif isinstance(e, FaultDetected):
                fault = e.cause or "unknown"
                self.faults[fault] += 1
                if e.fault_at is not None and r.ts >= e.fault_at:
                    _hist(self.detection, fault, DETECTION_BUCKETS).observe(r.ts - e.fault_at)
                self._detected[e.job_id] = (r.ts, fault)
            elif isinstance(e, AttemptStateChanged):
                if e.new is AttemptState.RUNNING and e.attempt > 1 and e.job_id in self._detected:
                    since, fault = self._detected.pop(e.job_id)
                    _hist(self.recovery, fault, RECOVERY_BUCKETS).observe(max(0.0, r.ts - since))
            elif isinstance(e, JobStateChanged):
                if e.new.ended:
                    self._detected.pop(e.job_id, None)
            elif isinstance(e, JobFirstStart):
                m = meta(e.job_id)
                if m is not UNKNOWN:
                    wait = max(0.0, r.ts - m.submitted_at)
                    _hist(self.queue_wait, m.partition, QUEUE_WAIT_BUCKETS).observe(wait)
            elif isinstance(e, CheckpointSaved):
                if e.stall_s is not None:
                    self.stall.observe(e.stall_s)
                if e.bytes:
                    self.size.observe(float(e.bytes))
            elif isinstance(e, CheckpointCommitted):
                _hist(self.commit, e.tier, COMMIT_BUCKETS).observe(e.seconds)
            elif isinstance(e, CheckpointFailed):
                self.failures[e.tier] += 1
            elif isinstance(e, CheckpointTierFull):
                self.full[e.tier] += 1


def _hist(table: dict[str, Histogram], key: str, buckets: tuple[float, ...]) -> Histogram:
    h = table.get(key)
    if h is None:
        h = table[key] = Histogram(buckets)
    return h
