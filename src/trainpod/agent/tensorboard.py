"""The agent's TensorBoard writer: rank 0's beacons become the job's per-step scalars.

The agent of the node that runs rank 0 of an attempt watches it (:meth:`TensorBoardTap.watch`
with the launch order, whose env names ``TRAINPOD_TENSORBOARD_DIR``). The beacon server hands
every booked batch to :meth:`TensorBoardTap.offer`, which keeps rank 0's beacons of watched
attempts on a bounded queue (the receiver thread never waits on a file); a daemon thread
writes them with :class:`~trainpod.telemetry.tensorboard.StepScalars` in batches: it wakes
:data:`FLUSH_EVERY_S` after the first beacon of a batch arrived (at once when
:data:`WRITE_BATCH` wait, an attempt ends or the tap closes), writes them all and flushes.
Woken for every beacon, as it was, the thread cost ~270 µs of CPU per beacon where the
writing itself costs ~40 (a cold cache and a thread switch each time, measured at 200
beacons a second); TensorBoard itself reloads a run only every few seconds. Why the agent and
not the controller: it sees every beacon, the controller only the latest per heartbeat
(ADR 0021).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from trainpod.agent.accounts import AccountError, run_as
from trainpod.agent.beacons import Beacon
from trainpod.api.models import LaunchOrder
from trainpod.telemetry.tensorboard import ENV, StepScalars

log = logging.getLogger(__name__)

__all__ = ["FLUSH_EVERY_S", "QUEUE_LIMIT", "WRITE_BATCH", "TensorBoardTap"]

FLUSH_EVERY_S = 1.0
"""How long a beacon may wait before it is written and flushed to its file."""
WRITE_BATCH = 1024
"""Beacons that wake the writer before ``FLUSH_EVERY_S``."""

QUEUE_LIMIT = 100_000
"""Beacons waiting to be written, at most; beyond it the newest are dropped (counted)."""


def give(logdir: Path, account: str) -> None:
    """Make the job's logdir its owner's (ranks that run as an account write their own
    ``SummaryWriter`` runs there); trainpod's runs inside stay the agent's and controller's.
    Where that cannot be done the rank fails for the same reason, or the script sees it."""
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        run_as(account).own(logdir)
    except (AccountError, OSError) as exc:
        log.warning("tensorboard: %s not given to account %s: %s", logdir, account, exc)


class TensorBoardTap:
    """Writes the watched attempts' rank-0 beacons to their job's TensorBoard logdir."""

    def __init__(
        self, *, queue_limit: int = QUEUE_LIMIT, flush_every_s: float = FLUSH_EVERY_S
    ) -> None:
        self.flush_every_s = flush_every_s
        self.dropped = 0
        """Beacons not written because the queue was full."""
        self._limit = queue_limit
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Beacon] = deque()
        self._watched: dict[int, tuple[Path, int, str]] = {}  # attempt id -> (dir, n, reason)
        self._writers: dict[int, StepScalars] = {}  # opened on an attempt's first beacon
        self._batch_since: float | None = None  # when the oldest queued beacon came
        self._closing: list[tuple[int, tuple[Path, int, str]]] = []
        """Attempts that ended, with where they write: their queued beacons are still
        written (the first may not have been: a short job's all wait for the same flush)."""
        self._forgotten: set[int] = set()  # ended here: a repeated launch order is not watched
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tensorboard", daemon=True)
        self._thread.start()

    # -- fed by the agent and the beacon server -----------------------------------------
    def watch(self, order: LaunchOrder) -> bool:
        """Watch ``order``'s attempt if this node runs its rank 0 and it has a logdir. Called
        before the ranks start (none of their beacons is missed); idempotent."""
        logdir = order.env.get(ENV)
        if not logdir or not any(r.rank == 0 for r in order.ranks):
            return False
        reason = order.env.get("TRAINPOD_RESTART_REASON", "")
        with self._lock:
            if order.attempt_id in self._forgotten:
                return False
            known = order.attempt_id in self._watched
            self._watched[order.attempt_id] = (Path(logdir), order.attempt_number, reason)
        if order.account is not None and not known:
            give(Path(logdir), order.account)
        return True

    def forget(self, attempt_id: int) -> None:
        """The attempt ended here: write what is queued of it, then close its file."""
        with self._lock:
            self._forgotten.add(attempt_id)
            where = self._watched.pop(attempt_id, None)
            if where is not None:
                self._closing.append((attempt_id, where))
                self._wake.notify()

    def offer(self, batch: Iterable[Beacon]) -> None:
        """A batch the beacon server booked (its receiver thread): keep rank 0's of watched
        attempts. O(batch); never blocks on I/O."""
        with self._lock:
            watched, queue = self._watched, self._queue
            if not watched:
                return
            before = len(queue)
            for beacon in batch:
                if beacon[1] == 0 and beacon[0] in watched:
                    if len(queue) >= self._limit:
                        self.dropped += 1
                        continue
                    queue.append(beacon)
            if len(queue) != before and (before == 0 or len(queue) >= WRITE_BATCH):
                if before == 0:
                    self._batch_since = time.monotonic()
                self._wake.notify()  # to start the batch's clock, or to write a full one

    # -- the writer thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not self._stopped:
                    if not self._queue:
                        self._wake.wait()
                        continue
                    since = self._batch_since or time.monotonic()
                    left = since + self.flush_every_s - time.monotonic()
                    if left <= 0 or len(self._queue) >= WRITE_BATCH:
                        break
                    self._wake.wait(left)
                batch = list(self._queue)
                self._queue.clear()
                self._batch_since = None
                closing, self._closing = self._closing, []
                watched = {**self._watched, **dict(closing)}
                stopped = self._stopped
            try:
                self._write(batch, watched)
            except Exception:  # a full or gone shared dir: the agent goes on without it
                log.exception("tensorboard: writing beacons failed")
            for attempt_id in [a for a, _ in closing] + (list(self._writers) if stopped else []):
                writer = self._writers.pop(attempt_id, None)
                try:
                    if writer is not None:
                        writer.close()
                except OSError as exc:
                    log.warning("tensorboard: attempt %d: closing failed: %s", attempt_id, exc)
            if stopped:
                return

    def _write(self, batch: list[Beacon], watched: dict[int, tuple[Path, int, str]]) -> None:
        touched: set[int] = set()
        for attempt_id, _rank, step, t, metrics in batch:
            writer = self._writer(attempt_id, watched)
            if writer is None:
                continue
            try:
                writer.beacon(step, t, metrics)
            except (TypeError, ValueError, OverflowError):  # a value protobuf refuses
                log.exception("tensorboard: attempt %d: a beacon was not written", attempt_id)
            touched.add(attempt_id)
        for attempt_id in touched:
            self._writers[attempt_id].flush()

    def _writer(
        self, attempt_id: int, watched: dict[int, tuple[Path, int, str]]
    ) -> StepScalars | None:
        writer = self._writers.get(attempt_id)
        if writer is None and attempt_id in watched:
            logdir, number, reason = watched[attempt_id]
            try:
                writer = self._writers[attempt_id] = StepScalars(
                    logdir, attempt=number, reason=reason
                )
            except (OSError, ImportError) as exc:  # not writable; tensorboard not installed
                log.warning(
                    "tensorboard: attempt %d: not written to %s: %s", attempt_id, logdir, exc
                )
                del watched[attempt_id]
                with self._lock:
                    self._watched.pop(attempt_id, None)
        return writer

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, close every file and stop the thread. Idempotent."""
        with self._lock:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)
