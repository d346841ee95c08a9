"""Preemption notices as a training script sees them: a signal and a file.

When the controller preempts a job, each node's agent first writes the notice file
(``TRAINPOD_NOTICE_FILE``, one per node and attempt) and then sends the notice signal
(``TRAINPOD_NOTICE_SIGNAL``, SIGUSR1 unless the cluster spec says otherwise) to every rank's
process group; after the grace period the ranks are torn down as usual (SIGTERM, then
SIGKILL). Ranks start with the notice signal ignored, so a script that never asks is not
killed by it: it simply gets the grace period, then SIGTERM.

:func:`preempted` (``trainpod.preempted()``) is the flag. Its first call installs a handler
for the notice signal (from the main thread only; signal handlers live there); the file
covers a notice that came before any handler, or a call from another thread. A loop reads::

    if trainpod.preempted(sync=True):  # every rank agrees, so all stop at the same step
        ckpt.save(step, state)
        ckpt.wait()
        sys.exit(0)

A leaf: imports nothing of trainpod (torch only when ``sync=True`` finds it initialised).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: `import trainpod` stays light (beacon.py)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import FrameType
    from typing import Any

DEFAULT_SIGNAL = "SIGUSR1"
ENV_SIGNAL = "TRAINPOD_NOTICE_SIGNAL"
ENV_FILE = "TRAINPOD_NOTICE_FILE"

# Uncatchable, teardown's own, or ignored by default/job control: none can be a notice.
_UNSUITABLE = {
    "SIGKILL": "it cannot be caught",
    "SIGSTOP": "it cannot be caught",
    "SIGTERM": "teardown sends it after the grace period",
    "SIGINT": "it means interrupt (KeyboardInterrupt in Python)",
    "SIGCHLD": "child processes send it",
    "SIGCONT": "it resumes stopped processes",
    "SIGWINCH": "terminals send it",
    "SIGURG": "sockets send it",
    "SIGPIPE": "broken pipes raise it",
}
SUGGESTED = ("SIGUSR1", "SIGUSR2", "SIGHUP")


def parse_signal(name: str) -> signal.Signals:
    """The signal a notice is sent with, from its name (``SIGUSR1``, ``USR1``, ``usr1``).

    Raises ValueError naming what is wrong and what to use instead."""
    text = name.strip().upper()
    full = text if text.startswith("SIG") else f"SIG{text}"
    fix = f"use one of {', '.join(SUGGESTED)}"
    try:
        sig = signal.Signals[full]
    except KeyError:
        raise ValueError(f"{name!r} is not a signal name; {fix}") from None
    if full in _UNSUITABLE or sig.value in _reserved():
        why = _UNSUITABLE.get(full) or "it stops or crashes processes"
        raise ValueError(f"{name!r} cannot be the preemption notice: {why}; {fix}")
    return sig


def _reserved() -> set[int]:
    """Signals the kernel sends on a fault or to stop a process: never a notice."""
    names: tuple[str, ...] = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP")
    names += ("SIGSYS", "SIGTSTP", "SIGTTIN", "SIGTTOU")  # the last three stop a process
    return {s.value for n in names if (s := getattr(signal, n, None)) is not None}


class NoticeWatcher:
    """Whether this process has had its preemption notice. Thread-safe.

    ``env`` gives ``TRAINPOD_NOTICE_SIGNAL`` and ``TRAINPOD_NOTICE_FILE`` (default:
    ``os.environ``, read on the first call)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = env
        self._lock = threading.Lock()
        self._noticed = False
        self._installed = False
        self._signal: signal.Signals | None = None
        self._file: Path | None = None
        self._previous: Any = None

    @property
    def signal(self) -> signal.Signals:
        self._setup()
        assert self._signal is not None
        return self._signal

    @property
    def file(self) -> Path | None:
        self._setup()
        return self._file

    def preempted(self, *, sync: bool = False) -> bool:
        """True once the notice has come (by signal or by file); stays True.

        ``sync=True``: with ``torch.distributed`` initialised, every rank of the default
        group agrees (an all-reduce with MAX), so that all stop at the same step; a
        collective: call it on every rank at the same point."""
        self._setup()
        noticed = self._noticed or self._file_says()
        if noticed:
            self._noticed = True
        if sync:
            noticed = _agree(noticed)
            self._noticed = self._noticed or noticed
        return noticed

    def note(self) -> None:
        """Record the notice (what the signal handler does)."""
        self._noticed = True

    def uninstall(self) -> None:
        """Put back the handler found before :meth:`preempted` installed ours."""
        with self._lock:
            if self._installed and self._signal is not None and _main_thread():
                signal.signal(self._signal, self._previous)
                self._installed = False

    def _setup(self) -> None:
        if self._installed or (self._signal is not None and not _main_thread()):
            return
        with self._lock:
            env = os.environ if self._env is None else self._env
            if self._signal is None:
                self._signal = parse_signal(env.get(ENV_SIGNAL) or DEFAULT_SIGNAL)
                path = env.get(ENV_FILE)
                self._file = Path(path) if path else None
            if not self._installed and _main_thread():
                self._previous = signal.signal(self._signal, self._handle)
                self._installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._noticed = True
        if callable(self._previous):  # a handler of the script's own keeps working
            self._previous(signum, frame)

    def _file_says(self) -> bool:
        return self._file is not None and self._file.exists()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _agree(flag: bool) -> bool:
    """``flag`` MAX-reduced over torch.distributed's default group (as is without one)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return flag
    import torch

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


_WATCHER = NoticeWatcher()


def preempted(*, sync: bool = False) -> bool:
    """True once this job's preemption notice has come: save a checkpoint now and exit.

    ``sync=True`` makes every rank of ``torch.distributed``'s default group agree (a
    collective; see :class:`NoticeWatcher`). See the module docstring for a loop."""
    return _WATCHER.preempted(sync=sync)


def watcher() -> NoticeWatcher:
    """The process's watcher (what :func:`preempted` and ``Checkpointer.preempted`` read)."""
    return _WATCHER
