"""Wake-ups: a version bumped on every change, seen by the reconcile loop and long polls.

Threads wait on a :class:`threading.Condition` (tests' fake agents, sync callers); the
API's heartbeat handler parks a long poll as a bare future of its event loop, with a timer
handle for its deadline: no task and no thread per waiting agent (``asyncio.wait_for`` on
an event made a task, a timer and a second future for each of a thousand polls a second).
A change resolves every parked future of each loop in one callback on that loop.
"""

from __future__ import annotations

import asyncio
import threading


class Wake:
    def __init__(self, lock: threading.RLock) -> None:
        self.version = 0
        self.changed = threading.Condition(lock)
        self.step_due = threading.Event()  # set when step() has work to do
        # The parked long polls of each event loop; touched on that loop only (a bump from
        # another thread hands _fire to the loop), the dict itself under _loops_lock.
        self._loops: dict[asyncio.AbstractEventLoop, set[asyncio.Future[bool]]] = {}
        self._loops_lock = threading.Lock()

    def bump(self) -> None:
        """Something changed: wake the reconcile loop and every parked long poll.

        Called with the controller's lock held."""
        self.version += 1
        self.changed.notify_all()
        self.step_due.set()
        with self._loops_lock:
            loops = list(self._loops)
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._fire, loop)
            except RuntimeError:  # the loop was closed (the server shut down)
                with self._loops_lock:
                    self._loops.pop(loop, None)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._loops_lock:
            parked = self._loops.get(loop)
            if not parked:
                return
            self._loops[loop] = set()
        for waiter in parked:
            if not waiter.done():
                waiter.set_result(True)

    async def changed_since(self, version: int, timeout_s: float) -> bool:
        """Wait, holding no thread, until the version moves past ``version`` (True) or
        ``timeout_s`` has passed (whether it moved meanwhile)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        with self._loops_lock:  # parked before the version is read: a bump from now on fires
            self._loops.setdefault(loop, set()).add(waiter)
        if self.version != version:
            with self._loops_lock:
                self._loops[loop].discard(waiter)
            return True
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            with self._loops_lock:
                parked = self._loops.get(loop)
                if parked is not None:
                    parked.discard(waiter)
        return self.version != version


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
