"""The rendezvous stores the node leader's agent hosts for its attempts (ADR 0028).

torchrun's launcher, not a worker, hosts the c10d ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``
and outlives its workers, so ranks may end in any order: a rank whose teardown talks to the
store (``destroy_process_group``, Gloo's goodbye) never finds it gone because rank 0 left
first. trainpod does the same: the agent of an attempt's first node (group rank 0, which runs
rank 0) opens a store for the attempt before its first rank starts, with
``TORCHELASTIC_USE_AGENT_STORE=True`` in every rank's env so every rank, rank 0 included,
connects as a client (``torch.distributed.rendezvous._create_c10d_store``). An attempt
recovered in process (ADR 0026) gets one more store per generation, at the generation's port.

The store stays open until the controller's orders no longer name the attempt among this
node's stores (:attr:`trainpod.api.models.Orders.stores`): the attempt has ended, every rank
on every node with it (finished, failed or killed). Only orders the controller made after a
store was opened may close it (:meth:`RendezvousStores.keep`'s ``asked_at``): a reply to a
heartbeat sent before the launch cannot know of the attempt.

torch is imported on the first store, so an agent that never leads an attempt never loads it.
That import takes seconds (15-30 s at load 16 on the CI box): :meth:`RendezvousStores.open_soon`
opens a store in a thread of its own and the ranks start at once, in parallel with it. A rank
imports torch itself before it connects, and a c10d client retries a refused connection until
its timeout, so a rank that comes first waits for the store as ranks on other nodes always
have; the agent's heartbeats never wait for it.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: the server side's timeout (only its own operations use it; clients bring their own)
STORE_TIMEOUT_S = 300.0


class StoreError(Exception):
    """A store could not be opened (its port is taken, its address is not this host's)."""


def tcp_store(addr: str, port: int) -> object:
    """A c10d TCPStore server on ``port``, as torchrun's agent hosts it: multi-tenant, on
    libuv, not waiting for workers. It stops when the last reference to it goes."""
    import torch.distributed as dist  # here: only a node that leads an attempt needs torch

    try:
        return dist.TCPStore(
            host_name=addr,
            port=port,
            world_size=None,
            is_master=True,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=True,
        )
    except (RuntimeError, ValueError) as exc:  # DistNetworkError is a RuntimeError
        raise StoreError(f"cannot host the rendezvous store on port {port}: {exc}") from exc


@dataclass
class _Hosted:
    opened_at: float
    stores: dict[int, object] = field(default_factory=dict)  # port -> the server


class RendezvousStores:
    """The stores this agent hosts, by attempt. Thread-safe; every method is idempotent."""

    def __init__(
        self,
        factory: Callable[[str, int], object] = tcp_store,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``factory(addr, port)``: a store server, closed when dropped. ``clock``: the
        monotonic time :meth:`keep`'s ``asked_at`` is read on."""
        self._factory = factory
        self._clock = clock
        self._lock = threading.Lock()
        self._hosted: dict[int, _Hosted] = {}
        self._opening: set[tuple[int, int]] = set()  # (attempt, port) being opened in a thread

    def open(self, attempt_id: int, addr: str, port: int) -> bool:
        """Host ``attempt_id``'s store on ``port`` (its first or a later generation's).

        True if it is open now. A store that cannot be opened is logged and False: the ranks
        then fail to meet, and the attempt ends like any whose rendezvous failed. The store is
        made outside the lock (the first one imports torch): :meth:`keep` never waits for it."""
        with self._lock:
            hosted = self._hosted.setdefault(attempt_id, _Hosted(self._clock()))
            if port in hosted.stores:
                return True
        return self._make(attempt_id, hosted, addr, port)

    def _make(self, attempt_id: int, hosted: _Hosted, addr: str, port: int) -> bool:
        try:
            store = self._factory(addr, port)
        except StoreError as exc:
            log.error("attempt %d: %s", attempt_id, exc)
            return False
        with self._lock:
            if self._hosted.get(attempt_id) is not hosted:  # it ended meanwhile: drop it
                log.info("attempt %d ended before its store on port %d opened", attempt_id, port)
                return False
            hosted.stores.setdefault(port, store)
        log.info("attempt %d: hosting its rendezvous store on %s:%d", attempt_id, addr, port)
        return True

    def open_soon(self, attempt_id: int, addr: str, port: int) -> None:
        """Open the store as :meth:`open` does, in a thread of its own: returns at once, so
        the caller (the agent's beat) never waits for torch's import. Called again while that
        thread runs, or once the store is open, it does nothing. If :meth:`keep` closes the
        attempt before the store is up, the store is dropped as soon as it is made."""
        with self._lock:
            hosted = self._hosted.setdefault(attempt_id, _Hosted(self._clock()))
            if port in hosted.stores or (attempt_id, port) in self._opening:
                return
            self._opening.add((attempt_id, port))

        def run() -> None:
            try:
                self._make(attempt_id, hosted, addr, port)
            finally:
                with self._lock:
                    self._opening.discard((attempt_id, port))

        threading.Thread(target=run, name=f"rdzv-store-{attempt_id}", daemon=True).start()

    def hosts(self, attempt_id: int) -> bool:
        with self._lock:
            return attempt_id in self._hosted

    def ports(self) -> dict[int, list[int]]:
        """Every attempt hosted here and its open ports."""
        with self._lock:
            return {a: sorted(h.stores) for a, h in self._hosted.items()}

    def keep(self, attempt_ids: Iterable[int], *, asked_at: float) -> list[int]:
        """Close the stores of every attempt not in ``attempt_ids`` (the controller's list of
        this node's stores, in a reply to a request sent at ``asked_at`` on this clock) that
        was opened before ``asked_at``. Returns the attempts closed."""
        keep = set(attempt_ids)
        with self._lock:
            gone = [a for a, h in self._hosted.items() if a not in keep and h.opened_at < asked_at]
            closing = [self._hosted.pop(a) for a in gone]
        for attempt_id, hosted in zip(gone, closing, strict=True):
            ports = sorted(hosted.stores)
            hosted.stores.clear()  # the last reference: each server stops here
            log.info("attempt %d ended: closed its rendezvous store (ports %s)", attempt_id, ports)
        return gone

    def close_all(self) -> None:
        """Close every store (the agent is leaving)."""
        self.keep((), asked_at=float("inf"))
