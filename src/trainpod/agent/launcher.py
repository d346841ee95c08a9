"""Starting, watching and stopping the worker processes of attempts on one node.

Each rank is a real process in its own session (so its whole process group can be
signalled), with stdout and stderr in a per-rank log. A watcher thread per rank calls
``on_change`` the moment it exits, so the agent reports exits at once. Thread-safe.

With a :class:`WarmStarter`, a ``python script.py`` / ``python -m module`` rank is forked
from a warm interpreter that has imported torch already (see ``trainpod.agent.zygote``);
anything else, or any rank while the zygote is not ready, starts cold with ``Popen``. Both
kinds look the same from here on: a pid leading its own process group, an exit reported at
once, the same log. ``TRAINPOD_WARM_START=0`` in a job's env makes its ranks start cold.

A preempted attempt's kill comes with a :class:`Notice`: the notice file is written (its path
is each rank's ``TRAINPOD_NOTICE_FILE``), the notice signal goes to every rank's process
group, the ranks get the notice's grace to exit on their own, and only then the usual
SIGTERM and SIGKILL. The agent ignores the notice signal from its start
(:func:`ignore_notice_signal`): SIG_IGN survives fork and exec, so cold ranks, the zygote and
the ranks it forks all start with it ignored, and a script that never asks for notices is
not killed by one (see :mod:`trainpod.notice`).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import psutil

from trainpod import notice, procutil, resume
from trainpod.agent.accounts import AccountError, RunAs, run_as
from trainpod.agent.jobsockets import AccountSockets
from trainpod.agent.ranks import (
    KEEP_FOR_RECOVERY_S,
    AttemptRun,
    Notice,
    RankProcess,
    note_signal,
    notice_file,
    open_log,
    signal_group,
    write_notice,
)
from trainpod.agent.warmpool import WarmPool
from trainpod.agent.warmstart import WarmProcess, WarmStarter
from trainpod.api.models import (
    FORGOTTEN_FOR_S,
    FORGOTTEN_MAX,
    AttemptReport,
    LaunchOrder,
    RecoverOrder,
)
from trainpod.ckpt.layout import job_scratch_dir
from trainpod.elastic import protocol as elastic_protocol
from trainpod.elastic.protocol import Recover
from trainpod.errors import Fatal
from trainpod.paths import STATE_DIR_ENV
from trainpod.spec.workerenv import DEFAULT_ENV_ALLOW, allowed

#: trainpod's own variables of the agent's environment that its workers keep: the cluster's
#: state dir (how a delete finds every process of the cluster) and, inside Slurm, the
#: allocation's job id and the node name Slurm gave.
TRAINPOD_INHERITED = (STATE_DIR_ENV, "TRAINPOD_SLURM_JOB_ID", "SLURM_JOB_ID", "SLURMD_NODENAME")

log = logging.getLogger(__name__)


def inheritance(environ: Mapping[str, str], allow: Iterable[str]) -> dict[str, str]:
    """What of the agent's environment ``environ`` its workers get: the variables the spec's
    ``env_allow`` (``allow``) names, and trainpod's own (:data:`TRAINPOD_INHERITED`).
    Nothing else: the agent's environment is that of whoever created the cluster."""
    ours = {k: environ[k] for k in TRAINPOD_INHERITED if k in environ}
    return {**allowed(environ, allow), **ours}


def _agent_account() -> dict[str, str]:
    """HOME, USER and LOGNAME of the account the agent (and so a rank of no account) runs
    as, from the password database: never whatever the agent's environment says."""
    try:
        pw = pwd.getpwuid(os.getuid())
    except KeyError:  # a uid with no entry (a container's): nothing to say
        return {}
    return {"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name}


class Launcher:
    def __init__(
        self,
        *,
        node_env: dict[str, str],
        on_change: Callable[[], None],
        inherited: Mapping[str, str] | None = None,
        warm: WarmPool | WarmStarter | None = None,
        accounts: AccountSockets | None = None,
    ) -> None:
        """``node_env``: variables every worker on this node gets (node name, scratch, devices).

        ``inherited``: what of the agent's own environment workers get (see
        :func:`inheritance`); nothing else of it reaches them. None: the default allow-list.

        ``warm``: starts ranks warm where it can (a lone zygote: no ``--preload`` servers);
        the launcher closes it in :meth:`shutdown`.
        ``accounts``: the beacon and checkpoint sockets of ranks that run as an account."""
        self._node_env = node_env
        self._inherited = dict(
            inheritance(os.environ, DEFAULT_ENV_ALLOW) if inherited is None else inherited
        )
        self._on_change = on_change
        self._warm = WarmPool(warm, None) if isinstance(warm, WarmStarter) else warm
        self._accounts = accounts
        self._lock = threading.Lock()
        self._exited = threading.Condition(self._lock)  # notified when a rank ends
        self._runs: dict[int, AttemptRun] = {}
        self._seen: set[int] = set()  # every attempt ever launched here; never launch twice
        self._forgotten: dict[int, float] = {}  # attempt -> when forgotten (monotonic)
        self._closing = False  # shutting down: a launch's thread starts no more ranks

    # -- launching ----------------------------------------------------------------------
    def launch(self, order: LaunchOrder, *, wait: bool = True) -> bool:
        """Start the node's ranks of an attempt. Idempotent: returns False if seen before.

        ``wait=False``: the attempt is in the launcher (its ranks reported, a kill order
        obeyed) when this returns, and its ranks are started by a thread of their own. The
        agent's heartbeat threads launch so: a start that waits for a busy zygote, or an
        account's home, never holds a heartbeat (a missed beat reads as a lost node)."""
        log_dir = Path(order.log_dir)
        # Every rank is in the attempt before the first one starts: a report sent while a
        # later rank is still being spawned lists it (running, no pid yet), so an attempt
        # whose first ranks have ended and been acknowledged is never taken for finished.
        ranks = [
            RankProcess(slot.rank, slot.local_rank, log_path=log_dir / f"rank-{slot.rank}.log")
            for slot in order.ranks
        ]
        # ``{resume:DIR}``: the script's own newest complete checkpoint, read once for the
        # node's ranks (ADR 0030), now that every rank of the last attempt has ended.
        world = int(order.env.get("WORLD_SIZE", "0")) or None
        filled = resume.expand(order.argv, cwd=order.workdir, world_size=world)
        order = order.model_copy(update={"argv": filled.argv})
        with self._lock:
            if order.attempt_id in self._seen:
                return False
            self._seen.add(order.attempt_id)
            # A lost node's ranks started here into a running attempt join its newest
            # generation (ADR 0035): the recover order of that generation is not for them.
            joins = order.env.get(elastic_protocol.ENV_GENERATION, "0")
            run = AttemptRun(order, ranks, generation=int(joins) if joins.isdigit() else 0)
            self._runs[order.attempt_id] = run
        if wait:
            self._start(run, filled.said)
        else:
            name = f"start-attempt-{order.attempt_id}"
            threading.Thread(target=self._start, args=(run, filled.said), name=name).start()
        return True

    def _start(self, run: AttemptRun, said: str) -> None:
        order = run.order
        Path(order.log_dir).mkdir(parents=True, exist_ok=True)
        if said:  # the first line of each rank's log says what was filled in
            for rp in run.ranks:
                with open_log(rp.log_path, private=order.account is not None) as out:
                    out.write(f"trainpod: {said}\n".encode())
        with run.starting:
            for rp in run.ranks:
                self._spawn_unless_stopped(run, rp)
        self._on_change()

    def _spawn_unless_stopped(self, run: AttemptRun, rp: RankProcess) -> None:
        """Start ``rp`` unless its run is being stopped; one that started as it was (the
        teardown looked before it had a process) is killed."""
        with self._lock:
            if run.killing or self._closing:
                rp.signal, rp.ended_at = signal.SIGKILL, time.time()
                self._exited.notify_all()
                return
        self._spawn(run.order, rp)
        with self._lock:
            late = (run.killing or self._closing) and rp.running and rp.proc is not None
        if late:
            log.info("rank %d started as its attempt was stopped: killed", rp.rank)
            signal_group(rp, signal.SIGKILL)

    def _spawn(self, order: LaunchOrder, rp: RankProcess) -> None:
        job_env = {**order.env, **self._node_env, **rp.again}
        job_env.update(
            RANK=str(rp.rank),
            LOCAL_RANK=str(rp.local_rank),
            ROLE_RANK=str(rp.rank),
            PYTHONUNBUFFERED=job_env.get(
                "PYTHONUNBUFFERED", self._inherited.get("PYTHONUNBUFFERED", "1")
            ),
        )
        scratch = self._job_scratch(order)
        job_env["TRAINPOD_JOB_SCRATCH_DIR"] = str(scratch)
        job_env[notice.ENV_FILE] = str(self._notice_file(order))
        if job_env.get(elastic_protocol.ENV_RECOVERY) == elastic_protocol.IN_PROCESS:
            job_env[elastic_protocol.ENV_FILE] = str(elastic_protocol.recover_file(scratch))
        env = {**self._inherited, **_agent_account(), **job_env}
        rp.started_at = time.time()
        with open_log(rp.log_path, private=order.account is not None) as out:
            try:
                scratch.mkdir(parents=True, exist_ok=True)
                if order.account is not None:  # the owner's account: cold, with its env only
                    account = run_as(order.account)
                    account.own(scratch, private=True)
                    env = account.env(
                        {**job_env, **self._account_sockets(order, account)},
                        kept=self._inherited,
                    )
                    rp.proc = subprocess.Popen(
                        order.argv,
                        cwd=order.workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        user=account.uid,
                        group=account.gid,
                        extra_groups=list(account.groups),
                    )
                else:
                    rp.proc = self._warm_start(order, rp, env) or subprocess.Popen(
                        order.argv,
                        cwd=order.workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            except (AccountError, Fatal) as exc:
                out.write(f"trainpod: {exc}\n".encode())
                rp.exit_code, rp.ended_at = 126, time.time()
                return
            except OSError as exc:
                # Say why in the rank's own log, and end the rank like a shell would.
                what = "working directory" if not Path(order.workdir).is_dir() else "command"
                out.write(
                    f"trainpod: cannot start {order.argv!r} in {order.workdir}: {exc} "
                    f"(check the {what})\n".encode()
                )
                rp.exit_code, rp.ended_at = 127, time.time()
                return
        threading.Thread(target=self._watch, args=(rp,), daemon=True).start()

    def _account_sockets(self, order: LaunchOrder, account: RunAs) -> dict[str, str]:
        if self._accounts is None:
            return {}
        return self._accounts.env_for(account, attempt_id=order.attempt_id, job_id=order.job_id)

    def _warm_start(
        self, order: LaunchOrder, rp: RankProcess, env: dict[str, str]
    ) -> WarmProcess | None:
        """The rank forked by the zygote, or None (said why) when it must start cold."""
        if self._warm is None:
            return None
        t0 = time.monotonic()
        proc = self._warm.spawn(order, env=env, log_path=rp.log_path)
        what = f"rank {rp.rank} of attempt {order.attempt_id}"
        if isinstance(proc, str):
            log.info("%s: cold start (%s)", what, proc)
            return None
        ms = (time.monotonic() - t0) * 1000
        log.info("%s: warm start, pid %d in %.0f ms", what, proc.pid, ms)
        return proc

    def _watch(self, rp: RankProcess) -> None:
        assert rp.proc is not None
        code = rp.proc.wait()
        with self._lock:
            rp.ended_at = time.time()
            if code < 0:
                rp.signal, rp.exit_code = -code, None
            else:
                rp.exit_code = code
            self._exited.notify_all()
        log.info(
            "rank %d (pid %d) ended: code=%s signal=%s",
            rp.rank,
            rp.proc.pid,
            rp.exit_code,
            rp.signal,
        )
        self._on_change()

    # -- in-process recovery ------------------------------------------------------------
    def recover(self, order: RecoverOrder, *, wait: bool = True) -> bool:
        """Publish a new generation to the attempt's ranks here and start this node's
        replaced ranks again in it. Idempotent: False for a generation seen before, an
        attempt not here or being stopped.

        A rank to start again that still runs (hung, not dead) is killed first.
        ``wait=False``: that, and the new starts, happen in a thread of their own (as for
        :meth:`launch`: the agent's heartbeat never waits for them)."""
        with self._lock:
            run = self._runs.get(order.attempt_id)
            if run is None or run.killing or order.generation <= run.generation:
                return False
            run.generation = order.generation
            run.kept_until = None
            respawn = [r for r in run.ranks if r.rank in order.respawn]
            # Published now, in the order of the generations (a later one's thread must
            # never be overtaken by an earlier one's file).
            self._publish(run, order)
        if wait:
            self._respawn(run, order, respawn)
        else:
            name = f"recover-attempt-{order.attempt_id}-{order.generation}"
            threading.Thread(target=self._respawn, args=(run, order, respawn), name=name).start()
        return True

    def _publish(self, run: AttemptRun, order: RecoverOrder) -> None:
        scratch = self._job_scratch(run.order)
        message = Recover(
            generation=order.generation,
            attempt_id=order.attempt_id,
            master_addr=order.master_addr,
            master_port=order.master_port,
            world_size=order.world_size,
            replaced=tuple(order.replaced),
            deadline_s=order.deadline_s,
        )
        elastic_protocol.write_recover(elastic_protocol.recover_file(scratch), message)

    def _respawn(self, run: AttemptRun, order: RecoverOrder, respawn: list[RankProcess]) -> None:
        again = {
            "MASTER_ADDR": order.master_addr,
            "MASTER_PORT": str(order.master_port),
            elastic_protocol.ENV_GENERATION: str(order.generation),
        }
        with run.starting:
            for rp in respawn:
                if self._ended(rp, timeout_s=order.deadline_s, again=again):
                    self._spawn_unless_stopped(run, rp)
                else:
                    log.warning("rank %d would not end: not started again", rp.rank)
        log.info(
            "attempt %d: generation %d on port %d, ranks started again here: %s",
            order.attempt_id,
            order.generation,
            order.master_port,
            [r.rank for r in respawn],
        )
        self._on_change()

    def _ended(self, rp: RankProcess, *, timeout_s: float, again: dict[str, str]) -> bool:
        """Make ``rp`` (killed first if it still runs) ready to start anew with ``again``."""
        if rp.running and rp.proc is not None:
            signal_group(rp, signal.SIGKILL)

        def gone() -> bool:
            return not rp.running

        with self._exited:
            if not self._exited.wait_for(gone, timeout=timeout_s):
                return False
            rp.ended_at = rp.exit_code = rp.signal = rp.proc = None
            rp.delivered = False
            rp.again = again
        return True

    # -- stopping -----------------------------------------------------------------------
    def kill(self, attempt_id: int, grace_s: float, notice: Notice | None = None) -> bool:
        """SIGTERM every live rank of the attempt, SIGKILL what is left after ``grace_s``;
        with a ``notice``, first the notice (file, then signal) and its grace period.

        Returns at once (True if this call began the teardown); the escalation runs in a
        thread. Idempotent.
        """
        with self._lock:
            run = self._runs.get(attempt_id)
            if run is None or run.killing or not run.running:
                return False
            run.killing = True
        threading.Thread(target=self._stop, args=(run, grace_s, notice), daemon=True).start()
        return True

    def _stop(self, run: AttemptRun, grace_s: float, notice: Notice | None) -> None:
        if notice is not None:
            self._give_notice(run, notice)
        self._terminate(run, grace_s)

    def _give_notice(self, run: AttemptRun, n: Notice) -> None:
        """Write the notice file, signal every live rank's group, wait up to the grace for
        the ranks to exit on their own."""
        path = self._notice_file(run.order)
        body = {"signal": n.signal.name, "grace_s": n.grace_s, "reason": n.reason}
        try:
            owner = run_as(run.order.account) if run.order.account is not None else None
            write_notice(path, json.dumps({**body, "at": time.time()}).encode(), owner)
        except (OSError, AccountError) as exc:
            what = f"attempt {run.order.attempt_id}"
            log.warning("%s: cannot write the notice file %s: %s", what, path, exc)
        with self._lock:
            live = [r for r in run.ranks if r.running and r.proc is not None]
        log.info(
            "attempt %d: notice %s to ranks %s, %.1fs to exit",
            run.order.attempt_id,
            n.signal.name,
            [r.rank for r in live],
            n.grace_s,
        )
        for r in live:
            signal_group(r, n.signal)
        with self._exited:
            self._exited.wait_for(lambda: not run.running, timeout=n.grace_s)

    def _notice_file(self, order: LaunchOrder) -> Path:
        """An account's ranks find their notice in the job's scratch dir (theirs, 0700, on
        a path every account can reach); the attempt's log dir may sit where they cannot
        (under the cluster's home), and its logs are not theirs to list."""
        if order.account is not None:
            return self._job_scratch(order) / f".notice-attempt-{order.attempt_id}.json"
        return notice_file(order.log_dir, self._node_env.get("TRAINPOD_NODE", "node"))

    def _job_scratch(self, order: LaunchOrder) -> Path:
        """The job's scratch dir on this node. A node with no scratch dir (a launcher built
        bare, as tests do) keeps it beside the job's logs, never in the working directory."""
        root = self._node_env.get("TRAINPOD_SCRATCH_DIR")
        if root is None:
            return Path(order.log_dir).parent / "scratch"
        return job_scratch_dir(Path(root), order.job_id)

    def _terminate(self, run: AttemptRun, grace_s: float) -> None:
        leaders: list[psutil.Process] = []
        for r in run.ranks:
            if not r.running or r.proc is None:
                continue
            try:
                leaders.append(procutil.Owned(r.proc))  # waits via the Popen, never reaps it
            except psutil.NoSuchProcess:
                signal_group(r, signal.SIGKILL)  # the rank is gone: stop what it left behind
        # Each rank leads its own process group. Every group is SIGKILLed after the grace, also
        # those whose rank has exited, which stops children that outlived their rank; the
        # watchers see the exits, so nothing waits after that.
        procutil.terminate(
            leaders, grace_s=grace_s, kill_wait_s=0.0, groups=True, before_signal=note_signal
        )

    def signal_rank(self, rank: int | None, sig: signal.Signals) -> int | None:
        """Send ``sig`` to a live rank's process group (the first live rank when None).

        Returns the rank signalled, or None when no such rank runs here."""
        with self._lock:
            live = [
                r
                for run in self._runs.values()
                for r in run.ranks
                if r.running and r.proc is not None and (rank is None or r.rank == rank)
            ]
        if not live:
            return None
        signal_group(live[0], sig)
        return live[0].rank

    def kill_everything(self) -> None:
        """SIGKILL every rank at once, no grace: what losing the node does to them."""
        with self._lock:
            live = [
                r
                for run in self._runs.values()
                for r in run.ranks
                if r.running and r.proc is not None
            ]
        for r in live:
            signal_group(r, signal.SIGKILL)

    def shutdown(self, grace_s: float) -> None:
        """Stop every attempt and wait for the ranks to end (agent exit)."""
        with self._lock:
            self._closing = True
            runs = list(self._runs.values())
        threads = []
        for run in runs:
            t = threading.Thread(target=self._terminate, args=(run, grace_s))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        if self._warm is not None:
            self._warm.close()

    def retain(self, active_jobs: set[int]) -> None:
        """The jobs still active on this node (the controller's word): the warm-start servers
        of every other job are closed."""
        if self._warm is not None:
            self._warm.retain(active_jobs)

    # -- reporting ----------------------------------------------------------------------
    def reports(self) -> list[AttemptReport]:
        return self.report()[0]

    def report(self) -> tuple[list[AttemptReport], list[int]]:
        """The attempts' reports, and the attempts forgotten in the last
        ``FORGOTTEN_FOR_S`` (newest last), read together: an attempt is in one or the other
        from its launch on, so a beat that lists neither was read before the launch."""
        with self._lock:
            reports = [
                AttemptReport(
                    attempt_id=aid, job_id=run.order.job_id, ranks=[r.report() for r in run.ranks]
                )
                for aid, run in sorted(self._runs.items())
            ]
            cutoff = time.monotonic() - FORGOTTEN_FOR_S
            for aid in [a for a, at in self._forgotten.items() if at < cutoff]:
                del self._forgotten[aid]
            return reports, list(self._forgotten)[-FORGOTTEN_MAX:]

    def delivered(self, reports: list[AttemptReport]) -> None:
        """The controller has recorded these reports: forget attempts that have fully ended."""
        with self._lock:
            for rep in reports:
                run = self._runs.get(rep.attempt_id)
                if run is None:
                    continue
                # An exit is acknowledged for the process it was about: a rank started
                # again in its attempt (in process, ADR 0026) runs as a new one, and a
                # reply to a beat read before the restart (the other thread's, late) must
                # not mark it delivered. Its run would then be forgotten with the new
                # process alive: never reported, never killed.
                ended = {(r.rank, r.pid) for r in rep.ranks if r.state == "exited"}
                for r in run.ranks:
                    if not r.running and (r.rank, r._pid()) in ended:
                        r.delivered = True
                if all(r.delivered for r in run.ranks):
                    now = time.time()
                    if run.awaits_recovery and run.kept_until is None:
                        run.kept_until = now + KEEP_FOR_RECOVERY_S
                    if run.kept_until is None or now >= run.kept_until:
                        del self._runs[rep.attempt_id]
                        self._forgotten[rep.attempt_id] = time.monotonic()

    def sigtermed(self) -> set[tuple[int, int]]:
        """(attempt, rank) of every rank here that died of a SIGTERM this launcher did not
        send (Slurm sends one to a job's whole process tree when it preempts without its
        user signal: :mod:`trainpod.agent.slurmnotice`)."""
        with self._lock:
            return {
                (aid, r.rank)
                for aid, run in self._runs.items()
                if not run.killing
                for r in run.ranks
                if r.signal == signal.SIGTERM
            }

    def attempt_ids(self) -> set[int]:
        with self._lock:
            return set(self._runs)

    def pids(self) -> list[int]:
        with self._lock:
            return [
                r.proc.pid
                for run in self._runs.values()
                for r in run.ranks
                if r.proc is not None and r.running
            ]
