"""A real multi-node Slurm for the test session, run by ``scripts/slurm-ci``.

The session fixture ``slurm`` starts a private cluster (``node1..node4``, 8 CPUs each,
partitions ``debug`` (default), ``high`` and ``low``, whose jobs ``high`` preempts) in a
directory of its own, points ``SLURM_CONF`` at it for the session, and stops and removes it
at the end, also when tests fail. If Slurm cannot be installed or started the fixture fails
with the script's output: CI runs as root, so a missing Slurm is a broken set-up, not a
reason to skip.

Slurm 22.05 has no ``scontrol --json``: jobs come from ``squeue --json`` (which lists finished
jobs too, for MinJobAge=300 s, and ignores ``-j``/``-t``), nodes from ``sinfo --json`` (which
ignores ``-n``), both read with trainpod's own :class:`trainpod.slurm.cli.Slurm`. See
docs/slurm-json.md for the fields.

Tests wait on the state Slurm reports, never for a fixed time, and the deadlines come from the
cluster's own slurm.conf (:class:`SlurmTiming`), so they follow the timers that scripts/slurm-ci
sets and hold on a busy machine.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainpod.slurm.cli import Slurm, SlurmError, parse_node
from trainpod.testing.wait import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-ci"
HERE = Path(__file__).resolve().parent

#: Job states after which a job never runs again (as squeue --json spells them).
JOB_ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED"}
)


PREEMPT_GRACE_S = 30
"""Slurm's GraceTime for partition ``low``: its notice -> SIGTERM, SIGKILL and requeue."""

SLACK = 6
"""How much longer than on an idle machine Slurm may take on a busy one. Slurm's timers run
on the wall clock, but on a loaded CI machine every daemon waits for a CPU and every RPC may
use its whole MessageTimeout; a wait still fails within minutes when something hangs."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/slurm carries the ``slurm`` marker (``-m 'not slurm'`` skips).

    Their per-test timeout covers the test function only (``func_only``): the session's Slurm
    starts in the set-up of the first test that needs it and stops in the tear-down of the
    last, and a timeout that cut ``slurm-ci up`` or ``down`` short would leave daemons behind.
    The script and every wait in the fixtures have deadlines of their own.
    """
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slurm)
            own = item.get_closest_marker("timeout")
            args, kwargs = (own.args, own.kwargs) if own else ((), {})
            timeout = pytest.mark.timeout(*args, **{**kwargs, "func_only": True})
            item.add_marker(timeout, append=False)  # first, so the closest


def _state(node: Mapping[str, Any]) -> str:
    """A node's state in one string, flags sorted: ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``."""
    n = parse_node(node)
    return "+".join([n.state, *sorted(n.flags)])


@dataclass(frozen=True)
class SlurmTiming:
    """How long Slurm may take to do things, from the timers in the cluster's slurm.conf.

    Each ``*_s`` property is what those timers allow on an idle machine (the mechanics and
    the measurements behind them are in /work/shared/notes/slurm.md, sections 4 and 6); a wait
    uses :meth:`deadline`, which adds the slack a busy machine needs. Defaults are Slurm's own
    for keys the file leaves out.
    """

    slurmd_timeout_s: float = 300
    message_timeout_s: float = 10
    sched_interval_s: float = 60
    bf_interval_s: float = 30
    batch_sched_delay_s: float = 3
    health_check_interval_s: float = 0
    kill_wait_s: float = 30

    @classmethod
    def from_conf(cls, conf: Path) -> SlurmTiming:
        """Read the timers from ``conf`` (``Key=Value`` words; keys are case-insensitive)."""
        words: dict[str, str] = {}
        for line in conf.read_text().splitlines():
            for word in line.split("#", 1)[0].split():
                key, _, value = word.partition("=")
                words.setdefault(key.lower(), value)
        sub: dict[str, str] = {}  # SchedulerParameters=key=value,...
        for item in words.get("schedulerparameters", "").split(","):
            k, _, v = item.partition("=")
            sub[k.lower()] = v

        def num(value: str | None, default: float) -> float:
            return float(value) if value and value.isdigit() else default

        d = cls()
        return cls(
            slurmd_timeout_s=num(words.get("slurmdtimeout"), d.slurmd_timeout_s),
            message_timeout_s=num(words.get("messagetimeout"), d.message_timeout_s),
            sched_interval_s=num(sub.get("sched_interval"), d.sched_interval_s),
            bf_interval_s=num(sub.get("bf_interval"), d.bf_interval_s),
            batch_sched_delay_s=num(sub.get("batch_sched_delay"), d.batch_sched_delay_s),
            health_check_interval_s=num(
                words.get("healthcheckinterval"), d.health_check_interval_s
            ),
            kill_wait_s=num(words.get("killwait"), d.kill_wait_s),
        )

    def deadline(self, *phases_s: float) -> float:
        """A wait's timeout for Slurm to go through ``phases_s`` (properties of this class)."""
        return SLACK * sum(phases_s)

    @property
    def rpc_s(self) -> float:
        """One RPC between Slurm's daemons or from a client: given up after MessageTimeout."""
        return self.message_timeout_s

    @property
    def ping_interval_s(self) -> float:
        """slurmctld pings a node that has not answered for SlurmdTimeout/3 (at least 1 s)."""
        return max(1.0, self.slurmd_timeout_s // 3)

    @property
    def start_s(self) -> float:
        """An eligible job to RUNNING: the next pass of the scheduler or the backfill, then
        the launch RPC to the node."""
        return (
            self.batch_sched_delay_s + max(self.sched_interval_s, self.bf_interval_s) + self.rpc_s
        )

    @property
    def down_s(self) -> float:
        """A dead slurmd to DOWN ("Not responding"), its jobs requeued or failed. slurmctld
        marks it DOWN in the first ping cycle whose previous cycle began SlurmdTimeout or more
        after the node's last answer; a ping of a dead port retries the refused connection
        (2 x MessageTimeout + 1 s, measured) and the next cycle waits for it. Measured 13-18 s
        with SlurmdTimeout=5, MessageTimeout=3; this gives 20 s."""
        ping_s = max(self.ping_interval_s, 2 * self.message_timeout_s + 1)
        return self.slurmd_timeout_s + self.ping_interval_s + 2 * ping_s

    @property
    def respond_s(self) -> float:
        """A restarted or resumed slurmd to responding (NOT_RESPONDING cleared, and idle
        again with ReturnToService=2): its registration, at the latest the next ping."""
        return self.ping_interval_s + self.rpc_s

    @property
    def health_check_s(self) -> float:
        """Every slurmd runs its health check every HealthCheckInterval; a drain it asks for
        is one RPC."""
        return self.health_check_interval_s + self.rpc_s

    @property
    def end_s(self) -> float:
        """A cancelled job, or one on a node gone DOWN, to its end (requeued, if it may be):
        SIGTERM, KillWait, SIGKILL, then the completion RPC."""
        return self.kill_wait_s + self.rpc_s


def run_script(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/slurm-ci ARGS``; stdout and stderr come back together in ``stdout``."""
    return subprocess.run(
        [str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@dataclass(frozen=True)
class SlurmCI:
    """One running test cluster. Methods block; they raise on a failed command or a timeout."""

    dir: Path
    conf: Path
    nodes: tuple[str, ...]
    timing: SlurmTiming

    @property
    def slurm(self) -> Slurm:
        """trainpod's own Slurm client for this cluster (JSON output, errors checked)."""
        return Slurm(env={"SLURM_CONF": str(self.conf)})

    @property
    def env(self) -> dict[str, str]:
        """The environment for a Slurm client command: ours plus SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def uts_namespaces(self) -> bool:
        """Whether each slurmd runs with its own hostname (so ``hostname`` in a job is nodeX)."""
        return " uts=1" in self.conf.read_text().splitlines()[0]

    def run(
        self, *args: str, check: bool = True, timeout_s: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``sbatch``, ``scontrol``...) against this cluster."""
        proc = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def script(self, *args: str) -> str:
        """Run ``scripts/slurm-ci ARGS --dir DIR``; return its output, raise if it fails."""
        proc = run_script(*args, "--dir", str(self.dir), timeout_s=120)
        if proc.returncode != 0:
            raise AssertionError(f"slurm-ci {' '.join(args)} failed:\n{proc.stdout}")
        return proc.stdout

    # ------------------------------------------------------------------ nodes

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's slurmd, its slurmstepds and job processes. Slurm sees the node
        not responding after ~5 s and DOWN within ``timing.down_s``."""
        self.script("kill-node", name)

    def start_node(self, name: str) -> None:
        """Start the node's slurmd again (no-op if running); it answers within
        ``timing.respond_s`` (in under 1 s, measured)."""
        self.script("start-node", name)

    def set_health_command(self, cmdline: str | None) -> None:
        """Make every slurmd run ``cmdline`` (with /bin/sh, SLURMD_NODENAME and SLURM_CONF set)
        as its health check every HealthCheckInterval; None stops it. A non-zero exit does not
        drain the node: the command must call ``scontrol update ... State=DRAIN`` itself."""
        path = self.dir / "healthcheck.cmd"
        if cmdline is None:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(cmdline + "\n")
        tmp.replace(path)

    def nodes_json(self) -> dict[str, dict[str, Any]]:
        """``sinfo --json`` nodes by name (fields in docs/slurm-json.md)."""
        return {n["name"]: n for n in self.slurm.json(["sinfo", "--json"])["nodes"]}

    def node(self, name: str) -> dict[str, Any]:
        return self.nodes_json()[name]

    def node_state(self, name: str) -> str:
        """State as scontrol spells it: ``IDLE``, ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``..."""
        return _state(self.node(name))

    def wait_node(self, name: str, predicate: Callable[[str], bool], *, timeout_s: float) -> str:
        """Wait until ``predicate(node_state(name))``; return that state. A Slurm command that
        fails meanwhile (slurmctld busy) counts as not yet."""
        last: list[str] = []

        def probe() -> str | None:
            try:
                last[:] = [self.node_state(name)]
            except SlurmError as exc:
                last[:] = [str(exc)]
                return None
            return last[0] if predicate(last[0]) else None

        try:
            return wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what=f"{name} state")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; {name} was {last}") from None

    def wait_idle(self, *, timeout_s: float) -> None:
        """Wait until every node is plain IDLE (no DRAIN, DOWN or NOT_RESPONDING flag)."""
        last: dict[str, str] = {}

        def probe() -> bool:
            last.clear()
            try:
                last.update({name: _state(n) for name, n in self.nodes_json().items()})
            except SlurmError as exc:
                last["error"] = str(exc)
                return False
            return bool(last) and all(state == "IDLE" for state in last.values())

        try:
            wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what="all nodes idle")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; node states: {last}") from None

    # ------------------------------------------------------------------- jobs

    def submit(self, *sbatch_args: str) -> int:
        """``sbatch --parsable ARGS``; the job id."""
        out = self.run("sbatch", "--parsable", *sbatch_args).stdout
        return int(out.strip().split(";")[0])

    def jobs_json(self) -> list[dict[str, Any]]:
        """Every job of ``squeue --json``, finished ones too (for MinJobAge=300 s)."""
        jobs: list[dict[str, Any]] = self.slurm.json(["squeue", "--json"])["jobs"]
        return jobs

    def job(self, job_id: int) -> dict[str, Any] | None:
        """The job from ``squeue --json``, or None."""
        return next((j for j in self.jobs_json() if j["job_id"] == job_id), None)

    def wait_job(
        self, job_id: int, states: frozenset[str] = JOB_ENDED, *, timeout_s: float
    ) -> dict[str, Any]:
        """Wait until the job's ``job_state`` is one of ``states``; return the job. A Slurm
        command that fails meanwhile (slurmctld busy) counts as not yet."""
        last: list[str] = []

        def probe() -> dict[str, Any] | None:
            try:
                job = self.job(job_id)
            except SlurmError as exc:
                last[:] = [str(exc)]
                return None
            last[:] = [] if job is None else [job["job_state"], job["state_reason"]]
            return job if job is not None and job["job_state"] in states else None

        try:
            return wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what=f"job {job_id}")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; wanted {sorted(states)}, job was {last}") from None

    def reset(self) -> None:
        """Back to a clean, idle cluster: no health command, no live jobs, every slurmd
        running, every node resumed."""
        self.set_health_command(None)
        live = [str(j["job_id"]) for j in self.jobs_json() if j["job_state"] not in JOB_ENDED]
        if live:
            self.run("scancel", *live, check=False)
        for name in self.nodes:
            self.start_node(name)
        for name, node in self.nodes_json().items():
            if node["state"] != "idle" or node["state_flags"]:
                self.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
        t = self.timing
        self.wait_idle(timeout_s=t.deadline(t.end_s, t.respond_s))


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCI]:
    """The session's Slurm cluster; SLURM_CONF is set in os.environ while it runs."""
    # Unique per session (never the developer's /tmp/trainpod-slurm-ci) and short: unix
    # socket paths under it must stay below 108 bytes.
    cluster_dir = Path(f"/tmp/trainpod-slurm-ci-{os.getpid()}")
    try:
        # Partition `low` is preemptible (by `high`, REQUEUE, GraceTime); debug/high are not.
        up = run_script("up", "--preempt-grace", str(PREEMPT_GRACE_S), "--dir", str(cluster_dir))
        if up.returncode != 0:
            pytest.fail(
                f"scripts/slurm-ci up failed (exit {up.returncode}):\n{up.stdout}", pytrace=False
            )
        conf = cluster_dir / "slurm.conf"
        nodes = tuple(
            line.split()[0].removeprefix("NodeName=")
            for line in conf.read_text().splitlines()
            if line.startswith("NodeName=")
        )
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(conf))
            yield SlurmCI(
                dir=cluster_dir, conf=conf, nodes=nodes, timing=SlurmTiming.from_conf(conf)
            )
    finally:
        down = run_script("down", "--purge", "--dir", str(cluster_dir))
        if down.returncode != 0:
            pytest.fail(f"scripts/slurm-ci down failed:\n{down.stdout}", pytrace=False)
