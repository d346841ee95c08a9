"""Starting daemons in the background and stopping exactly those, by pid file.

A pid is trusted only while the process behind it still has our state dir on its command
line, so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import psutil

from trainpod import procutil
from trainpod.paths import STATE_DIR_ENV

_children: list[subprocess.Popen[bytes]] = []

MARKER_ENV = STATE_DIR_ENV
"""Set to the cluster's state dir in the environment of the controller and the agents that a
local cluster starts, and so inherited by everything they start in turn (replacement agents,
zygotes, ranks, deep checks and their device workers, persisters, lifecycle scripts, shells):
how :func:`sweep` finds what is left once the daemons are gone, whatever its parent was."""


def _reap() -> None:
    """Collect exited children so they do not linger as zombies in a long-lived caller."""
    for p in list(_children):
        if p.poll() is not None:
            _children.remove(p)


def spawn(argv: list[str], *, log: Path, pid_file: Path, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` in its own session, output appended to ``log``; record its pid."""
    _reap()
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    _children.append(proc)
    # Reap it when it exits, so a long-lived parent (the controller replacing agents) keeps
    # no zombies; is_ours() then sees it gone.
    threading.Thread(target=proc.wait, daemon=True).start()
    pid_file.write_text(str(proc.pid))
    return proc.pid


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def is_ours(pid: int | None, marker: str) -> bool:
    """True when ``pid`` is alive (not a zombie) and ``marker`` is on its command line."""
    _reap()
    if pid is None:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return any(marker in part for part in p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def terminate(pids: list[int], marker: str, *, grace_s: float) -> None:
    """SIGTERM each of our pids, wait up to ``grace_s``, then SIGKILL the rest (and wait up
    to 5 s for them)."""
    ours = []
    for pid in pids:
        if is_ours(pid, marker):
            try:
                ours.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
    procutil.terminate(ours, grace_s=grace_s)


def leftovers(marker: str) -> list[psutil.Process]:
    """Live processes (not this one or its ancestors) whose environment has
    :data:`MARKER_ENV` = ``marker``. Processes whose environment cannot be read (another
    user's, when not root) are not looked at."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.pid in mine or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(MARKER_ENV) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def sweep(marker: str, *, grace_s: float, rounds: int = 5) -> list[int]:
    """Terminate every process :func:`leftovers` finds, again while new ones appear (one a
    dying daemon started at the last moment, such as a node's replacement agent). Returns
    the pids it signalled."""
    signalled: list[int] = []
    for _ in range(rounds):
        procs = leftovers(marker)
        if not procs:
            break
        procutil.terminate(procs, grace_s=grace_s)
        signalled += [p.pid for p in procs]
    return signalled
