"""Slurm's preemption notice, as an agent of the allocation receives it: a file, or SIGTERM.

Slurm sends the job's ``--signal`` to the batch shell when it chooses the job for
preemption (with ``preempt_send_user_signal``); the batch script's trap writes the
allocation's notice file (``TRAINPOD_SLURM_NOTICE``, see :mod:`trainpod.slurm.batch`). The
agent cannot take the signal itself: it ignores the notice signal so that its ranks inherit
SIG_IGN (ADR 0013), and a handler installed instead would be reset to the default (death) in
every rank it execs.

**Not every ``--signal`` is a preemption.** Slurm also sends it ``LEAD`` seconds before the
job's ``--time`` runs out. Which one it is, Slurm's record of the job says
(``scontrol show job -o``, :func:`classify`, measured on Slurm 22.05.8): a preemption sets
``PreemptTime`` and pulls ``EndTime`` in to now + ``GraceTime``; the time limit's warning
leaves ``PreemptTime=None`` (or absent) and ``EndTime = StartTime + TimeLimit``. The warning
is logged and nothing else: the job is not preempted (it will not be requeued and resume),
it ends when Slurm's time limit ends it (TIMEOUT, ``failed``), as ``--time`` does on the
embedded backend.

**Without ``preempt_send_user_signal``** (or once the ``--signal`` went out for the time
limit) Slurm sends no user signal at preemption: it sends SIGTERM to the job's tasks (these
agents, and, proctrack tracking the whole tree, their ranks) when it chooses the job, and
SIGTERM again, then SIGKILL, when GraceTime is over. The agent's first SIGTERM in an
allocation is therefore checked the same way (:meth:`SlurmNoticeWatch.sigterm`): a
preemption is taken as the notice and the agent stays for the grace (leaving early would end
the allocation without its requeue); anything else (``scancel``, the time limit's end) stops
the agent as before. Slurm's record can lag its SIGTERM (the job still ``RUNNING`` with
``PreemptTime=None`` for a moment, seen on a loaded box), so only "ending" is believed at
once: a record that says neither is asked again for :data:`CONFIRM_S` first. "Ending" is a
``JobState`` of :data:`ENDING_STATES` only: while Slurm delivers the SIGTERM it shows
``SIGNALING``, a job still running (taking every state but ``RUNNING`` for an end failed a
preempted job in CI).
While that check runs, the agent holds its reports (:meth:`SlurmNoticeWatch.settle`) so that
the ranks' exits, which the same SIGTERM causes, reach the controller with the preemption,
never before it.

On a preemption every attempt running here gets trainpod's own notice, the same path as a
preempted attempt's kill order (the rank notice file, the notice signal to each rank's group,
the grace, then teardown), and :attr:`preempted_at` goes into every heartbeat, so the
controller records a preemption of the job (not lost nodes) before the ranks' exits arrive.
Attempts launched later still get it: the allocation is going away.
"""

from __future__ import annotations

import enum
import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path

from trainpod.agent.launcher import Launcher
from trainpod.agent.ranks import Notice

log = logging.getLogger(__name__)

POLL_S = 0.25
ENV = "TRAINPOD_SLURM_NOTICE"
ASK_TIMEOUT_S = 10.0
"""How long Slurm is asked about the job (``scontrol``), and reports held meanwhile, at most."""
TERM_WAIT_S = 2.0
"""How long reports wait for the agent's own SIGTERM once a rank died of one it did not send."""
PULLED_IN_SLACK_S = 5.0
"""An ``EndTime`` this much before ``StartTime + TimeLimit`` was moved by a preemption."""
CONFIRM_S = 6.0
"""How long a SIGTERM's check keeps asking Slurm while its record says neither "preempted"
nor "ending": right after Slurm's preemption SIGTERM, ``scontrol`` was seen to show
``PreemptTime=None`` still (1 fresh-clone run of 2 on a loaded box)."""
REASK_S = 0.5

_FIELD = re.compile(
    r"(?:^|\s)(JobState|Reason|Restarts|StartTime|EndTime|TimeLimit|PreemptTime)=(\S*)"
)
_LIMIT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")
_NO_TIME = {"", "None", "Unknown", "N/A"}
ENDING_STATES = frozenset(
    {
        "COMPLETING",
        "COMPLETED",
        "CANCELLED",
        "TIMEOUT",
        "FAILED",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "STAGE_OUT",
    }
)
"""``JobState`` values of a job that is ending or has ended. Any other value is read as still
running: Slurm shows a state flag in place of ``RUNNING`` while it is set, such as
``SIGNALING`` while a signal is being delivered to the job's steps, which is exactly when a
preemption's SIGTERM reaches the agents (seen on Slurm 22.05.8, 1 agent of 2:
``JobState=SIGNALING`` with ``PreemptTime`` set); its other fields say what it is."""


class Kind(enum.Enum):
    PREEMPTION = "a preemption"
    TIME_LIMIT = "the time limit's warning"
    ENDING = "the job ending (cancelled or out of time)"
    UNKNOWN = "unknown (Slurm said nothing usable)"


def parse_job(line: str) -> dict[str, str]:
    """The fields :func:`classify` reads from ``scontrol show job -o``'s line."""
    return {m.group(1): m.group(2) for m in _FIELD.finditer(line)}


def classify(job: Mapping[str, str]) -> Kind:
    """What a ``--signal`` (or a SIGTERM) inside the allocation means, from Slurm's record of
    the job at that moment (:func:`parse_job`)."""
    if not job:
        return Kind.UNKNOWN
    if job.get("JobState", "RUNNING") in ENDING_STATES:
        return Kind.ENDING
    if job.get("PreemptTime", "None") not in _NO_TIME:
        return Kind.PREEMPTION
    start, end = _when(job.get("StartTime", "")), _when(job.get("EndTime", ""))
    limit = _limit_s(job.get("TimeLimit", ""))
    if start is None or end is None or limit is None:
        return Kind.UNKNOWN  # e.g. no time limit, and a Slurm that shows no PreemptTime
    if end < start + limit - PULLED_IN_SLACK_S:
        return Kind.PREEMPTION  # its end was pulled in to now + GraceTime
    return Kind.TIME_LIMIT


def _shown(job: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in job.items()) or "nothing"


def _when(text: str) -> float | None:
    if text in _NO_TIME:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _limit_s(text: str) -> float | None:
    """``TimeLimit`` in seconds: ``[D-][HH:]MM:SS``; None for ``UNLIMITED`` and the like."""
    m = _LIMIT.match(text)
    if m is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def ask_slurm(slurm_job_id: str) -> Callable[[], dict[str, str]]:
    """Slurm's record of the job, as :func:`classify` reads it ({} when it cannot say)."""

    def ask() -> dict[str, str]:
        try:
            out = subprocess.run(
                ["scontrol", "show", "job", "-o", slurm_job_id],
                capture_output=True,
                text=True,
                timeout=ASK_TIMEOUT_S,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cannot ask Slurm about job %s: %s", slurm_job_id, exc)
            return {}
        return parse_job(out)

    return ask


class SlurmNoticeWatch:
    def __init__(
        self,
        path: Path | None,
        notice: Notice,
        launcher: Launcher,
        teardown_grace_s: float,
        on_notice: Callable[[], None],
        ask: Callable[[], Mapping[str, str]] = dict,
        term_wait_s: float = TERM_WAIT_S,
        confirm_s: float = CONFIRM_S,
    ) -> None:
        """``path``: the batch trap's notice file (None: the script asked no ``--signal``).
        ``ask``: Slurm's record of the job (:func:`ask_slurm`); the default knows nothing,
        and a notice file that cannot be told apart is taken as a preemption."""
        self.path = path
        self._notice = notice
        self._launcher = launcher
        self._teardown = teardown_grace_s
        self._on_notice = on_notice
        self._ask = ask
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._settled.set()
        self._term_seen = threading.Event()  # the agent's SIGTERM has come (sigterm())
        self._term_wait_s = term_wait_s
        self._confirm_s = confirm_s
        self._waited: set[tuple[int, int]] = set()  # ranks whose SIGTERM was waited for
        self._seen: float | None = None  # the notice file's newest time, handled
        self.preempted_at: float | None = None
        """When the notice came (the batch shell's clock, seconds); None before it."""
        self.time_limit_at: float | None = None
        """When the time limit's warning came, if it did (not a preemption)."""

    def check(self) -> bool:
        """Look once; give the notice to every attempt not yet stopping. True once noticed."""
        changed = False
        if self.preempted_at is None:
            at = self._read()
            if at is None or at == self._seen:
                return False
            self._seen = at
            kind = classify(self._ask())
            if kind is Kind.TIME_LIMIT:
                self.time_limit_at = at
                log.info(
                    "Slurm's --signal at %s is the time limit's warning, not a preemption: "
                    "the job ends when its --time does",
                    at,
                )
                return False
            with self._lock:
                changed = self.preempted_at is None
                if changed:
                    self.preempted_at = at
            log.info("Slurm preempts the allocation (notice at %s; %s)", at, kind.value)
        self._give(changed)
        return True

    def takes_sigterm(self) -> bool:
        """Whether a SIGTERM must first be checked (:meth:`sigterm`): none noticed yet. Once
        preempted, a SIGTERM is the grace's end and stops the agent."""
        return self.preempted_at is None

    def sigterm(self, stop: Callable[[], None]) -> None:
        """A SIGTERM reached the agent (call it from the handler: it returns at once). Slurm
        is asked whether it preempts the job: then it is the notice, and the agent stays;
        else ``stop`` is called. Reports wait (:meth:`settle`) until it is known."""
        self._settled.clear()
        self._term_seen.set()
        threading.Thread(target=self._sigterm, args=(stop,), daemon=True).start()

    def _sigterm(self, stop: Callable[[], None]) -> None:
        try:
            kind, job = self._sigterm_kind()
            if kind is not Kind.PREEMPTION:
                log.info("SIGTERM: %s (Slurm's record: %s); stopping", kind.value, _shown(job))
                stop()
                return
            with self._lock:
                changed = self.preempted_at is None
                if changed:
                    self.preempted_at = time.time()
            log.info(
                "SIGTERM is Slurm's preemption notice (no user signal was sent; Slurm's "
                "record: %s): the ranks get trainpod's; the agent stays for the grace",
                _shown(job),
            )
            self._give(changed)
        except Exception:
            log.exception("checking a SIGTERM against Slurm failed; stopping")
            stop()
        finally:
            self._settled.set()

    def _sigterm_kind(self) -> tuple[Kind, Mapping[str, str]]:
        """What Slurm says a SIGTERM is. "Ending" (cancelled, out of time) and "preempted" are
        taken at once; anything else is asked again for ``confirm_s``, since Slurm's record
        of a preemption can lag its SIGTERM, before the SIGTERM is taken for a plain stop."""
        deadline = time.monotonic() + self._confirm_s
        while True:
            job = self._ask()
            kind = classify(job)
            if kind in (Kind.PREEMPTION, Kind.ENDING) or time.monotonic() >= deadline:
                return kind, job
            log.info("SIGTERM: Slurm's record says %s so far; asking again", kind.value)
            time.sleep(REASK_S)

    def settle(self, timeout_s: float = ASK_TIMEOUT_S + CONFIRM_S) -> None:
        """Wait (at most ``timeout_s``) while a SIGTERM is being checked. Slurm's SIGTERM
        reaches the ranks as it reaches the agent, and a rank's exit may be seen before the
        agent's own handler has run: a rank dead of a SIGTERM the agent did not send makes
        this wait for that handler first (once per rank, ``term_wait_s`` at most)."""
        if self.preempted_at is None and not self._term_seen.is_set():
            unexplained = self._launcher.sigtermed() - self._waited
            if unexplained:
                self._waited |= unexplained
                self._term_seen.wait(self._term_wait_s)
        self._settled.wait(timeout_s)

    def _give(self, changed: bool) -> None:
        noticed = [
            a
            for a in sorted(self._launcher.attempt_ids())
            if self._launcher.kill(a, self._teardown, notice=self._notice)
        ]
        if noticed:
            log.info("attempts %s: Slurm's preemption notice given to their ranks", noticed)
        if changed or noticed:
            self._on_notice()  # report it now, before the ranks' exits

    def _read(self) -> float | None:
        if self.path is None:
            return None
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
