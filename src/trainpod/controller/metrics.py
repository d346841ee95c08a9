"""``/metrics``: a Prometheus collector that reads the controller's state at scrape time.

Nothing is counted on the hot paths. A scrape takes the controller's lock for a few bulk
reads (nodes, job counts by label from an index, live and lately ended jobs, the events
appended since the last scrape, energy aggregates), then builds the families after
releasing it (:mod:`trainpod.telemetry.metrics`). Nothing is kept per job in memory however
long the history (ADR 0043): a job's labels are read for the scrape that needs them, and
the goodput of a job that ended more than FROZEN_AFTER_S ago (it no longer changes) is
computed once and kept in the store (:mod:`trainpod.store.goodput`), its team's sums read
at the first scrape and added to as jobs end. Live jobs' goodput is kept for the few live
jobs, of which one scrape recomputes at most LIVE_GOODPUT_PER_SCRAPE (new jobs first, then
the longest unrefreshed): a bounded cost per scrape whatever the number of running jobs.
Scrapes run one at a time (their own lock).

The first scrapes of a controller are bounded too: each spends about CATCH_UP_S folding
the event log into the counters, and computing the goodput of ended jobs no scrape kept (a
store from before migration 11); until that is worked off, the families it would leave
short are left out. Goodput is computed from :func:`~trainpod.store.scan.job_facts` and the
kinds of event it reads: no job spec is decoded here.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from trainpod.controller import progress
from trainpod.controller.books import BeaconBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.planning import Planner
from trainpod.controller.policy import FaultKind
from trainpod.controller.telemetry import TelemetryBook
from trainpod.controller.views import FROZEN_AFTER_S
from trainpod.errors import StoreUnavailable
from trainpod.model.events import recorded
from trainpod.model.states import JobState
from trainpod.store.energy import IDLE_JOB, Energy, EnergyTotal
from trainpod.store.goodput import EndedGoodput, EndedGoodputRow
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow
from trainpod.store.scan import (
    events_of_jobs,
    events_since,
    job_counts,
    job_facts,
    job_labels,
    node_states,
    recently_ended,
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
"""Ended jobs whose goodput is computed (once, then kept in the store) in one read of it."""
ENDED_MARGIN_S = 300.0
"""How far before the last scrape's cutoff a scrape looks again for ended jobs not kept yet:
a wall clock set back by less than this loses none."""
CATCH_UP_S = 0.15
"""What a scrape spends on the history it found at the start, at least a chunk of each: it
folds the event log into the counters, then computes ended jobs' goodput (some 0.5 ms a job
on a 2-core box), a chunk at a time until this long has passed. A restarted controller's
history is worked off over its first scrapes; until then the families it would show short
are left out (the counters until the log is folded, team and cluster goodput until every
ended job's is in), never served wrong."""
log = logging.getLogger(__name__)
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
        self._ended_teams: dict[str, Sums] | None = None
        """The goodput of the ended jobs kept in the store, by team (read at the first
        scrape, then added to as jobs are kept)."""
        self._ended_total = Sums()
        self._unrecorded: dict[int, EndedGoodputRow] = {}
        """Ended jobs in the sums whose goodput the store could not take yet (a full disk)."""
        self._worked_to = 0
        """Working a history off: the last job id looked at (the next scrape goes on after)."""
        self._counted_to: float | None = None
        """Every job that ended by then is in the sums (None: a history is being worked off)."""
        self._folded = False  # the counters have folded the log they found at the start
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
        cutoff = now - FROZEN_AFTER_S  # ended before it: frozen, kept in the store
        with self._lock:
            nodes = node_states(self.store)
            counts = job_counts(self.store)
            live_ids = [j for j, *_ in self.store.job_heads(_LIVE)]
            recent_ids = recently_ended(self.store, cutoff)
            waiting = self.store.jobs(list(_WAITING))
            stored = Energy(self.store)
            unflushed = self.telemetry.unflushed_by_job()
            energy = stored.of_jobs([*live_ids, *unflushed])
            for job_id, (joules, sim) in unflushed.items():
                old = energy.get(job_id, EnergyTotal(0.0, False))
                energy[job_id] = EnergyTotal(old.joules + joules, old.simulated or sim)
            team_energy = stored.per_team()
            all_energy = stored.total()
            idle = stored.of_jobs([IDLE_JOB]).get(IDLE_JOB, EnergyTotal(0.0, False))
            devices = self.telemetry.latest()
            passes = self.planner.passes
            attempts = {a.job_id: a.id for a in self.store.active_attempts()}
            if self._ended_teams is None:  # the first scrape: what earlier ones kept
                self._load_ended()
            labels = self._labels([*live_ids, *recent_ids, *(j.id for j in waiting), *unflushed])
        catch_up = self._timer()
        folding = self._fold(catch_up)
        refresh = self._due(live_ids)
        # Jobs that ended lately may still change: computed each scrape, not kept.
        recent = self._goodput(refresh + recent_ids, now)
        for job_id in refresh:
            if (d := recent.pop(job_id, None)) is not None:
                self._running[job_id] = (now, d)
        backlog = self._count_ended(cutoff, now, catch_up)
        live = [self._live(j, labels, energy, attempts) for j in live_ids if j in self._running]
        assert self._ended_teams is not None
        teams = {team: sums.copy() for team, sums in self._ended_teams.items()}
        total = self._ended_total.copy()
        for job_id, d in recent.items():
            self._add(teams, total, labels.get(job_id, UNKNOWN).team, d)
        for j in live:
            self._add(teams, total, j.team, _Done(j.wall_s, j.productive_s, j.lost_s))
        team_sums, cluster_energy, idle_energy = self._energy(
            team_energy, all_energy, idle, unflushed, labels
        )
        return Scrape(
            cluster=self.cfg.cluster,
            backend=self.cfg.backend,
            g_per_kwh=self.cfg.carbon.g_per_kwh,
            carbon_source=self.cfg.carbon.source,
            nodes=nodes,
            jobs=self._job_counts(counts),
            queue=self._queue(waiting, labels, now),
            live=live,
            teams=teams,
            cluster_sums=total,
            devices=devices,
            tally=self.tally,
            passes=passes,
            team_energy=team_sums,
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

    def _labels(self, job_ids: Iterable[int]) -> dict[int, JobMeta]:
        """The labels of these jobs (under the lock), read for this scrape only: nothing is
        kept per job between scrapes."""
        out = {}
        for job_id, submitted_at, team, priority_class, partition, user in job_labels(
            self.store, sorted(set(job_ids))
        ):
            out[job_id] = self._meta(team, priority_class, partition, user, submitted_at)
        return out

    def _meta(
        self,
        team: str | None,
        priority_class: str | None,
        partition: str | None,
        user: str | None,
        submitted_at: float = 0.0,
    ) -> JobMeta:
        return JobMeta(
            team=sys.intern(team or "none"),
            priority_class=sys.intern(priority_class or "none"),
            partition=sys.intern(partition or self.cfg.default_partition),
            user=sys.intern(user or ""),
            submitted_at=submitted_at,
        )

    def _fold(self, start: float) -> bool:
        """Fold the events appended since the last scrape into the counters; returns whether
        they are still folding the log they found at the start (then they are left out):
        ``events_chunk`` at a time, at least one chunk, until ``catch_up_s`` since
        ``start``. Once caught up, up to BURST a scrape (more is counted a scrape late)."""
        while True:
            limit = self.events_chunk if not self._folded else BURST
            with self._lock:
                rows = events_since(self.store, self.tally.last_id, KINDS, limit)
                labels = self._labels(r.job_id for r in rows if r.job_id is not None)
            self.tally.fold([recorded(r) for r in rows], partial(_label, labels))
            if len(rows) < limit:
                self._folded = True
                return False
            if self._folded or self._timer() - start >= self.catch_up_s:
                return not self._folded

    def _load_ended(self) -> None:
        """The sums of the ended jobs earlier scrapes kept (of this or a former controller)."""
        self._ended_teams, self._ended_total = {}, Sums()
        for team, kept in EndedGoodput(self.store).by_team().items():
            self._add(
                self._ended_teams,
                self._ended_total,
                sys.intern(team),
                _Done(kept.wall_s, kept.productive_s, kept.lost_s),
            )

    def _count_ended(self, cutoff: float, now: float, start: float) -> int:
        """Compute and keep the goodput of the jobs that ended by ``cutoff`` and are not kept
        yet, and add it to the sums; returns how many are left.

        Working a history off (a store from before migration 11, or jobs that ended while no
        one scraped), ``ended_chunk`` at a time until ``catch_up_s`` since ``start`` (at least
        one chunk). Once it is worked off, every job that ended since the last scrape's
        ``cutoff`` (less ENDED_MARGIN_S, for a clock set back), in chunks, all of them: a job
        left for later would be missing from the sums."""
        kept = EndedGoodput(self.store)
        after = None if self._counted_to is None else self._counted_to - ENDED_MARGIN_S
        budget = self.catch_up_s if self._counted_to is None else float("inf")
        done, above = 0, 0 if after is not None else self._worked_to
        while done == 0 or self._timer() - start < budget:
            with self._lock:
                ids = kept.uncounted(
                    ended_by=cutoff, ended_after=after, above_id=above, limit=self.ended_chunk
                )
            if after is None and ids:  # a history: where the next scrape goes on from
                above = self._worked_to = ids[-1]
            new = [j for j in ids if j not in self._unrecorded]
            if new:
                self._keep(new, now)
            self._record_unrecorded()
            done += max(1, len(new))
            if len(new) < self.ended_chunk:
                break
        with self._lock:
            left = kept.count_uncounted(ended_by=cutoff, ended_after=after)
        left -= len(self._unrecorded)
        if left <= 0 and not self._unrecorded:
            self._counted_to = cutoff if self._counted_to is None else max(self._counted_to, cutoff)
        elif after is None and len(ids) < self.ended_chunk:
            self._worked_to = 0  # to the end, some left (ended meanwhile below it): again
        return max(0, left)

    def _keep(self, job_ids: list[int], now: float) -> None:
        """Compute these ended jobs' goodput, add it to the sums and keep it in the store
        (a store that cannot be written, a full disk say: kept here and written later)."""
        done = self._goodput(job_ids, now)
        with self._lock:
            labels = self._labels(done)
        assert self._ended_teams is not None
        for job_id, d in done.items():
            team = labels.get(job_id, UNKNOWN).team
            self._add(self._ended_teams, self._ended_total, team, d)
            self._unrecorded[job_id] = EndedGoodputRow(
                job_id, team, d.wall_s, d.productive_s, dict(d.lost_s)
            )

    def _record_unrecorded(self) -> None:
        if not self._unrecorded:
            return
        try:
            with self._lock, self.store.transaction():
                EndedGoodput(self.store).record(self._unrecorded.values())
        except StoreUnavailable as exc:
            n = len(self._unrecorded)
            log.warning("ended jobs' goodput not kept yet (%d jobs): %s", n, exc)
            return
        self._unrecorded.clear()

    def _job_counts(
        self, counts: list[tuple[JobState, str | None, str | None, str | None, int]]
    ) -> dict[tuple[JobState, str, str, str], int]:
        out: dict[tuple[JobState, str, str, str], int] = {}
        for state, team, priority_class, partition, n in counts:
            m = self._meta(team, priority_class, partition, None)
            key = (state, m.team, m.priority_class, m.partition)
            out[key] = out.get(key, 0) + n
        return out

    def _queue(
        self, waiting: list[JobRow], labels: dict[int, JobMeta], now: float
    ) -> dict[str, tuple[int, float]]:
        out = {p: (0, 0.0) for p in self.cfg.partitions}
        for job in waiting:
            if job.held_by:
                continue
            part = labels.get(job.id, UNKNOWN).partition
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
        self,
        job_id: int,
        labels: dict[int, JobMeta],
        energy: dict[int, EnergyTotal],
        attempts: dict[int, int],
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
            team=labels.get(job_id, UNKNOWN).team,
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
        self,
        stored: dict[str | None, EnergyTotal],
        stored_total: EnergyTotal,
        stored_idle: EnergyTotal,
        unflushed: dict[int, tuple[float, bool]],
        labels: dict[int, JobMeta],
    ) -> tuple[dict[str, EnergySum], EnergySum, EnergySum]:
        """Per team, the whole cluster, and idle devices (job 0): the store's aggregates and
        what the telemetry has not written yet."""
        teams: dict[str, EnergySum] = {}

        def add(team: str, joules: float, simulated: bool) -> None:
            old = teams.get(team, EnergySum(0.0, False))
            teams[team] = EnergySum(old.joules + joules, old.simulated or simulated)

        for team, e in stored.items():
            add(sys.intern(team or "none"), e.joules, e.simulated)
        total, sim_any = stored_total.joules, stored_total.simulated
        idle, idle_sim = stored_idle.joules, stored_idle.simulated
        for job_id, (joules, sim) in unflushed.items():
            total, sim_any = total + joules, sim_any or sim
            if job_id == IDLE_JOB:
                idle, idle_sim = idle + joules, idle_sim or sim
            else:
                add(labels.get(job_id, UNKNOWN).team, joules, sim)
        return teams, EnergySum(total, sim_any), EnergySum(idle, idle_sim)

    @staticmethod
    def _add(teams: dict[str, Sums], total: Sums, team: str, d: _Done) -> None:
        teams.setdefault(team, Sums()).add(d.wall_s, d.productive_s, d.lost_s)
        total.add(d.wall_s, d.productive_s, d.lost_s)


def _label(labels: dict[int, JobMeta], job_id: int) -> JobMeta:
    return labels.get(job_id, UNKNOWN)


def _done(report: GoodputReport) -> _Done:
    return _Done(report.wall_s, report.buckets.get("productive", 0.0), report.lost_by_cause)
