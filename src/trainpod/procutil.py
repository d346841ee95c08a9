"""Stopping processes: SIGTERM, a grace period, then SIGKILL, with psutil's waits.

A leaf module: it imports nothing of trainpod's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Protocol

import psutil

__all__ = ["Owned", "terminate"]


class _Waitable(Protocol):
    pid: int

    def wait(self, timeout: float | None = None) -> int: ...


class Owned(psutil.Process):
    """A child whose exit status its owner collects (a ``subprocess.Popen``, a warm-started
    rank). Waits go through ``owner.wait``: psutil's own wait would reap the child first,
    and ``Popen`` would then report exit code 0 for a process that was killed.

    Raises ``psutil.NoSuchProcess`` when the process is gone (reaped) already.
    """

    def __init__(self, owner: _Waitable) -> None:
        super().__init__(owner.pid)
        self.owner = owner

    def wait(self, timeout: float | None = None) -> int:
        return self.owner.wait(timeout)  # raises subprocess.TimeoutExpired, as wait_procs expects


def _send(proc: psutil.Process, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)  # psutil checks first that the pid was not reused
    except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
        pass  # gone already (a group whose every member has exited)


def terminate(
    procs: Sequence[psutil.Process],
    *,
    grace_s: float,
    kill_wait_s: float = 5.0,
    groups: bool = False,
    before_signal: Callable[[psutil.Process, int], None] | None = None,
) -> list[psutil.Process]:
    """SIGTERM each process, then SIGCONT (a stopped process must wake to see the SIGTERM);
    wait up to ``grace_s`` for them to exit; SIGKILL those left and wait up to
    ``kill_wait_s``. Returns the processes still alive after that.

    ``groups``: signal each process's process group instead (the process leads it), and
    SIGKILL every group after the grace, not only those whose leader is left: children may
    outlive their leader. ``before_signal(proc, sig)`` runs before each signal is sent.

    Blocks up to ``grace_s + kill_wait_s``; never raises for a process that is gone.
    """

    def send(p: psutil.Process, sig: int) -> None:
        if before_signal is not None:
            before_signal(p, sig)
        _send(p, sig, groups)

    for p in procs:
        send(p, signal.SIGTERM)
        send(p, signal.SIGCONT)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in procs if groups else alive:
        send(p, signal.SIGKILL)
    if not alive:
        return []
    _, alive = psutil.wait_procs(alive, timeout=kill_wait_s)
    return alive
