"""``/metrics``: a Prometheus collector that reads the controller's state at scrape time.

Nothing is counted on the hot paths. A scrape takes the controller's lock for a few bulk
reads (nodes, job heads, the events appended since the last scrape, live jobs' events,
energy per job), then builds the families after releasing it
(:mod:`trainpod.telemetry.metrics`). Kept between scrapes: each job's labels (fixed at
submission), the goodput of jobs that ended more than FROZEN_AFTER_S ago (it no longer
changes), and live jobs' goodput, of which one scrape recomputes at most
LIVE_GOODPUT_PER_SCRAPE (new jobs first, then the longest unrefreshed): a bounded cost per
scrape whatever the number of running jobs. Scrapes run one at a time (their own lock).

The first scrapes of a controller with a long history are bounded too: each
spends about CATCH_UP_S folding the event log into the counters and computing ended jobs'
goodput; until the history is worked off, the families it would leave short are left
out. Goodput is computed from :func:`~trainpod.store.scan.job_facts` and the kinds of event
it reads: no job spec is decoded here (the labels come from the raw spec, once per job).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from trainpod.controller import progress
from trainpod.controller.books import BeaconBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.planning import Planner
from trainpod.controller.policy import FaultKind
from trainpod.controller.telemetry import TelemetryBook
from trainpod.controller.views import FROZEN_AFTER_S
from trainpod.model.events import recorded
from trainpod.model.states import JobState
from trainpod.store.energy import IDLE_JOB, Energy, EnergyTotal
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow
from trainpod.store.scan import (
    events_of_jobs,
    events_since,
    job_facts,
    job_labels,
    node_states,
)
from trainpod.telemetry.goodput import KINDS as GOODPUT_KINDS
from trainpod.telemetry.goodput import GoodputReport, compute_goodput
from trainpod.telemetry.metrics import EnergySum, JobLive, Scrape, Sums, families
from trainpod.telemetry.tally import KINDS, UNKNOWN, EventTally, JobMeta

TIERS = ("memory", "scratch", "peer", "durable")  # trainpod.ckpt's tiers
LIVE_GOODPUT_PER_SCRAPE = 100
"""Live jobs whose goodput one scrape recomputes (each is a read of its events and a walk
of them): at 1,000 live jobs a job's figure is at most ten scrapes old."""
EVENTS_CHUNK = 2_000
"""Events of the log folded into the counters in one read of the store."""
BURST = 50_000
"""Once caught up, the most events one scrape folds (a burst beyond it is counted a scrape
late, never hidden)."""
ENDED_CHUNK = 25
"""Ended jobs whose goodput is computed (once, then kept) in one read of the store."""
CATCH_UP_S = 0.15
"""What a scrape spends on the history it found at the start, at least a chunk of each: it
folds the event log into the counters, then computes ended jobs' goodput (some 0.5 ms a job
on a 2-core box), a chunk at a time until this long has passed. A restarted controller's
history is worked off over its first scrapes; until then the families it would show short
are left out (the counters until the log is folded, team and cluster goodput until every
ended job's is in), never served wrong."""
_WAITING = (JobState.QUEUED, JobState.PREEMPTED)
_LIVE = [s for s in JobState if not s.ended]


@dataclass(frozen=True)
class _Done:
    """An ended job's goodput, kept: it no longer changes."""

    wall_s: float
    productive_s: float
    lost_s: dict[str, float]


class ClusterMetrics(Collector):
    def __init__(
        self,
        store: Store,
        cfg: ControllerConfig,
        lock: threading.RLock,
        beacons: BeaconBook,
        telemetry: TelemetryBook,
        planner: Planner,
        now: Callable[[], float],
        *,
        events_chunk: int = EVENTS_CHUNK,
        ended_chunk: int = ENDED_CHUNK,
        catch_up_s: float = CATCH_UP_S,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if events_chunk < 1 or ended_chunk < 1:
            raise ValueError(
                f"events_chunk ({events_chunk}) and ended_chunk ({ended_chunk}) must be at least 1"
            )
        self.events_chunk = events_chunk
        self.ended_chunk = ended_chunk
        self.catch_up_s = catch_up_s
        self._timer = timer
        self.store = store
        self.cfg = cfg
        self._lock = lock
        self.beacons = beacons
        self.telemetry = telemetry
        self.planner = planner
        self._now = now
        self._scrape_lock = threading.Lock()
        self.last: Scrape | None = None
        """What the last :meth:`collect` served (whether it was behind, for instance)."""
        self._meta: dict[int, JobMeta] = {}
        self._counted: set[int] = set()
        """Ended jobs whose goodput is in the sums below (it no longer changes)."""
        self._ended_teams: dict[str, Sums] = {}
        self._ended_total = Sums()
        self._folded = False  # the counters have folded the log they found at the start
        self._caught_up = False  # every ended job found at the start is in the sums
        self._running: dict[int, tuple[float, _Done]] = {}
        """Live jobs' goodput and when it was computed (refreshed a bounded few a scrape)."""
        self.tally = EventTally()
        self.tally.seed(
            [f.value for f in FaultKind],
            TIERS,
            cfg.partitions,
            ["none", *(t.name for t in cfg.teams)],
        )

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not run a scrape

    def collect(self) -> Iterable[Metric]:
        with self._scrape_lock:
            self.last = self.scrape()
            return families(self.last)

    def scrape(self) -> Scrape:
        now = self._now()
        with self._lock:
            nodes = node_states(self.store)
            heads = self.store.job_heads()
            self._learn(job_labels(self.store, [j for j, *_ in heads if j not in self._meta]))
            waiting = self.store.jobs(list(_WAITING))
            energy = Energy(self.store).per_job()
            for job_id, (joules, sim) in self.telemetry.unflushed_by_job().items():
                old = energy.get(job_id, EnergyTotal(0.0, False))
                energy[job_id] = EnergyTotal(old.joules + joules, old.simulated or sim)
            devices = self.telemetry.latest()
            passes = self.planner.passes
            attempts = {a.job_id: a.id for a in self.store.active_attempts()}
        catch_up = self._timer()
        folding = self._fold(catch_up)
        live_ids = [j for j, state, _, _ in heads if not state.ended]
        refresh = self._due(live_ids)
        ended = [
            (j, ended_at)
            for j, state, _, ended_at in heads
            if state.ended and j not in self._counted and ended_at is not None
        ]
        # Jobs that ended lately may still change: computed each scrape, not kept.
        recent_ids = [j for j, at in ended if now - at <= FROZEN_AFTER_S]
        recent = self._goodput(refresh + recent_ids, now)
        for job_id in refresh:
            if (d := recent.pop(job_id, None)) is not None:
                self._running[job_id] = (now, d)
        frozen = [j for j, at in ended if now - at > FROZEN_AFTER_S]
        backlog = self._count_ended(frozen, now, catch_up)
        live = [self._live(j, energy, attempts) for j in live_ids if j in self._running]
        teams = {team: sums.copy() for team, sums in self._ended_teams.items()}
        total = self._ended_total.copy()
        for job_id, d in recent.items():
            self._add(teams, total, self.meta(job_id).team, d)
        for j in live:
            self._add(teams, total, j.team, _Done(j.wall_s, j.productive_s, j.lost_s))
        team_energy, cluster_energy, idle_energy = self._energy(energy)
        return Scrape(
            cluster=self.cfg.cluster,
            backend=self.cfg.backend,
            g_per_kwh=self.cfg.carbon.g_per_kwh,
            carbon_source=self.cfg.carbon.source,
            nodes=nodes,
            jobs=self._job_counts(heads),
            queue=self._queue(waiting, now),
            live=live,
            teams=teams,
            cluster_sums=total,
            devices=devices,
            tally=self.tally,
            passes=passes,
            team_energy=team_energy,
            cluster_energy=cluster_energy,
            idle_energy=idle_energy,
            tally_behind=folding,
            goodput_behind=backlog,
        )

    # -- pieces ---------------------------------------------------------------------------
    def _goodput(self, job_ids: list[int], now: float) -> dict[int, _Done]:
        """These jobs' goodput now, from their records and the kinds of event it reads."""
        with self._lock:
            events = events_of_jobs(self.store, job_ids, GOODPUT_KINDS)
            facts = job_facts(self.store, job_ids)
        return {job.id: _done(compute_goodput(job, events[job.id], now)) for job in facts}

    def _fold(self, start: float) -> bool:
        """Fold the events appended since the last scrape into the counters; returns whether
        they are still folding the log they found at the start (then they are left out):
        ``events_chunk`` at a time, at least one chunk, until ``catch_up_s`` since
        ``start``. Once caught up, up to BURST a scrape (more is counted a scrape late)."""
        while True:
            limit = self.events_chunk if not self._folded else BURST
            with self._lock:
                rows = events_since(self.store, self.tally.last_id, KINDS, limit)
                new = {r.job_id for r in rows if r.job_id is not None} - self._meta.keys()
                self._learn(job_labels(self.store, sorted(new)))  # submitted since the heads
            self.tally.fold([recorded(r) for r in rows], self.meta)
            if len(rows) < limit:
                self._folded = True
                return False
            if self._folded or self._timer() - start >= self.catch_up_s:
                return not self._folded

    def _count_ended(self, job_ids: list[int], now: float, start: float) -> int:
        """Add ended jobs' goodput to the kept sums, ``ended_chunk`` at a time until
        ``catch_up_s`` since ``start`` (at least one chunk), or all of them once the history
        found at the start is worked off (then they are the few that ended a minute ago,
        and a job left for later would be missing from the sums); returns how many are
        left."""
        done = 0
        budget = self.catch_up_s if not self._caught_up else float("inf")
        while done < len(job_ids) and (done == 0 or self._timer() - start < budget):
            chunk = job_ids[done : done + self.ended_chunk]
            for job_id, d in self._goodput(chunk, now).items():
                self._counted.add(job_id)
                self._add(self._ended_teams, self._ended_total, self.meta(job_id).team, d)
            done += len(chunk)
        self._caught_up = self._caught_up or done == len(job_ids)
        return len(job_ids) - done

    def meta(self, job_id: int) -> JobMeta:
        return self._meta.get(job_id, UNKNOWN)

    def _learn(
        self, rows: Sequence[tuple[int, float, str | None, str | None, str | None, str | None]]
    ) -> None:
        for job_id, submitted_at, team, priority_class, partition, user in rows:
            self._meta[job_id] = JobMeta(
                team=sys.intern(team or "none"),
                priority_class=sys.intern(priority_class or "none"),
                partition=sys.intern(partition or self.cfg.default_partition),
                user=sys.intern(user or ""),
                submitted_at=submitted_at,
            )

    def _job_counts(
        self, heads: list[tuple[int, JobState, float, float | None]]
    ) -> dict[tuple[JobState, str, str, str], int]:
        counts: dict[tuple[JobState, str, str, str], int] = {}
        for job_id, state, _, _ in heads:
            m = self.meta(job_id)
            key = (state, m.team, m.priority_class, m.partition)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def _queue(self, waiting: list[JobRow], now: float) -> dict[str, tuple[int, float]]:
        out = {p: (0, 0.0) for p in self.cfg.partitions}
        for job in waiting:
            if job.held_by:
                continue
            part = self.meta(job.id).partition
            n, oldest = out.get(part, (0, 0.0))
            out[part] = (n + 1, max(oldest, now - job.submitted_at))
        return out

    def _due(self, live_ids: list[int]) -> list[int]:
        """The live jobs whose goodput this scrape computes: every one not computed yet, then
        the longest-computed ones, LIVE_GOODPUT_PER_SCRAPE in all (forgets ended jobs)."""
        live = set(live_ids)
        for gone in set(self._running) - live:
            del self._running[gone]
        new = [j for j in live_ids if j not in self._running]
        room = max(0, LIVE_GOODPUT_PER_SCRAPE - len(new))
        known = sorted(self._running, key=lambda j: self._running[j][0])
        return new + known[:room]

    def _live(
        self, job_id: int, energy: dict[int, EnergyTotal], attempts: dict[int, int]
    ) -> JobLive:
        _, done = self._running[job_id]
        attempt = attempts.get(job_id)
        book = self.beacons.of(attempt) if attempt is not None else {}
        summary = progress.summarise(book)
        tokens = [b.metrics.get("tokens_total") for b, _ in book.values()]
        rank0 = book.get(0)
        loss = rank0[0].metrics.get("loss") if rank0 is not None else None
        e = energy.get(job_id, EnergyTotal(0.0, False))
        return JobLive(
            job_id=job_id,
            team=self.meta(job_id).team,
            wall_s=done.wall_s,
            productive_s=done.productive_s,
            lost_s=done.lost_s,
            step=summary.get("last_step"),
            step_time_s=summary.get("step_time_s"),
            tokens=sum(float(t) for t in tokens if isinstance(t, int | float)) if book else None,
            loss=float(loss) if isinstance(loss, int | float) else None,
            energy_j=e.joules,
            simulated=e.simulated,
        )

    def _energy(
        self, energy: dict[int, EnergyTotal]
    ) -> tuple[dict[str, EnergySum], EnergySum, EnergySum]:
        """Per team, the whole cluster, and idle devices (job 0)."""
        teams: dict[str, EnergySum] = {}
        total, sim_any = 0.0, False
        for job_id, e in energy.items():
            total += e.joules
            sim_any = sim_any or e.simulated
            if job_id == IDLE_JOB:
                continue
            team = self.meta(job_id).team
            old = teams.get(team, EnergySum(0.0, False))
            teams[team] = EnergySum(old.joules + e.joules, old.simulated or e.simulated)
        idle = energy.get(IDLE_JOB, EnergyTotal(0.0, False))
        return teams, EnergySum(total, sim_any), EnergySum(idle.joules, idle.simulated)

    @staticmethod
    def _add(teams: dict[str, Sums], total: Sums, team: str, d: _Done) -> None:
        teams.setdefault(team, Sums()).add(d.wall_s, d.productive_s, d.lost_s)
        total.add(d.wall_s, d.productive_s, d.lost_s)


def _done(report: GoodputReport) -> _Done:
    return _Done(report.wall_s, report.buckets.get("productive", 0.0), report.lost_by_cause)
