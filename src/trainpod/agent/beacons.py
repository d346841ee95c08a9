"""Agent side of progress beacons: receive them and keep per-rank books.

:class:`BeaconServer` binds the node's Unix socket (``SOCK_SEQPACKET``) and feeds a
:class:`BeaconBook` from a daemon thread. The wire format is described in
:mod:`trainpod.beacon`. Judging hangs and stragglers is the controller's
(:mod:`trainpod.controller.progress`, :mod:`trainpod.controller.stragglers`): it sees every
node's ranks.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpod.agent.accounts import Grants
from trainpod.agent.unixsock import SeqpacketServer
from trainpod.api.models import RankBeacon
from trainpod.beacon import WIRE_VERSION
from trainpod.clock import Clock, SystemClock

log = logging.getLogger(__name__)

__all__ = [
    "AttemptBeacons",
    "BeaconBook",
    "BeaconServer",
    "RankBeacons",
    "rank_beacon",
]

STEP_WINDOW = 50  # recent step durations kept per rank
MAX_MESSAGE = 65536
LISTEN_BACKLOG = 128
MetricValue = float | int | str | bool
_decode = json.JSONDecoder().decode


# -- summaries ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankBeacons:
    """What the beacons of one rank of one attempt said. Times are the agent's ``time.time()``."""

    rank: int
    first_at: float
    """When the agent received this rank's first beacon."""
    last_at: float
    """When the agent received this rank's latest beacon (report or heartbeat)."""
    age_s: float
    """Seconds from ``last_at`` to the moment the summary was taken."""
    first_step: int | None
    """The first step reported; None when only heartbeats came."""
    last_step: int | None
    """The latest step reported; None when only heartbeats came."""
    steps: int
    """How many step reports arrived (heartbeats not counted)."""
    beacons: int
    """How many messages arrived, heartbeats included."""
    step_time_s: float | None
    """Median seconds per step over the last ``STEP_WINDOW`` step advances (sender clock,
    divided by the step increment, so reporting every k-th step still gives seconds per
    step); None before two distinct increasing steps."""
    last_checkpoint_step: int | None
    """The highest ``checkpoint_step`` reported: steps after it are recomputed on a restart."""
    checkpoint_stall_s: float
    """Sum of the reported ``checkpoint_stall_s``."""
    tokens: float
    """Sum of the reported ``tokens``."""
    metrics: dict[str, MetricValue]
    """The metrics of the latest report that carried any (special keys included)."""
    generation: int = 0
    """The newest in-process recovery generation the rank said it joined (ADR 0035)."""
    lost_generation: int | None = None
    """The newest generation whose process group the rank said it lost (a collective failed
    or timed out) while it waits for the next one; None: it never said so."""
    collective_timeout_s: float | None = None
    """The collective timeout the rank said its group has (``trainpod.elastic.run``'s
    ``timeout_s``): how long a peer's hang takes to show as a lost group."""


@dataclass(frozen=True)
class AttemptBeacons:
    """The beacons of one attempt on this node, by rank. Empty when none arrived yet."""

    attempt_id: int
    taken_at: float
    ranks: dict[int, RankBeacons] = field(default_factory=dict)

    def step_times(self) -> dict[int, float]:
        """Rank -> median step time, for the ranks that have one (input of the straggler check)."""
        return {r: b.step_time_s for r, b in self.ranks.items() if b.step_time_s is not None}


def rank_beacon(b: RankBeacons) -> RankBeacon:
    """One rank's summary as the agent sends it with its heartbeat (the sum of the reported
    ``tokens`` rides in the metrics as ``tokens_total``)."""
    return RankBeacon(
        rank=b.rank,
        first_at=b.first_at,
        last_at=b.last_at,
        age_s=b.age_s,
        first_step=b.first_step,
        last_step=b.last_step,
        steps=b.steps,
        step_time_s=b.step_time_s,
        last_checkpoint_step=b.last_checkpoint_step,
        checkpoint_stall_s=b.checkpoint_stall_s,
        metrics={**b.metrics, "tokens_total": b.tokens},
        generation=b.generation,
        lost_generation=b.lost_generation,
        collective_timeout_s=b.collective_timeout_s,
    )


class _RankState:
    """Mutable book entry; a slotted class because the receiver touches it per message."""

    __slots__ = (
        "beacons",
        "collective_timeout_s",
        "durations",
        "first_at",
        "first_step",
        "generation",
        "last_at",
        "last_ckpt",
        "last_step",
        "last_t",
        "lost_generation",
        "metrics",
        "stall_s",
        "steps",
        "tokens",
    )

    def __init__(self, now: float) -> None:
        self.first_at = now
        self.last_at = now
        self.beacons = 0
        self.steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.last_t = 0.0  # sender time of last_step
        self.durations: deque[float] = deque(maxlen=STEP_WINDOW)
        self.metrics: dict[str, MetricValue] = {}
        self.last_ckpt: int | None = None
        self.stall_s = 0.0
        self.tokens = 0.0
        self.generation = 0
        self.lost_generation: int | None = None
        self.collective_timeout_s: float | None = None

    def record(
        self, step: int | None, t: float, metrics: dict[str, Any] | None, now: float
    ) -> None:
        self.last_at = now
        self.beacons += 1
        if step is not None:
            self.steps += 1
            last = self.last_step
            if last is None:
                self.first_step = step
            elif step > last and t >= self.last_t:
                self.durations.append((t - self.last_t) / (step - last))
            if step != last:  # a repeated step keeps its first time; a lower one restarts timing
                self.last_step = step
                self.last_t = t
        if metrics:
            self.metrics = metrics
            ckpt = metrics.get("checkpoint_step")
            if type(ckpt) is int and (self.last_ckpt is None or ckpt > self.last_ckpt):
                self.last_ckpt = ckpt
            stall = metrics.get("checkpoint_stall_s")
            if isinstance(stall, (int, float)) and not isinstance(stall, bool):
                self.stall_s += stall
            tokens = metrics.get("tokens")
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
                self.tokens += tokens
            gen = metrics.get("generation")
            if type(gen) is int and gen > self.generation:  # kept: later metrics replace these
                self.generation = gen
            lost = metrics.get("lost_generation")
            if type(lost) is int and (self.lost_generation is None or lost > self.lost_generation):
                self.lost_generation = lost
            timeout = metrics.get("collective_timeout_s")
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
                self.collective_timeout_s = float(timeout)

    def summary(self, rank: int, now: float) -> RankBeacons:
        return RankBeacons(
            rank=rank,
            first_at=self.first_at,
            last_at=self.last_at,
            age_s=max(0.0, now - self.last_at),
            first_step=self.first_step,
            last_step=self.last_step,
            steps=self.steps,
            beacons=self.beacons,
            step_time_s=statistics.median(self.durations) if self.durations else None,
            last_checkpoint_step=self.last_ckpt,
            checkpoint_stall_s=self.stall_s,
            tokens=self.tokens,
            metrics=dict(self.metrics),
            generation=self.generation,
            lost_generation=self.lost_generation,
            collective_timeout_s=self.collective_timeout_s,
        )


# A parsed message: (attempt_id, rank, step or None, sender time, metrics or None).
Beacon = tuple[int, int, int | None, float, dict[str, Any] | None]


class BeaconBook:
    """Per (attempt, rank) books of received beacons. Thread-safe; every method is O(ranks).

    ``forget(attempt_id)`` drops an attempt and ignores its late messages from then on (a
    straggling process of an ended attempt cannot resurrect it).
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        """Receive times and ``age_s`` come from it (the server stamps batches with it too)."""
        self._lock = threading.Lock()
        self._attempts: dict[int, dict[int, _RankState]] = {}
        self._forgotten: set[int] = set()

    def record(
        self,
        attempt_id: int,
        rank: int,
        step: int | None,
        t: float,
        metrics: dict[str, Any] | None = None,
        *,
        now: float | None = None,
    ) -> None:
        """Book one beacon (``step`` None: a heartbeat) received at ``now`` (default: clock)."""
        self.record_many(
            [(attempt_id, rank, step, t, metrics)], self.clock.now() if now is None else now
        )

    def record_many(self, beacons: Iterable[Beacon], now: float) -> None:
        """Book a batch received at ``now`` under one lock acquisition (the server's path)."""
        with self._lock:
            attempts = self._attempts
            for attempt_id, rank, step, t, metrics in beacons:
                ranks = attempts.get(attempt_id)
                if ranks is None:
                    if attempt_id in self._forgotten:
                        continue
                    ranks = attempts[attempt_id] = {}
                st = ranks.get(rank)
                if st is None:
                    st = ranks[rank] = _RankState(now)
                st.record(step, t, metrics, now)

    def summary(self, attempt_id: int) -> AttemptBeacons:
        """A snapshot of one attempt (empty ``ranks`` when nothing arrived). Never raises."""
        now = self.clock.now()
        with self._lock:
            ranks = self._attempts.get(attempt_id, {})
            return AttemptBeacons(
                attempt_id, now, {r: st.summary(r, now) for r, st in sorted(ranks.items())}
            )

    def attempts(self) -> list[int]:
        """The attempts with at least one beacon, ascending."""
        with self._lock:
            return sorted(self._attempts)

    def forget(self, attempt_id: int) -> None:
        """Drop an attempt's books and ignore its later messages. Idempotent."""
        with self._lock:
            self._attempts.pop(attempt_id, None)
            self._forgotten.add(attempt_id)


# -- the socket ---------------------------------------------------------------------------
def parse_beacon(data: bytes) -> Beacon | None:
    """Decode one message; None when it is not a valid beacon (see :mod:`trainpod.beacon`)."""
    try:
        msg = _decode(data.decode())  # str, not bytes: json.loads(bytes) costs twice as much
        a, r, t = msg["a"], msg["r"], msg["t"]
        s = msg.get("s")
        m = msg.get("m")
        v = msg.get("v", WIRE_VERSION)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if (
        v != WIRE_VERSION  # a newer sender may mean something else by the same keys
        or type(a) is not int
        or type(r) is not int
        or type(t) not in (float, int)
        or (s is not None and type(s) is not int)
        or (m is not None and type(m) is not dict)
    ):
        return None
    return a, r, s, float(t), m


class BeaconServer:
    """Receives beacons on the Unix ``SOCK_SEQPACKET`` socket at ``path`` and books them.

        The constructor binds (replacing a stale socket file left by a dead agent), listens and
        starts a daemon thread; :meth:`close` stops it, closes every connection and removes the
        file. Each training process holds one connection; the thread drains every readable
        connection per wake-up and books the whole batch under one lock, so bursts of many
        thousand messages a second cost little. When it still falls behind, a sender's buffer
        fills and the *sender* drops (it never blocks).

        Raises :class:`~trainpod.errors.Fatal` when ``path`` is too long for ``AF_UNIX`` or is
        not a socket, :class:`~trainpod.errors.Conflict` when a live server already owns it.
        ``mode``: permission bits of the socket file (only the agent's user can connect by default).
    ``tap``: also given every booked batch, on the receiver thread (it must not block: the
        TensorBoard writer queues what it wants).

        Only root and the agent's user connect to ``path``; a rank that runs as a POSIX account
        connects to a socket :meth:`add_listener` opened for it, and what it sends is booked only
        for the attempts ``grants`` gives its uid (the others are dropped, counted in
        ``refused``): no account reports progress for another's job.
    """

    def __init__(
        self,
        path: Path,
        book: BeaconBook | None = None,
        *,
        mode: int = 0o600,
        tap: Callable[[list[Beacon]], None] | None = None,
        grants: Grants | None = None,
    ) -> None:
        self.path = Path(path)
        self.book = book if book is not None else BeaconBook()
        self._tap = tap
        self.grants = grants if grants is not None else Grants()
        self.received = 0
        """Valid beacons booked so far."""
        self.bad = 0
        """Messages that were not valid beacons (ignored)."""
        self.refused = 0
        """Beacons from an account for an attempt that is not its own (dropped, logged once
        per uid and attempt)."""
        self._told: set[tuple[int, int]] = set()
        self._batch: list[Beacon] = []  # parsed in one wake-up of the server's thread
        self._server = SeqpacketServer(
            self.path,
            self._drain,
            what="beacons",
            backlog=LISTEN_BACKLOG,
            mode=mode,
            after_wake=self._book_batch,
            thread_name=f"beacons:{self.path.name}",
        )

    @property
    def connections(self) -> int:
        """Open sender connections (one per live training process that has reported)."""
        return self._server.connections

    @property
    def refused_connections(self) -> int:
        """Connections refused for their peer's uid (see :mod:`trainpod.agent.unixsock`)."""
        return self._server.refused

    def add_listener(self, path: Path, *, uid: int, gid: int) -> None:
        """Receive on ``path`` too, from the account ``uid`` (see
        :meth:`~trainpod.agent.unixsock.SeqpacketServer.add_listener`)."""
        self._server.add_listener(path, uid=uid, gid=gid)

    @property
    def alive(self) -> bool:
        """Whether the receiver thread is booking beacons (False after close or a crash)."""
        return self._server.alive

    def _book_batch(self) -> None:
        parsed = self._batch
        if parsed:
            self._batch = []
            self.received += len(parsed)
            self.book.record_many(parsed, self.book.clock.now())
            if self._tap is not None:
                self._tap(parsed)

    def _drain(self, conn: socket.socket, uid: int) -> bool:
        """Read every queued message of one connection; False (close it) on EOF or error."""
        if not self.grants.trusted(uid):
            return self._drain_account(conn, uid)
        recv, parse, parsed = conn.recv, parse_beacon, self._batch
        while True:
            try:
                data = recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                data = b""
            if not data:  # the sender closed (exited); SEQPACKET has no empty messages
                return False
            beacon = parse(data)
            if beacon is None:
                self.bad += 1
            else:
                parsed.append(beacon)

    def _drain_account(self, conn: socket.socket, uid: int) -> bool:
        """:meth:`_drain` for a rank of an account: only its own attempts' beacons count."""
        while True:
            try:
                data = conn.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                data = b""
            if not data:
                return False
            beacon = parse_beacon(data)
            if beacon is None:
                self.bad += 1
            elif self.grants.may_report(uid, beacon[0]):
                self._batch.append(beacon)
            else:
                self.refused += 1
                if (uid, beacon[0]) not in self._told:
                    self._told.add((uid, beacon[0]))
                    log.warning(
                        "dropped beacons from uid %d for attempt %d: it does not run as that "
                        "account on this node",
                        uid,
                        beacon[0],
                    )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop receiving, close every connection and remove the socket file. Idempotent;
        blocks up to ``timeout_s`` for the receiver thread."""
        self._server.close(timeout_s)

    def __enter__(self) -> BeaconServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
