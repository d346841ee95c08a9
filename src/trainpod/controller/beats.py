"""The agents' side of the controller: a beat, a batch of beats and look-ups, a long poll.

:meth:`Beats.beat` records one agent's report through the
:class:`~trainpod.controller.intake.HeartbeatIngest` and answers with its orders from the
:class:`~trainpod.controller.orders.OrderDesk`; :meth:`Beats.serve` does that for every beat
and look-up the API's heartbeat thread hands over at once (:mod:`trainpod.api.heartbeat`);
:meth:`Beats.heartbeat` is the long poll for threads (the API's own waits on the event loop).
Each takes the controller's lock (re-entrant: a batch holds it across its beats).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from trainpod.api.models import Heartbeat, Orders
from trainpod.clock import Clock
from trainpod.controller.intake import HeartbeatIngest
from trainpod.controller.orders import OrderDesk
from trainpod.controller.passes import SchedulingPass
from trainpod.controller.transitions import Transitions
from trainpod.controller.wake import Wake
from trainpod.store.repo import Store


@dataclass
class Beats:
    lock: threading.RLock
    store: Store
    clock: Clock
    wake: Wake
    tx: Transitions
    intake: HeartbeatIngest
    orders: OrderDesk
    passes: SchedulingPass

    def beat(self, hb: Heartbeat) -> tuple[Orders, int]:
        """Record an agent's report; its orders now and the version they were made at.

        A report that gave nodes back (an attempt ended) runs the scheduling pass at once,
        here: the next job is placed before this reply is sent, so the reporting node gets
        its launch order in the reply and the others' parked polls are woken with theirs,
        without waiting for the reconcile loop to come round."""
        with self.lock:
            before, freed = self.store.appended, self.tx.released
            now = self.clock.now()
            with self.store.transaction():
                self.intake.apply(hb, now)
            if self.store.appended != before:
                # Something happened (every change writes an event): wake the loop and the
                # parked polls. A beat that only says "still here" wakes nobody, or a
                # thousand agents would each wake the thousand others every second.
                self.wake.bump()
            if self.tx.released != freed:
                self.passes.after_release(now)
            return self.orders.for_node(hb.node), self.wake.version

    def orders_for(self, node: str) -> tuple[Orders, int]:
        with self.lock:
            return self.orders.for_node(node), self.wake.version

    def serve(self, work: Sequence[Heartbeat | str]) -> list[tuple[Orders, int] | Exception]:
        """Beats (a :class:`Heartbeat`: :meth:`beat`) and order look-ups (a node's name:
        :meth:`orders_for`) under one hold of the lock; a reply for each, in order. The
        API's heartbeat thread hands over every beat that arrived meanwhile, instead of
        queueing each on the lock behind the reconcile step. They are committed together
        (one SQLite transaction, a savepoint each: a beat that fails leaves no trace, the
        others stay), before any is answered. An item's error is its reply."""
        done: dict[int, tuple[Orders, int] | Exception] = {}
        with self.lock, self.store.transaction():
            for i, w in enumerate(work):
                if isinstance(w, Heartbeat):
                    try:
                        with self.store.savepoint():
                            done[i] = self.beat(w)
                    except Exception as exc:  # that call's error (its reply), not the others'
                        done[i] = exc
            # The look-ups after every beat (the freshest orders), together: all at one
            # version, what nodes' orders share read once.
            looked_up = [i for i, w in enumerate(work) if not isinstance(w, Heartbeat)]
            if looked_up:
                try:
                    found = self.orders.for_nodes([str(work[i]) for i in looked_up])
                    done.update(
                        (i, (o, self.wake.version)) for i, o in zip(looked_up, found, strict=True)
                    )
                except Exception as exc:
                    done.update((i, exc) for i in looked_up)
        return [done[i] for i in range(len(work))]

    def stamp(self, orders: Orders) -> Orders:
        """``orders`` with the controller's time, as they leave for the agent."""
        return orders.model_copy(update={"controller_time": self.clock.now()})

    def heartbeat(self, hb: Heartbeat) -> Orders:
        """Record an agent's report and return its orders (for threads; the API uses the
        async long poll in :mod:`trainpod.api.heartbeat`, which holds no thread while it
        waits).

        With ``hb.wait_s > 0`` and orders equal to those the agent holds, the reply waits up
        to ``wait_s`` for them to change (a long poll), so new orders arrive at once.
        """
        with self.lock:
            orders, version = self.beat(hb)
            # Real time, like the wait itself: an injected (fake) clock may never move.
            deadline = time.monotonic() + hb.wait_s
            while hb.wait_s > 0 and orders.hash == hb.orders_hash:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.wake.changed.wait(remaining)
                if self.wake.version != version:
                    orders, version = self.orders_for(hb.node)
            return self.stamp(orders)
