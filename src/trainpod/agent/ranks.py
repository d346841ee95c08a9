"""A node's ranks as its agent holds them: the processes of attempts, their logs and the
preemption notice they are given (:class:`Notice`), for :mod:`trainpod.agent.launcher`.

A rank is a process leading its own process group (:func:`signal_group` signals the whole
group); its stdout and stderr go to a per-rank log (:func:`open_log`), whose end the agent
reports for a rank that failed (:func:`log_tail`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil

from trainpod import notice, procutil
from trainpod.agent.accounts import RunAs
from trainpod.agent.idle import IdleMeter
from trainpod.agent.warmstart import WarmProcess
from trainpod.api.models import KillOrder, LaunchOrder, RankReport
from trainpod.elastic import protocol as elastic_protocol

TAIL_BYTES = 4096
TAIL_LINES = 30


def log_tail(path: Path, max_bytes: int = TAIL_BYTES, max_lines: int = TAIL_LINES) -> str:
    """The last lines of a log file, or "" when it does not exist."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-max_lines:])


@dataclass(frozen=True)
class Notice:
    """What a preempted attempt's ranks are told before they are torn down."""

    signal: signal.Signals
    grace_s: float
    reason: str = "preempted"

    @classmethod
    def of(cls, order: KillOrder) -> Notice | None:
        if order.notice_signal is None:
            return None
        return cls(notice.parse_signal(order.notice_signal), order.notice_grace_s, order.reason)


def notice_file(log_dir: str | Path, node: str) -> Path:
    """Where a node's ranks of an attempt find their notice (in the attempt's log dir)."""
    return Path(log_dir) / f"notice-{node}.json"


def ignore_notice_signal(sig: signal.Signals) -> None:
    """Ignore ``sig`` in this process (the agent's main thread, before it starts anything),
    so that every process it starts inherits SIG_IGN for it."""
    signal.signal(sig, signal.SIG_IGN)


@dataclass
class AgentRank:
    """One rank of an attempt as its agent reports it (:meth:`report`). The launcher's ranks
    are :class:`RankProcess`; :class:`trainpod.testing.FakeAgent` extends this class too, so
    a fake's reports cannot drift from the real agent's."""

    rank: int
    local_rank: int
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    delivered: bool = False  # the controller has acknowledged this rank's exit

    @property
    def running(self) -> bool:
        return self.ended_at is None

    def _pid(self) -> int | None:
        return None

    def _log_tail(self) -> str:
        """The end of the rank's log; read only for a rank that failed."""
        return ""

    def _idle_s(self) -> float | None:
        """Seconds the running rank has used no CPU (:mod:`trainpod.agent.idle`)."""
        return None

    def report(self) -> RankReport:
        failed = not self.running and (self.exit_code != 0 or self.signal is not None)
        return RankReport(
            rank=self.rank,
            local_rank=self.local_rank,
            pid=self._pid(),
            state="running" if self.running else "exited",
            exit_code=self.exit_code,
            signal=self.signal,
            started_at=self.started_at,
            ended_at=self.ended_at,
            log_tail=self._log_tail() if failed else "",
            idle_s=self._idle_s() if self.running else None,
        )


KEEP_FOR_RECOVERY_S = 120.0
"""How long a failed in-process run is kept for its recover order (past the controller's
60 s ``in_process_deadline_s``, after which it gives the recovery up)."""


@dataclass
class RankProcess(AgentRank):
    log_path: Path = field(kw_only=True)
    proc: subprocess.Popen[bytes] | WarmProcess | None = None
    again: dict[str, str] = field(default_factory=dict, kw_only=True)
    """The variables of a rank started anew in its attempt (the new group's, ADR 0026)."""
    idle: IdleMeter = field(default_factory=IdleMeter, kw_only=True, repr=False)

    def _pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

    def _idle_s(self) -> float | None:
        pid = self._pid()
        return None if pid is None else self.idle.idle_s(pid)


@dataclass
class AttemptRun:
    order: LaunchOrder
    ranks: list[RankProcess] = field(default_factory=list)
    killing: bool = False
    generation: int = 0  # the newest in-process recovery applied to it (ADR 0026)
    starting: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Held while ranks of the run are being started (its launch, a recovery's restarts):
    one after another, in the order they were asked for."""
    kept_until: float | None = None
    """An in-process job's run whose every rank here failed is kept this long after its
    exits were delivered, for the recover order that starts them again (ADR 0035)."""

    @property
    def awaits_recovery(self) -> bool:
        """Opted in, not stopped by trainpod, and a rank here failed: the controller may
        start it again in the same attempt (a node with one rank has no other to keep the
        run alive meanwhile)."""
        opted = self.order.env.get(elastic_protocol.ENV_RECOVERY) == elastic_protocol.IN_PROCESS
        failed = any(r.exit_code not in (0, None) or r.signal is not None for r in self.ranks)
        return opted and failed and not self.killing

    @property
    def running(self) -> bool:
        return any(r.running for r in self.ranks)


def open_log(path: Path, *, private: bool) -> BinaryIO:
    """A rank's log, appended to. ``private`` (a rank of an account): made 0600, the agent's,
    so no other account on the node reads it; the rank writes it through the descriptor it
    inherits, the agent and the controller read it."""
    if not private:
        return path.open("ab")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # one left by an earlier agent keeps no wider mode
    return os.fdopen(fd, "ab")


def write_notice(path: Path, data: bytes, owner: RunAs | None) -> None:
    """Write a notice file whole or not at all (tmp + rename), as the agent: with an
    ``owner``, in a directory that account owns, so the tmp file is made afresh
    (``O_EXCL | O_NOFOLLOW``: never through a link the account left) and given to it, 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if owner is not None:
            os.fchown(fd, owner.uid, owner.gid)
        os.write(fd, data)
    finally:
        os.close(fd)
    tmp.replace(path)  # a rank never reads half a notice


def note_signal(p: psutil.Process, sig: int) -> None:
    if isinstance(p, procutil.Owned) and isinstance(p.owner, WarmProcess):
        p.owner.note_signal(sig)


def signal_group(r: RankProcess, sig: signal.Signals) -> None:
    assert r.proc is not None
    if isinstance(r.proc, WarmProcess):
        r.proc.note_signal(sig)
    try:
        os.killpg(r.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
