"""Slurm's preemption notice, as an agent of the allocation receives it: a file.

Slurm sends the job's ``--signal`` to the batch shell when it chooses the job for
preemption; the batch script's trap writes the allocation's notice file
(``TRAINPOD_SLURM_NOTICE``, see :mod:`trainpod.slurm.batch`). The agent cannot take the
signal itself: it ignores the notice signal so that its ranks inherit SIG_IGN (ADR 0013), and
a handler installed instead would be reset to the default (death) in every rank it execs.

:class:`SlurmNoticeWatch` polls for the file. Once it is there, every attempt running here
gets trainpod's own notice, the same path as a preempted attempt's kill order (the rank
notice file, the notice signal to each rank's group, the grace, then teardown), and
:attr:`preempted_at` goes into every heartbeat, so the controller records a preemption of
the job (not lost nodes) before the ranks' exits arrive. Attempts launched later still get
it: the allocation is going away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from trainpod.agent.launcher import Launcher, Notice

log = logging.getLogger(__name__)

POLL_S = 0.25
ENV = "TRAINPOD_SLURM_NOTICE"


class SlurmNoticeWatch:
    def __init__(
        self,
        path: Path,
        notice: Notice,
        launcher: Launcher,
        teardown_grace_s: float,
        on_notice: Callable[[], None],
    ) -> None:
        self.path = path
        self._notice = notice
        self._launcher = launcher
        self._teardown = teardown_grace_s
        self._on_notice = on_notice
        self.preempted_at: float | None = None
        """When the notice came (the batch shell's clock, seconds); None before it."""

    def check(self) -> bool:
        """Look once; give the notice to every attempt not yet stopping. True once noticed."""
        changed = False
        if self.preempted_at is None:
            at = self._read()
            if at is None:
                return False
            self.preempted_at = at
            changed = True
            log.info("Slurm preempts the allocation (notice at %s)", at)
        noticed = [
            a
            for a in sorted(self._launcher.attempt_ids())
            if self._launcher.kill(a, self._teardown, notice=self._notice)
        ]
        if noticed:
            log.info("attempts %s: Slurm's preemption notice given to their ranks", noticed)
        if changed or noticed:
            self._on_notice()  # report it now, before the ranks' exits
        return True

    def _read(self) -> float | None:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read Slurm's notice file %s: %s", self.path, exc)
            return None
        try:
            return float(text)
        except ValueError:
            log.warning("Slurm's notice file %s says %r, not a time", self.path, text)
            return None

    def run(self, stopping: threading.Event) -> None:
        """Poll until ``stopping``; after the notice keep giving it to new attempts."""
        while not stopping.is_set():
            self.check()
            stopping.wait(POLL_S)
