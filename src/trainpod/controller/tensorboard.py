"""The controller's TensorBoard writer: every job's goodput run (ADR 0021).

:class:`GoodputFollower` looks at the unfinished jobs every few seconds and, for each job
that has an attempt, writes its goodput report (:func:`trainpod.telemetry.goodput.
compute_goodput`, from the job record and its events) to the job's ``trainpod-goodput/``
run: when an attempt or the job changes state, at least every ``period_s`` while it runs,
and once more when it ends. Goodput is the controller's to write because only it has the
events (faults, restarts, teardowns); the per-step scalars are the agents' (agent/
tensorboard.py). It reads through the controller's query methods, passed in as callables,
and never holds the controller's lock while it writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainpod.api.models import EventInfo, JobInfo
from trainpod.errors import NotFound
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
        job: Callable[[int], JobInfo],
        events: Callable[[int], list[EventInfo]],
        clock: Callable[[], float] = time.time,
        period_s: float = PERIOD_S,
    ) -> None:
        self.shared_dir = Path(shared_dir)
        self._active, self._job, self._events = active_jobs, job, events
        self._clock = clock
        self.period_s = period_s
        self._seen: dict[int, tuple[_Key, float]] = {}
        self._writers: dict[int, GoodputScalars] = {}
        self.written = 0
        """Points written so far."""

    def poll(self) -> int:
        """One look: write the jobs that are due; returns how many points were written."""
        now = self._clock()
        active = {j.id: j for j in self._active() if j.attempts}
        written = 0
        for job in active.values():
            key: _Key = (job.state.value, tuple((a.number, a.state) for a in job.attempts))
            seen = self._seen.get(job.id)
            if seen is None or seen[0] != key or now - seen[1] >= self.period_s:
                written += self._write(job, now)
                self._seen[job.id] = (key, now)
        for gone in [j for j in self._seen if j not in active]:  # ended since the last look
            del self._seen[gone]
            try:
                written += self._write(self._job(gone), now)
            except NotFound:
                pass
            writer = self._writers.pop(gone, None)
            if writer is not None:
                writer.close()
        self.written += written
        return written

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
