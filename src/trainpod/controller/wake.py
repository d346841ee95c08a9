"""Wake-ups: a version bumped on every change, seen by the reconcile loop and long polls.

Threads wait on a :class:`threading.Condition` (tests' fake agents, sync callers); the
API's heartbeat handler waits on an :class:`asyncio.Event` per event loop instead, so a
parked long poll holds no thread (a thousand waiting agents cost a thousand futures).
"""

from __future__ import annotations

import asyncio
import threading


class Wake:
    def __init__(self, lock: threading.RLock) -> None:
        self.version = 0
        self.changed = threading.Condition(lock)
        self.step_due = threading.Event()  # set when step() has work to do
        self._loops: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}
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
            event = self._loops.get(loop)
            self._loops[loop] = asyncio.Event()
        if event is not None:
            event.set()

    async def changed_since(self, version: int, timeout_s: float) -> bool:
        """Wait, holding no thread, until the version moves past ``version``."""
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            event = self._loops.setdefault(loop, asyncio.Event())
        if self.version != version:
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return self.version != version
        return True
