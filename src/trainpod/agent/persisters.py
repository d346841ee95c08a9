"""Agent-owned checkpoint persistence: the hand-off socket and one persister per job.

:class:`CheckpointHub` binds the node's hand-off socket (``TRAINPOD_CKPT_SOCKET``, a unix
``SOCK_SEQPACKET`` socket; protocol in :mod:`trainpod.ckpt.handoff`) and answers from a
daemon thread. For each job (and node) that hands it a committed step it runs a persister
process (``python -m trainpod.ckpt.persist``) in a session of its own, so the copies to
scratch, peer and durable go on when the worker is SIGKILLed or torn down, and do not
compete with the training loop for its interpreter. The persister's reports become
:class:`~trainpod.api.models.CheckpointReport` entries, delivered to the controller with the
heartbeat at least once (:meth:`reports` / :meth:`delivered`), and its progress becomes
:class:`~trainpod.api.models.CheckpointUpload` (:meth:`uploads`).

When the controller's orders no longer list a job as active on this node
(:meth:`retain`), its persister is told to finish the newest step (bounded by
``finish_timeout_s``), then stopped, and the job's shared-memory dirs on this node are
removed. So are its checkpoint copies in the node's scratch dir (``scratch_root``: the
scratch tier and the peer copies this node holds), once the durable store holds the newest
step they hold; else they stay, with a warning (they are then the newest copy there is).
Between attempts of a job nothing is removed: an in-job restart on the same node
finds its memory tier. The memory dirs of the jobs it knows (from their launch, see
:meth:`expect`, and their hand-offs) are kept in ``state_file``, so an agent that restarts
still cleans up after them. The agent of a Slurm allocation that stops ends its own job here
(:meth:`end`): the orders may still call it active. Thread-safe.

A worker that runs as a POSIX account hands over on a socket opened for that account
(:meth:`CheckpointHub.add_listener`, see :mod:`trainpod.agent.jobsockets`): it may speak only
for the jobs ``grants`` gives its uid, only of a primary tier its account owns, and its
persister runs as that account (with a clean environment), so a hand-off can never make
the agent copy or write anything the account could not itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainpod.agent.accounts import Grants, RunAs, owns
from trainpod.agent.unixsock import SeqpacketServer
from trainpod.api.models import CheckpointReport, CheckpointUpload
from trainpod.ckpt.handoff import MAX_MESSAGE, WIRE_VERSION, PersistStatus
from trainpod.ckpt.layout import PEER_TIER, SCRATCH_TIER, SHM_ROOT, job_scratch_dir
from trainpod.ckpt.persist import DEFAULT_NICE, journal_of
from trainpod.ckpt.persistwire import (
    PersistReport,
    StatusReport,
    parse_line,
    parse_request,
    parse_tier_full,
)
from trainpod.ckpt.tiers import step_name

log = logging.getLogger(__name__)

FINISH_TIMEOUT_S = 60.0
"""How long a job's persister may go on after the job ended (finishing its newest step)."""
MAX_PENDING = 1000
"""Reports kept for the controller while it is away (the oldest are dropped beyond it)."""


def memory_bases() -> list[Path]:
    """Where memory tiers may live (see :func:`trainpod.ckpt.layout.resolve`): only dirs
    below these are ever removed by a clean-up."""
    return [SHM_ROOT / "trainpod", Path(tempfile.gettempdir()) / "trainpod-shm" / "trainpod"]


def removable(path: Path) -> bool:
    """A ``<base>/<job key>/<node>``-shaped path below a memory base (never anything else)."""
    try:
        p = path.absolute()
    except OSError:
        return False
    for base in memory_bases():
        try:
            rel = p.relative_to(base)
        except ValueError:
            continue
        return len(rel.parts) == 2 and ".." not in rel.parts
    return False


@dataclass
class _Job:
    key: tuple[str, str]  # (job key, node)
    job_id: int | None
    primary: Path
    proc: subprocess.Popen[bytes] | None = None
    status: PersistStatus | None = None  # None: the persister has not said yet
    saved_step: int = -1
    sent_flagged: int = -1  # newest step handed over for the global tiers
    finishing: bool = False
    exited: bool = False
    account: RunAs | None = None  # the persister runs as it (None: as the agent)
    reader: threading.Thread | None = None  # reads the persister's stdout until it closes
    primary_is_scratch: bool = False  # no memory tier: the workers write scratch directly

    @property
    def staging(self) -> Path:
        return self.primary.parent / f".persist-{self.key[1]}"

    @property
    def lock(self) -> Path:
        return self.primary.parent / f".persist-{self.key[1]}.lock"


class CheckpointHub:
    """The node's hand-off socket and its persister processes. :meth:`close` stops serving.

    ``on_forwarded(step)`` is called once a step went to its persister, before the worker
    is answered. ``finish_timeout_s`` and ``nice`` default to
    ``TRAINPOD_PERSIST_FINISH_TIMEOUT_S`` and ``TRAINPOD_PERSIST_NICE``, else 60 s and
    :data:`~trainpod.ckpt.persist.DEFAULT_NICE`.

    Raises :class:`~trainpod.errors.Fatal` when ``path`` is too long or not a socket, and
    :class:`~trainpod.errors.Conflict` when a live hub already serves it.
    """

    def __init__(
        self,
        path: Path,
        *,
        log_dir: Path,
        state_file: Path | None = None,
        on_change: Callable[[], None] | None = None,
        finish_timeout_s: float | None = None,
        nice: int | None = None,
        python: str = sys.executable,
        mode: int = 0o600,
        grants: Grants | None = None,
        on_forwarded: Callable[[int], None] | None = None,
        scratch_root: Path | None = None,
    ) -> None:
        self.path = Path(path)
        self.scratch_root = scratch_root
        """This node's scratch dir (``TRAINPOD_SCRATCH_DIR``); None: no scratch clean-up."""
        self._on_forwarded = on_forwarded or (lambda _step: None)
        """Called with each step forwarded to a persister, before the worker's answer (the
        test seam of :func:`trainpod.agent.chaos.die_in_handoff`)."""
        self.grants = grants if grants is not None else Grants()
        self.log_dir = log_dir
        self.state_file = state_file
        env = os.environ
        self.finish_timeout_s = (
            finish_timeout_s
            if finish_timeout_s is not None
            else float(env.get("TRAINPOD_PERSIST_FINISH_TIMEOUT_S") or FINISH_TIMEOUT_S)
        )
        self.nice = (
            nice if nice is not None else int(env.get("TRAINPOD_PERSIST_NICE") or DEFAULT_NICE)
        )
        self.python = python
        self._on_change = on_change or (lambda: None)
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._pending: list[CheckpointReport] = []
        self._active: set[int] | None = None
        self._known: dict[int, set[str]] = self._load_state()
        self._closing = False
        self._finishers: list[threading.Thread] = []
        self._server = SeqpacketServer(
            self.path,
            self._answer,
            what="checkpoints",
            backlog=64,
            mode=mode,
            thread_name="ckpt-hub",
        )

    # -- the controller's side ----------------------------------------------------------
    def reports(self) -> list[CheckpointReport]:
        """Reports not yet delivered, oldest first (send them; then :meth:`delivered`)."""
        with self._lock:
            return list(self._pending)

    def delivered(self, reports: list[CheckpointReport]) -> None:
        """The controller recorded ``reports`` (a prefix of what :meth:`reports` gave)."""
        sent = {id(r) for r in reports}
        with self._lock:
            self._pending = [r for r in self._pending if id(r) not in sent]

    def uploads(self) -> list[CheckpointUpload]:
        """Where each job's persister stands (for jobs with a trainpod job id)."""
        with self._lock:
            jobs = [(j.job_id, j.status) for j in self._jobs.values()]
        return [
            CheckpointUpload(
                job_id=job_id,
                done_through=st.done_through,
                committed=dict(st.committed),
                copying_step=st.copying_step,
                copying_tier=st.copying_tier or None,
                bytes_done=st.bytes_done,
                bytes_total=st.bytes_total,
                rate_bps=st.rate_bps,
                retry_in_s=st.retry_in_s,
                errors=dict(st.errors),
                steps_skipped=dict(st.steps_skipped),
            )
            for job_id, st in jobs
            if job_id is not None and st is not None
        ]

    def retain(self, active: set[int]) -> None:
        """The jobs still active on this node: finish and clean up after every other one.
        Returns at once (the clean-ups run in threads). Idempotent."""
        with self._lock:
            self._active = set(active)
            ending = [j for j in self._jobs.values() if _ended(j, active) and not j.finishing]
            for j in ending:
                j.finishing = True
            running = {j.job_id for j in self._jobs.values()}
            orphans = {
                job_id: dirs
                for job_id, dirs in self._known.items()
                if job_id not in active and job_id not in running
            }
        for j in ending:
            t = threading.Thread(target=self._finish, args=(j,), name=f"ckpt-finish-{j.key[0]}")
            t.start()
            with self._lock:
                self._finishers.append(t)
        for job_id, dirs in orphans.items():
            if any(Path(d).parent.exists() for d in dirs):  # not for a job that made none
                log.info("job %d has ended: removing its memory tier %s", job_id, sorted(dirs))
            for d in dirs:
                _remove_memory(Path(d), Path(d).name)
            self._forget(job_id)

    def end(self, job_ids: set[int]) -> None:
        """Finish and clean up after ``job_ids`` as if the orders no longer listed them
        (the agent of a Slurm allocation that ends here, see
        :func:`trainpod.agent.agent.memory_to_release`); every other job stays as the last
        orders said (all of them before any order came). Returns at once, as :meth:`retain`."""
        with self._lock:
            here = set(self._known) | {j.job_id for j in self._jobs.values() if j.job_id}
            keep = set(self._active) if self._active is not None else here
        if job_ids & here:
            log.info("jobs %s end on this node: removing their memory tiers", sorted(job_ids))
        self.retain(keep - job_ids)

    def expect(self, job_id: int, memory: Path | None) -> None:
        """A job launches ranks here whose memory tier would be ``memory``: know it from now
        on, so that it goes when the job does even if no step was ever handed over (a rank
        that died first, or one that made only the job's dir). Ignored unless
        :func:`removable`. Idempotent."""
        if memory is None or not removable(memory):
            return
        with self._lock:
            known = self._known.setdefault(job_id, set())
            if str(memory) not in known:
                known.add(str(memory))
                self._save_state_locked()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait for the clean-ups under way (tests, shutdown). True when none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._finishers = [t for t in self._finishers if t.is_alive()]
                left = list(self._finishers)
            if not left:
                return True
            if time.monotonic() >= deadline:
                return False
            left[0].join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop serving; tell every persister to finish and exit (they do so on their own,
        bounded by ``finish_timeout_s``). Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._server.close()
        with self._lock:
            jobs = list(self._jobs.values())
        for j in jobs:
            _close_stdin(j.proc)

    # -- the socket ---------------------------------------------------------------------
    def add_listener(self, path: Path, *, uid: int, gid: int) -> None:
        """Answer on ``path`` too, for the account ``uid`` (see
        :meth:`~trainpod.agent.unixsock.SeqpacketServer.add_listener`)."""
        self._server.add_listener(path, uid=uid, gid=gid)

    def _answer(self, conn: socket.socket, uid: int) -> bool:
        """One request, one reply, then the connection is closed (False)."""
        try:
            data = conn.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if data:
            try:
                reply = self.handle(json.loads(data), uid=uid)
            except ValueError as exc:
                reply = {"ok": False, "error": f"bad request: {exc}"}
            try:
                conn.send(json.dumps(reply, default=str).encode()[:MAX_MESSAGE])
            except OSError:
                pass
        return False

    def handle(self, msg: Any, *, uid: int | None = None) -> dict[str, Any]:
        """Answer one request (see :mod:`trainpod.ckpt.handoff`) from a peer of ``uid``
        (None: the agent itself). Never raises."""
        if not isinstance(msg, dict) or msg.get("v", WIRE_VERSION) != WIRE_VERSION:
            return {"ok": False, "error": "unknown request"}
        key = (msg.get("job_key"), msg.get("node"))
        if not all(isinstance(k, str) and k and "/" not in k for k in key):
            return {"ok": False, "error": f"job_key and node must be plain names, got {key}"}
        job_key, node = str(key[0]), str(key[1])
        account = None
        if uid is not None and not self.grants.trusted(uid):
            account = self.grants.account(uid)
            if account is None:
                return {"ok": False, "error": f"uid {uid} runs no job on this node"}
        if msg.get("op") == "status":
            with self._lock:
                j = self._jobs.get((job_key, node))
                if j is not None and account is not None and j.account != account:
                    return {"ok": False, "error": f"{job_key} is not {account.name}'s"}
                # A persister that died knows nothing any more: the worker then hands the
                # step over again, which starts a new one.
                if j is None or j.exited:
                    return {"ok": True, "status": {}}
                st = j.status or PersistStatus()
                if j.sent_flagged > (-1 if st.flagged is None else st.flagged):
                    # handed over, not seen by the persister yet
                    st = dataclasses.replace(st, global_busy=True)
                return {"ok": True, "status": st.to_dict()}
        if msg.get("op") == "tier_full":
            return self._tier_full(job_key, msg, account)
        if msg.get("op") == "persist":
            try:
                return self._persist(job_key, node, msg, account)
            except (ValueError, OSError) as exc:
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": False, "error": f"unknown op {msg.get('op')!r}"}

    # -- persisters ---------------------------------------------------------------------
    def _persist(
        self, job_key: str, node: str, msg: dict[str, Any], account: RunAs | None
    ) -> dict[str, Any]:
        line = json.dumps(msg, separators=(",", ":")).encode()
        req = parse_request(line)
        cfg = req.config
        primary = Path(cfg.memory or cfg.scratch or "")
        written = _written_in(req.source, cfg.memory, cfg.scratch)
        if not written.is_absolute() or not (written / step_name(req.step)).is_dir():
            raise ValueError(f"step {req.step} is not committed under {written}")
        if account is not None:
            if not self.grants.may_checkpoint(account.uid, req.job_id):
                why = f"job {req.job_id} does not run as {account.name} on this node"
                log.warning("refused a checkpoint hand-off from uid %d: %s", account.uid, why)
                return {"ok": False, "error": why}
            for d in {primary, written}:
                if not owns(d, account.uid):
                    return {"ok": False, "error": f"{d} is not a directory of {account.name}"}
        with self._lock:
            active = self._active
            if req.job_id is not None and active is not None and req.job_id not in active:
                return {"ok": False, "error": f"job {req.job_id} is not active on this node"}
            j = self._jobs.get((job_key, node))
            if j is not None and j.finishing:
                return {"ok": False, "error": f"job {job_key} is being cleaned up here"}
            if j is not None and j.account != account:
                return {"ok": False, "error": f"{job_key} is persisted for another account"}
            if j is None or j.exited:
                saved = j.saved_step if j else -1
                j = _Job((job_key, node), req.job_id, primary, saved_step=saved, account=account)
                j.primary_is_scratch = not cfg.memory
                self._jobs[j.key] = j
                spawn = True
            else:
                spawn = False
            if req.job_id is not None and cfg.memory and removable(Path(cfg.memory)):
                known = self._known.setdefault(req.job_id, set())
                if cfg.memory not in known:
                    known.add(cfg.memory)
                    self._save_state_locked()
            new_step = req.step > j.saved_step
            if new_step:
                j.saved_step = req.step
            if req.durable:
                j.sent_flagged = max(j.sent_flagged, req.step)
        if spawn:
            self._spawn(j)
        proc = j.proc
        if proc is None or proc.stdin is None:
            raise OSError("the persister did not start")
        proc.stdin.write(line + b"\n")
        proc.stdin.flush()
        self._on_forwarded(req.step)
        if new_step and req.job_id is not None:
            primary_name = req.source or ("memory" if cfg.memory else "scratch")
            self._add_report(
                CheckpointReport(
                    job_id=req.job_id,
                    attempt_id=req.attempt_id,
                    step=req.step,
                    tier=primary_name,
                    scope="node",
                    ok=True,
                    saved=True,
                    bytes=req.nbytes,
                    stall_s=req.stall_s,
                    at=time.time(),
                )
            )
        return {"ok": True}

    def _tier_full(
        self, job_key: str, msg: dict[str, Any], account: RunAs | None
    ) -> dict[str, Any]:
        """A worker's node leader says a tier could not take a step (docs/decisions/0036)."""
        try:
            full = parse_tier_full(json.dumps(msg))
        except ValueError as exc:
            return {"ok": False, "error": f"bad tier_full request: {exc}"}
        if account is not None and not self.grants.may_checkpoint(account.uid, full.job_id):
            return {"ok": False, "error": f"job {full.job_id} does not run as {account.name}"}
        if full.job_id is not None:
            self._add_report(
                CheckpointReport(
                    job_id=full.job_id,
                    attempt_id=full.attempt_id,
                    step=full.step,
                    tier=full.tier,
                    ok=False,
                    full=True,
                    to_tier=full.to,
                    path=full.path[:1000],
                    needed_bytes=full.needed,
                    free_bytes=full.free,
                    reason=(full.reason if full.to else f"{full.reason}; {full.error}")[:2000],
                    at=time.time(),
                )
            )
        log.warning("job %s: %s full at step %d: %s", job_key, full.tier, full.step, full.reason)
        return {"ok": True}

    def _spawn(self, j: _Job) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.python,
            "-m",
            "trainpod.ckpt.persist",
            "--job-key",
            j.key[0],
            "--node",
            j.key[1],
            "--staging",
            str(j.staging),
            "--finish-timeout-s",
            str(self.finish_timeout_s),
            "--nice",
            str(self.nice),
        ]
        who = j.account
        with (self.log_dir / f"{j.key[0]}.log").open("ab") as err:
            j.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,  # not in any worker's process group: survives teardown
                # An account's persister is that account: it copies only what it could.
                env=None if who is None else who.env(_persister_env()),
                user=None if who is None else who.uid,
                group=None if who is None else who.gid,
                extra_groups=None if who is None else list(who.groups),
            )
        log.info("checkpoint persister for %s on %s: pid %d", j.key[0], j.key[1], j.proc.pid)
        assert j.proc.stdout is not None
        j.reader = threading.Thread(
            target=self._read, args=(j, j.proc.stdout), name=f"ckpt-read-{j.key[0]}", daemon=True
        )
        j.reader.start()

    def _read(self, j: _Job, out: IO[bytes]) -> None:
        for line in out:
            try:
                msg = parse_line(line)
            except ValueError as exc:
                log.warning("persister of %s: ignored a malformed line: %s", j.key[0], exc)
                continue
            if isinstance(msg, StatusReport):
                with self._lock:
                    j.status = msg.status
            elif isinstance(msg, PersistReport) and j.job_id is not None:
                self._add_report(_report_of(j.job_id, msg))
        with self._lock:
            j.exited = True

    def _add_report(self, report: CheckpointReport) -> None:
        with self._lock:
            self._pending.append(report)
            del self._pending[:-MAX_PENDING]
        self._on_change()

    def _finish(self, j: _Job) -> None:
        """Let the persister finish the newest step (bounded), stop it, remove the memory tier."""
        proc = j.proc
        if proc is not None:
            _close_stdin(proc)
            try:
                proc.wait(self.finish_timeout_s + 5.0)
            except subprocess.TimeoutExpired:
                log.warning("persister of %s did not finish in time: stopping it", j.key[0])
                proc.kill()
                proc.wait()
        if j.reader is not None:
            j.reader.join(5.0)  # its last status: what the durable store holds
        log.info("job %s has ended: removing its memory tier %s", j.key[0], j.primary)
        if removable(j.primary):
            _remove_memory(j.primary, j.key[1])
        else:
            shutil.rmtree(j.staging, ignore_errors=True)
            j.lock.unlink(missing_ok=True)
            journal_of(j.staging, j.key[1]).unlink(missing_ok=True)
        if j.job_id is not None and self.scratch_root is not None:
            self._release_scratch(j, job_scratch_dir(self.scratch_root, j.job_id))
        with self._lock:
            if self._jobs.get(j.key) is j:
                del self._jobs[j.key]
        if j.job_id is not None:
            with self._lock:
                still = any(x.job_id == j.job_id for x in self._jobs.values())
            if not still:
                self._forget(j.job_id)

    def _release_scratch(self, j: _Job, job_dir: Path) -> None:
        """Remove an ended job's checkpoint copies from this node's scratch dir, unless they
        hold a step that the durable store does not (see :func:`scratch_kept_because`)."""
        tiers = [job_dir / SCRATCH_TIER, job_dir / PEER_TIER]
        if not any(t.exists() for t in tiers):
            return
        with self._lock:
            status = j.status or PersistStatus()
        why = scratch_kept_because(status, j.saved_step, primary_is_scratch=j.primary_is_scratch)
        if why is not None:
            log.warning(
                "job %s has ended: kept its scratch copies in %s: %s", j.key[0], job_dir, why
            )
            return
        log.info("job %s has ended: removing its scratch copies in %s", j.key[0], job_dir)
        for t in tiers:
            shutil.rmtree(t, ignore_errors=True)
        try:
            job_dir.rmdir()  # only when nothing else is left in it (a shell's files stay)
        except OSError:
            pass

    # -- what survives an agent restart -------------------------------------------------
    def _load_state(self) -> dict[int, set[str]]:
        return {} if self.state_file is None else read_state(self.state_file)

    def _save_state_locked(self) -> None:
        if self.state_file is None:
            return
        body = {str(k): sorted(v) for k, v in self._known.items()}
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.state_file)
        except OSError as exc:
            log.warning("cannot save %s: %s", self.state_file, exc)

    def _forget(self, job_id: int) -> None:
        with self._lock:
            if self._known.pop(job_id, None) is not None:
                self._save_state_locked()


def read_state(state_file: Path) -> dict[int, set[str]]:
    """The memory dirs an agent's ``state_file`` lists by job id ({} when unreadable)."""
    try:
        body = json.loads(state_file.read_text())
        return {int(k): {str(d) for d in v} for k, v in body.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def sweep_memory_tiers(state_file: Path) -> list[Path]:
    """Remove the memory tiers that an agent's ``state_file`` still lists and this host
    holds; return the dirs removed. For ``cluster delete``: the agents that wrote it are
    gone, and once the cluster's state dir is gone nobody knows these dirs are its own. Only
    below a memory base (:func:`removable`). Idempotent; a missing or unreadable file lists
    nothing."""
    removed = []
    for dirs in read_state(state_file).values():
        for d in sorted(dirs):
            path = Path(d)
            if removable(path) and path.exists():
                _remove_memory(path, path.name)
                removed.append(path)
    return removed


def scratch_kept_because(
    status: PersistStatus, saved_step: int, *, primary_is_scratch: bool
) -> str | None:
    """Why an ended job's copies in node scratch must stay (None: they may go). They go once
    the durable store holds a step at least as new as the newest they hold: the scratch
    tier's newest commit (or, where scratch is the primary tier, the newest step handed
    over, ``saved_step``). A job whose scratch holds no committed step has nothing there to
    keep."""
    newest = saved_step if primary_is_scratch else status.committed.get("scratch")
    if newest is None or newest < 0:
        return None
    durable = status.committed.get("durable")
    if durable is None:
        error = status.errors.get("durable")
        return f"the durable store has no step of it ({error or 'none committed'})"
    if durable < newest:
        return f"they hold step {newest}, the durable store only step {durable}"
    return None


def _written_in(source: str | None, memory: str | None, scratch: str | None) -> Path:
    """The root of the tier a handed-over step was written into."""
    if source is None:
        return Path(memory or scratch or "")
    roots = {"memory": memory, "scratch": scratch}
    root = roots.get(source)
    if root is None:
        raise ValueError(f"source {source!r} is not a node-local tier of this job ({roots})")
    return Path(root)


def _persister_env() -> dict[str, str]:
    """What an account's persister keeps of the agent's environment: where trainpod's own
    modules are, and the persister's knobs."""
    keep = ("PYTHONPATH", "TRAINPOD_PERSIST_NICE", "TRAINPOD_PERSIST_FINISH_TIMEOUT_S")
    return {k: os.environ[k] for k in keep if k in os.environ}


def _ended(j: _Job, active: set[int]) -> bool:
    return j.job_id is not None and j.job_id not in active


def _report_of(job_id: int, r: PersistReport) -> CheckpointReport:
    return CheckpointReport(
        job_id=job_id,
        attempt_id=r.attempt_id,
        step=r.step,
        tier=r.tier or "?",
        scope="job" if r.tier == "durable" else "node",
        ok=r.event == "committed",
        bytes=r.bytes,
        seconds=r.seconds,
        since_save_s=r.since_save_s,
        reason=r.reason[:2000],
        wrote_manifest=r.wrote_manifest,
        skipped=r.skipped,
        at=time.time(),
    )


def _remove_memory(memory: Path, node: str) -> None:
    """Remove a node's memory tier dir, its persister's staging and lock, and the job's dir
    once no node's dir is left in it. Only below a memory base (see :func:`removable`)."""
    if not removable(memory):
        return
    shutil.rmtree(memory, ignore_errors=True)
    shutil.rmtree(memory.parent / f".persist-{node}", ignore_errors=True)
    (memory.parent / f".persist-{node}.lock").unlink(missing_ok=True)
    journal_of(memory.parent / f".persist-{node}", node).unlink(missing_ok=True)
    try:
        memory.parent.rmdir()
    except OSError:
        pass  # another node's tier is still there (all nodes share /dev/shm locally)


def _close_stdin(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
