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
CHILDREN_WINDOW_S = 5.0
"""How often a resting rank's children are looked at (a scan of the process table)."""
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


@dataclass
class IdleMeter:
    """Seconds since a process was last seen working; None while it works.

    A call compares the process's own CPU time with the previous comparison's, at least
    ``WINDOW_S`` earlier (a call sooner repeats the previous answer): more than
    ``work_cores`` of a core in between is work and restarts the count. While the process
    itself rests, its live children's CPU time is compared too, every ``CHILDREN_WINDOW_S``
    (a scan of the process table each time: a few milliseconds on a busy node), so a rank
    whose child works is never idle for longer than that. The first call, the first after
    the process worked, and the first look at its children say it works."""

    work_cores: float = WORK_CORES
    clock: Callable[[], float] = time.monotonic
    cpu: Callable[..., float | None] = tree_cpu_s
    _last: tuple[float, float] | None = field(default=None, init=False)  # (at, own CPU s)
    _tree: tuple[float, float] | None = field(default=None, init=False)  # (at, with children)
    _idle_since: float | None = field(default=None, init=False)
    _pid: int | None = field(default=None, init=False)

    def idle_s(self, pid: int) -> float | None:
        now = self.clock()
        if pid != self._pid:  # another process of the rank (an in-process restart)
            self._pid, self._last, self._tree, self._idle_since = pid, None, None, None
        last = self._last
        if last is not None and now - last[0] < WINDOW_S:
            # Too soon to tell work from a tick: the previous answer stands.
            return None if self._idle_since is None else now - self._idle_since
        own = self.cpu(pid, children=False)
        if own is None:
            return None
        self._last = (now, own)
        if last is None or self._more(own - last[1], now - last[0]):
            self._tree = self._idle_since = None  # it works (or is new to us)
            return None
        tree = self._tree
        if tree is None or now - tree[0] >= CHILDREN_WINDOW_S:
            # The rank itself rested: its children (if any) may be the ones working.
            total = self.cpu(pid, children=True)
            if total is None:
                return None
            self._tree = (now, total)
            if tree is None or self._more(total - tree[1], now - tree[0]):
                self._idle_since = None  # its children work (or were not looked at yet)
                return None
        if self._idle_since is None:
            self._idle_since = last[0]
        return now - self._idle_since

    def _more(self, used_s: float, elapsed_s: float) -> bool:
        return used_s > self.work_cores * elapsed_s
