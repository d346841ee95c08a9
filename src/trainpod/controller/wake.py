"""Wake-ups: a version bumped on every change, seen by the reconcile loop and long polls.

Threads wait on a :class:`threading.Condition` (tests' fake agents, sync callers). The
API's long polls are parked by :class:`~trainpod.api.heartbeat.BeatRunner`, which listens
here (:meth:`Wake.listen`): on a change it looks up the parked nodes' orders once, together,
and wakes only the polls whose orders differ from those their agent holds. Waking every
parked poll instead (a thousand, each to look up its own orders, find them unchanged and
park again) cost more than the beats themselves, several times a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Wake:
    def __init__(self, lock: threading.RLock) -> None:
        self.version = 0
        self.changed = threading.Condition(lock)
        self.step_due = threading.Event()  # set when step() has work to do
        self._listeners: list[Callable[[], None]] = []

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every bump (on the bumping thread, with the controller's
        lock held: it must only hand the news on, never wait)."""
        self._listeners = [*self._listeners, listener]  # a new list: bumps iterate the old

    def unlisten(self, listener: Callable[[], None]) -> None:
        self._listeners = [x for x in self._listeners if x != listener]

    def bump(self) -> None:
        """Something changed: wake the reconcile loop, waiting threads and the listeners.

        Called with the controller's lock held."""
        self.version += 1
        self.changed.notify_all()
        self.step_due.set()
        for listener in self._listeners:
            listener()
