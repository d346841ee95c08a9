"""How long a rank has used no CPU: what its agent reports as ``RankReport.idle_s``.

The controller stops a rank that stays running, idle, after every other rank of its
attempt exited 0 (stuck in its teardown, ADR 0049); this is the measure it goes by. Work
counts whether the rank's own threads or its child processes do it (a rank waiting on an
evaluation it runs in a subprocess is not idle). The children are looked up only while the
rank itself is idle, so a rank that computes costs one read of ``/proc/PID/stat`` per
report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

WINDOW_S = 1.0
"""The shortest time over which CPU use is compared (a few clock ticks of 10 ms)."""
WORK_CORES = 0.05
"""Using more than this share of one core between two reports is work; below it, what a
process blocked on a lock or a socket accrues (the odd clock tick of a waking thread)."""


def tree_cpu_s(pid: int, *, children: bool) -> float | None:
    """CPU seconds used by ``pid`` (its threads and the children it reaped), with its live
    children's when ``children``; None when the process is gone."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        if children:
            for child in proc.children(recursive=True):
                try:
                    c = child.cpu_times()
                except psutil.Error:
                    continue  # ended meanwhile: its time is its parent's once reaped
                total += c.user + c.system
        return total
    except psutil.Error:
        return None


@dataclass(frozen=True)
class _Sample:
    at: float
    own: float
    total: float | None  # with the live children; None when not looked up


@dataclass
class IdleMeter:
    """Seconds since a process was last seen working; None while it works.

    A call compares the process's CPU time with the previous comparison's, at least
    ``WINDOW_S`` earlier (a call sooner repeats the previous answer): more than
    ``work_cores`` of a core in between is work and restarts the count. The first call, and
    the first after the process worked, say it works."""

    work_cores: float = WORK_CORES
    clock: Callable[[], float] = time.monotonic
    cpu: Callable[..., float | None] = tree_cpu_s
    _last: _Sample | None = field(default=None, init=False)
    _idle_since: float | None = field(default=None, init=False)
    _pid: int | None = field(default=None, init=False)

    def idle_s(self, pid: int) -> float | None:
        now = self.clock()
        if pid != self._pid:  # another process of the rank (an in-process restart)
            self._pid, self._last, self._idle_since = pid, None, None
        last = self._last
        if last is not None and now - last.at < WINDOW_S:
            # Too soon to tell work from a tick: the previous answer stands.
            return None if self._idle_since is None else now - self._idle_since
        own = self.cpu(pid, children=False)
        if own is None:
            return None
        worked = last is None or self._more(own - last.own, now - last.at)
        total = None
        if not worked:
            assert last is not None
            # The rank itself rested: its children (if any) may be the ones working.
            total = self.cpu(pid, children=True)
            worked = (
                total is None or last.total is None or self._more(total - last.total, now - last.at)
            )
        self._last = _Sample(now, own, total)
        if worked or last is None:
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = last.at
        return now - self._idle_since

    def _more(self, used_s: float, elapsed_s: float) -> bool:
        return used_s > self.work_cores * elapsed_s
