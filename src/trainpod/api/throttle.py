"""Failed authentications, limited per client address (issue 14 item 5, ADR 0032).

After ``max_failures`` failed authentications (401s) from one address within ``window_s``,
that address's calls are answered 429 with ``Retry-After`` until the oldest failure of the
window has aged out; a valid token does not bypass it (a throttled address gets no answer
that tells a good guess from a bad one). Each run of failures that starts a throttle is
recorded once (the API appends an ``auth_throttled`` event when :meth:`AuthThrottle.failed`
says so), and every failure and every 429 is counted for ``/metrics``.

Each failure is also recorded as an ``auth_failed`` event (the client's address, the call, why
the token was refused), at most ``max_failures`` of them per address per window: a throttled
address is refused before its token is read, so it adds none, and an exempt address's
failures past the cap are counted and carried by its next recorded one (``unrecorded``). The
event log grows by at most ``max_failures`` events per address a window, whatever is sent.

Loopback addresses are exempt by default: on a local cluster the agents and the CLI share
127.0.0.1 with every local user, and a throttled loopback would let any of them cut the
agents' heartbeats off (nodes lost, jobs restarted) by sending bad tokens. A throttle is for
clients across the network.

Memory is bounded: an address's failures older than the window are dropped when it is next
seen, and at most ``max_clients`` addresses are remembered (the stalest forgotten first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class Failure:
    """What to record of one failed authentication (:meth:`AuthThrottle.failed`)."""

    record: bool
    """Append an ``auth_failed`` event for it (False past the cap of an exempt address)."""
    unrecorded: int
    """Failures of this address before it that were counted but not recorded."""
    throttles: bool
    """It starts a throttle: its address's calls are answered 429 from now on."""


class AuthThrottle(Collector):
    def __init__(
        self,
        *,
        max_failures: int = 10,
        window_s: float = 60.0,
        exempt: Iterable[str] = LOOPBACK,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._exempt = frozenset(exempt)
        self._clock = clock
        self._max_clients = max_clients
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._unrecorded: dict[str, int] = {}
        self.failed_total = 0
        self.throttled_total = 0

    def _recent(self, client: str, now: float) -> deque[float]:
        seen = self._failures.get(client)
        if seen is None:
            return deque()
        while seen and seen[0] <= now - self.window_s:
            seen.popleft()
        if not seen:
            del self._failures[client]
        return seen

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again, or None when it is not throttled (a
        call from a throttled client is counted as a 429)."""
        if client in self._exempt:
            return None
        now = self._clock()
        with self._lock:
            seen = self._recent(client, now)
            if len(seen) < self.max_failures:
                return None
            self.throttled_total += 1
            return max(seen[-self.max_failures] + self.window_s - now, 0.001)

    def failed(self, client: str) -> Failure:
        """Count a failed authentication of ``client`` and say what to record of it."""
        now = self._clock()
        with self._lock:
            self.failed_total += 1
            seen = self._recent(client, now)
            if len(seen) >= self.max_failures:  # an exempt address past its cap (or a race)
                self._unrecorded[client] = self._unrecorded.get(client, 0) + 1
                return Failure(record=False, unrecorded=0, throttles=False)
            seen.append(now)
            self._failures[client] = seen
            self._failures.move_to_end(client)
            while len(self._failures) > self._max_clients:
                gone, _ = self._failures.popitem(last=False)
                self._unrecorded.pop(gone, None)
            unrecorded = self._unrecorded.pop(client, 0)
            throttles = client not in self._exempt and len(seen) == self.max_failures
            return Failure(record=True, unrecorded=unrecorded, throttles=throttles)

    def collect(self) -> Iterable[CounterMetricFamily]:
        failed = CounterMetricFamily(
            "trainpod_auth_failures", "Failed authentications (401), every client address"
        )
        failed.add_metric([], self.failed_total)
        throttled = CounterMetricFamily(
            "trainpod_auth_throttled",
            "Calls answered 429: their address failed to authenticate too often",
        )
        throttled.add_metric([], self.throttled_total)
        return [failed, throttled]
