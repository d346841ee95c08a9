"""Read views: store rows and in-memory books, as the API's models.

Rows are read under the controller's lock in a few bulk queries (never one per job or
attempt); the models are built after the lock is released, so a dashboard listing ten
thousand jobs does not hold up heartbeats while pydantic runs.

A job's spec never changes after submission: :class:`Specs` decodes each once and every
view of the job shares it (the list views, the job page, ``/metrics``' goodput and the
TensorBoard follower all build their ``JobInfo`` here).

A job's ``env`` values are its owner's and admins' (:func:`~trainpod.controller.access.sees_env`):
a view taken for anyone else (``viewer``) has every value replaced by
:data:`~trainpod.controller.access.HIDDEN`, the keys kept.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import TypeAdapter

from trainpod.api.models import AttemptInfo, EventInfo, JobInfo, NodeInfo, RankInfo
from trainpod.bounded import ByteBoundedCache
from trainpod.controller import progress
from trainpod.controller.access import HIDDEN, Principal, sees_env
from trainpod.controller.books import BeaconBook
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.transitions import Transitions
from trainpod.model.states import AttemptState, JobState
from trainpod.scheduler.base import Hold
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow, RankRow
from trainpod.store.scan import jobs_changed

FROZEN_AFTER_S = 60.0
"""An ended job's row no longer changes (late reports from its agents arrive within seconds)."""
CACHE_BYTES = 64 << 20
"""What each of the views' two caches (decoded specs, ended jobs' JSON) may hold by default
(the cluster spec's ``controller.view_cache_mib``)."""
SPEC_BYTES_BASE = 2048
SPEC_BYTES_PER_CHAR = 4
"""A decoded :class:`JobSpec` weighs about 2 KiB plus 4 bytes per character of its JSON
(tracemalloc: 3.7 KiB for a 0.5 KB spec, 15.7 KiB for a 3.9 KB one)."""
JSON_BYTES_BASE = 256  # a cached job's JSON: the bytes objects' own overhead and the entry
REBUILD_CHUNK = 256
"""Ended jobs a listing rebuilds at once when they are not cached: their rows and models
exist a chunk at a time, so a listing's peak is its bytes and one chunk, not its every
job's models (a history larger than the cache rebuilt whole on each full listing)."""
_JOB = TypeAdapter(JobInfo)
_ENDED = [s for s in JobState if s.ended]


class Views:
    def __init__(
        self,
        store: Store,
        tx: Transitions,
        lock: threading.RLock,
        beacons: BeaconBook,
        checkpoints: CheckpointEvents,
        holds: Callable[[], dict[int, Hold]],
        now: Callable[[], float],
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        """``cache_bytes``: what the decoded specs and, apart, the ended jobs' JSON may take."""
        self.store = store
        self.tx = tx
        self._lock = lock
        self.beacons = beacons
        self.checkpoints = checkpoints
        self._holds = holds
        self._now = now
        self.frozen: ByteBoundedCache[int, _Json] = ByteBoundedCache(cache_bytes)
        """Ended jobs' JSON by id, with the ``updated_at`` it was made from."""
        self.specs = Specs(cache_bytes)

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            rows = sorted(self.store.nodes(), key=self.tx.node_order)
        return [_node_info(n) for n in rows]

    def job(self, job_id: int, viewer: Principal | None = None) -> JobInfo:
        """One job as ``viewer`` may see it (None: everything, for the controller's use)."""
        with self._lock:
            rows = self._read([self.tx.job(job_id)])
        info = self._build(rows)[0]
        return info if sees_env(viewer, info.spec.user) else hide_env(info)

    def jobs_json(
        self,
        include_ended: bool = True,
        limit: int | None = None,
        viewer: Principal | None = None,
        after: int | None = None,
    ) -> bytes:
        """:meth:`jobs` as the JSON the API sends ``viewer``, with what cannot change any
        more cached: a job that ended more than FROZEN_AFTER_S ago is serialised once (with
        its env and with its env hidden), so a dashboard listing ten thousand jobs rebuilds
        only the live ones. ``after``: a page, the first ``limit`` jobs with a higher id."""
        states = None if include_ended else [s for s in JobState if not s.ended]
        with self._lock:
            now = self._now()
            heads = self.store.job_heads(states, limit=limit, after=after)
            cached: dict[int, _Json] = {}  # taken now: another view may evict meanwhile
            live: list[int] = []
            ended: list[int] = []
            for job_id, state, updated_at, _ in heads:
                old = self.frozen.get(job_id)
                if old is not None and old.updated_at == updated_at:
                    cached[job_id] = old
                else:
                    (ended if state.ended else live).append(job_id)
            # Live jobs as they are now, with the heads; ended ones cannot change any more.
            first = self._read(self.store.jobs_by_id(live + ended[:REBUILD_CHUNK]))
        fresh = self._serialise(first)
        # Ended jobs not in the cache (a history larger than it) are rebuilt a chunk at a
        # time: a listing's models never all exist at once, only its bytes do.
        for i in range(REBUILD_CHUNK, len(ended), REBUILD_CHUNK):
            with self._lock:
                rows = self._read(self.store.jobs_by_id(ended[i : i + REBUILD_CHUNK]))
            fresh.update(self._serialise(rows))
        for job_id, state, updated_at, ended_at in heads:
            old_enough = ended_at is None or now - ended_at > FROZEN_AFTER_S
            if job_id in fresh and state.ended and old_enough:
                done = replace(fresh[job_id], updated_at=updated_at)
                self.frozen.put(job_id, done, done.size)
        parts = [(fresh.get(j) or cached[j]).for_viewer(viewer) for j, *_ in heads]
        return b"[" + b",".join(parts) + b"]"

    def _serialise(self, rows: _Rows) -> dict[int, _Json]:
        return {info.id: _Json.of(info, updated_at=0.0) for info in self._build(rows)}

    def of_jobs(self, job_ids: list[int]) -> list[JobInfo]:
        """The jobs with these ids (unknown ids are left out), in id order."""
        with self._lock:
            rows = self._read(self.store.jobs_by_id(job_ids))
        return self._build(rows)

    def changes(self, after: int | None) -> tuple[int, set[int]]:
        """The newest event id and the jobs with an event after ``after`` (None: only the
        id): a follower's cheap "what changed since my last look" (every change appends an
        event)."""
        with self._lock:
            return jobs_changed(self.store, after)

    def jobs(self, include_ended: bool = True, limit: int | None = None) -> list[JobInfo]:
        states = None if include_ended else [s for s in JobState if not s.ended]
        with self._lock:
            rows = self._read(self.store.jobs(states, limit=limit))
        return self._build(rows)

    def ended(self, before: int | None, count: int) -> list[JobInfo]:
        """A page of the history: up to ``count`` ended jobs with an id below ``before``
        (None: the newest), newest first."""
        with self._lock:
            rows = self._read(self.store.jobs_before(_ENDED, before, count))
        return self._build(rows)

    def _build(self, rows: _Rows) -> list[JobInfo]:
        return _build(rows, self.specs)

    def _read(self, jobs: list[JobRow]) -> _Rows:
        """Everything the jobs' models need, in three queries (under the lock)."""
        attempts = self.store.attempts_of_jobs([j.id for j in jobs])
        ranks = self.store.ranks_of_attempts([a.id for a_s in attempts.values() for a in a_s])
        live = {j.id: self._progress(j.id, attempts[j.id]) for j in jobs if not j.state.ended}
        return _Rows(jobs, attempts, ranks, dict(self._holds()), live)

    def _progress(self, job_id: int, attempts: list[AttemptRow]) -> dict[str, Any] | None:
        attempt = next((a for a in attempts if not a.state.ended), None)
        uploads = self.checkpoints.progress(job_id)
        if attempt is None or (attempt.id not in self.beacons.by_attempt and not uploads):
            return None
        out = {"attempt": attempt.number, **progress.summarise(self.beacons.of(attempt.id))}
        return {**out, "checkpoint_uploads": uploads} if uploads else out

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[EventInfo]:
        with self._lock:
            rows = self.store.events(job_id=job_id, node=node, after=after, limit=limit)
        return [EventInfo(**vars(e)) for e in rows]

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            nodes = Counter(n.state.value for n in self.store.nodes())
            jobs = Counter(state.value for _, state, _, _ in self.store.job_heads())
        return dict(nodes), dict(jobs)


def hide_env(info: JobInfo) -> JobInfo:
    """``info`` with every value of its spec's ``env`` replaced by :data:`HIDDEN`, and no
    ``secret_env`` at all: that a job has secrets is its owner's and admins' to know (they
    see the names, the values masked, ``***``; the values are in no view, ADR 0032)."""
    if not info.spec.env and not info.spec.secret_env:
        return info
    spec = info.spec.model_copy(
        update={"env": dict.fromkeys(info.spec.env, HIDDEN), "secret_env": {}}
    )
    return info.model_copy(update={"spec": spec})


@dataclass(frozen=True)
class _Json:
    """One job's JSON as its owner and admins see it (``full``) and as the others do."""

    updated_at: float
    owner: str
    full: bytes
    hidden: bytes

    @classmethod
    def of(cls, info: JobInfo, updated_at: float) -> _Json:
        full = _JOB.dump_json(info)
        hidden = _JOB.dump_json(hide_env(info)) if info.spec.env or info.spec.secret_env else full
        return cls(updated_at, info.spec.user, full, hidden)

    def for_viewer(self, viewer: Principal | None) -> bytes:
        return self.full if sees_env(viewer, self.owner) else self.hidden

    @property
    def size(self) -> int:
        both = len(self.full) + (len(self.hidden) if self.hidden is not self.full else 0)
        return JSON_BYTES_BASE + both


@dataclass(frozen=True)
class _Rows:
    jobs: list[JobRow]
    attempts: dict[int, list[AttemptRow]]
    ranks: dict[int, list[RankRow]]
    holds: dict[int, Hold]
    live: dict[int, dict[str, Any] | None]


class Specs:
    """Each job's decoded :class:`JobSpec`, by id: decoded once (a spec never changes after
    submission), the newest kept up to ``max_bytes`` of their estimated weight (views list
    recent jobs). Safe to share between threads (views build models outside the
    controller's lock)."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.cache: ByteBoundedCache[int, JobSpec] = ByteBoundedCache(max_bytes)
        self._lock = threading.Lock()
        self.decoded = 0
        """Specs decoded so far (a view that hit the cache decodes none)."""

    def of(self, job: JobRow) -> JobSpec:
        spec = self.cache.get(job.id)
        if spec is None:
            spec = JobSpec.model_validate(job.spec)
            size = SPEC_BYTES_BASE + SPEC_BYTES_PER_CHAR * len(json.dumps(job.spec))
            self.cache.put(job.id, spec, size)
            with self._lock:
                self.decoded += 1
        return spec


def _build(rows: _Rows, specs: Specs) -> list[JobInfo]:
    return [
        _job_info(
            j,
            specs.of(j),
            rows.attempts[j.id],
            rows.ranks,
            rows.holds.get(j.id),
            rows.live.get(j.id),
        )
        for j in rows.jobs
    ]


def _job_info(
    job: JobRow,
    spec: JobSpec,
    attempts: list[AttemptRow],
    ranks: dict[int, list[RankRow]],
    hold: Hold | None,
    live: dict[str, Any] | None,
) -> JobInfo:
    waiting = job.state in (JobState.QUEUED, JobState.PREEMPTED)
    hold = hold if waiting else None
    reason = job.reason
    if waiting and job.held_by:
        hold = None
        why = f"held by {job.held_by} (`trainpod release {job.id}` lets it be scheduled)"
        reason = f"{why}; {job.reason}" if job.reason else why
    if hold is not None:  # why it waits now, then why it came back to the queue (if it did)
        reason = f"{hold.reason}; {job.reason}" if job.reason else hold.reason
    return JobInfo(
        id=job.id,
        name=job.name,
        state=job.state,
        reason=reason,
        spec=spec,
        submitted_at=job.submitted_at,
        started_at=job.started_at,
        ended_at=job.ended_at,
        attempts=[_attempt_info(a, ranks.get(a.id, [])) for a in attempts],
        external=job.external,
        progress=live,
        queue_position=hold.position if hold is not None else None,
        estimated_start=hold.estimated_start if hold is not None else None,
    )


def _attempt_info(a: AttemptRow, ranks: list[RankRow]) -> AttemptInfo:
    return AttemptInfo(
        number=a.number,
        state=a.state,
        nodes=a.nodes,
        master_addr=a.master_addr,
        master_port=a.master_port,
        created_at=a.created_at,
        started_at=a.started_at,
        ended_at=a.ended_at,
        cause=a.cause,
        # a success is no fault, whatever stopped its last ranks (ADR 0049)
        fault=""
        if a.state is AttemptState.SUCCEEDED
        else (a.failure.classified.kind if a.failure.classified else "") or a.cause,
        failure=a.failure.to_json(),
        ranks=[RankInfo.model_validate(r, from_attributes=True) for r in ranks],
        generation=a.in_process.generation,
        generation_confirmed=not a.in_process.pending,
        lent_by=list(a.lent_by),
    )


def _node_info(n: NodeRow) -> NodeInfo:
    return NodeInfo.model_validate(n, from_attributes=True)
