"""The controller's TensorBoard writer: every job's goodput run (ADR 0021).

:class:`GoodputFollower` looks every few seconds at the jobs that changed since its last
look (the event log says which: every state change appends an event) and at the running
jobs whose period came, and, for each job that has an attempt, writes its goodput report
(:func:`trainpod.telemetry.goodput.compute_goodput`, from the job record and its events) to
the job's ``trainpod-goodput/`` run: when an attempt or the job changes state, at least
every ``period_s`` while it runs, and once more when it ends. Only its first look lists
every unfinished job; after that a look reads the few jobs that changed or are due, never
the whole queue. Goodput is the controller's to write because only it has the events
(faults, restarts, teardowns); the per-step scalars are the agents' (agent/tensorboard.py).
It reads through the controller's query methods, passed in as callables, and never holds
the controller's lock while it writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainpod.api.models import EventInfo, JobInfo
from trainpod.telemetry.goodput import compute_goodput
from trainpod.telemetry.tensorboard import GoodputScalars, tensorboard_dir

log = logging.getLogger(__name__)

__all__ = ["GoodputFollower"]

INTERVAL_S = 2.0
PERIOD_S = 30.0

_Key = tuple[str, tuple[tuple[int, str], ...]]  # the job's state and its attempts' states


class GoodputFollower:
    """Writes each unfinished job's goodput to its TensorBoard logdir. One thread calls
    :meth:`poll` (or :meth:`run`)."""

    def __init__(
        self,
        *,
        shared_dir: Path,
        active_jobs: Callable[[], list[JobInfo]],
        jobs: Callable[[list[int]], list[JobInfo]],
        changes: Callable[[int | None], tuple[int, set[int]]],
        events: Callable[[int], list[EventInfo]],
        clock: Callable[[], float] = time.time,
        period_s: float = PERIOD_S,
    ) -> None:
        """``active_jobs``: every unfinished job (the first look); ``jobs``: these (unknown
        ones left out); ``changes(after)``: the newest event id and the jobs with an event
        after ``after`` (None: none, only the id); ``events``: a job's events."""
        self.shared_dir = Path(shared_dir)
        self._active, self._jobs, self._changes = active_jobs, jobs, changes
        self._events = events
        self._clock = clock
        self.period_s = period_s
        self._after: int | None = None  # the newest event id seen (None: no look yet)
        self._seen: dict[int, tuple[_Key, float]] = {}
        self._writers: dict[int, GoodputScalars] = {}
        self.written = 0
        """Points written so far."""
        self.read = 0
        """Jobs read so far (a look reads the changed and the due ones)."""

    def poll(self) -> int:
        """One look: write the jobs that are due; returns how many points were written."""
        now = self._clock()
        newest, changed = self._changes(self._after)
        asked = changed | {j for j, (_, at) in self._seen.items() if now - at >= self.period_s}
        if self._after is None:  # the first look
            jobs = self._active()
        elif asked:
            jobs = self._jobs(sorted(asked))
        else:
            jobs = []
        self._after = newest
        self.read += len(jobs)
        written = 0
        for job in jobs:
            if job.state.ended:
                written += self._end(job, now)
            elif job.attempts:
                key: _Key = (job.state.value, tuple((a.number, a.state) for a in job.attempts))
                seen = self._seen.get(job.id)
                if seen is None or seen[0] != key or now - seen[1] >= self.period_s:
                    written += self._write(job, now)
                    self._seen[job.id] = (key, now)
        found = {job.id for job in jobs}
        for gone in [j for j in self._seen if j in asked and j not in found]:
            self._forget(gone)  # no longer in the store
        self.written += written
        return written

    def _end(self, job: JobInfo, now: float) -> int:
        """The job ended: its final point (if it was followed), then its file is closed."""
        if job.id not in self._seen:
            return 0
        written = self._write(job, now)
        self._forget(job.id)
        return written

    def _forget(self, job_id: int) -> None:
        self._seen.pop(job_id, None)
        writer = self._writers.pop(job_id, None)
        if writer is not None:
            writer.close()

    def _write(self, job: JobInfo, now: float) -> int:
        try:
            report = compute_goodput(job, self._events(job.id), now)
            writer = self._writers.get(job.id)
            if writer is None:
                writer = self._writers[job.id] = GoodputScalars(
                    tensorboard_dir(self.shared_dir, job.id)
                )
            return int(writer.write(report, now))
        except (OSError, ImportError) as exc:  # the shared dir is full or gone: retried
            log.warning("tensorboard: goodput of job %d not written: %s", job.id, exc)
            return 0

    def run(self, stop: threading.Event, interval_s: float = INTERVAL_S) -> None:
        """Poll every ``interval_s`` until ``stop`` is set; then close every file."""
        while not stop.wait(interval_s):
            try:
                self.poll()
            except Exception:  # housekeeping: the controller goes on without it
                log.exception("writing goodput to TensorBoard failed")
        self.close()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
