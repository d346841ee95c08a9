"""A real multi-node Slurm for the test session, run by ``scripts/slurm-ci``.

The session fixture ``slurm`` starts a private cluster (``node1..node4``, 8 CPUs each,
partitions ``debug`` (default) and ``high``) in a directory of its own, points
``SLURM_CONF`` at it for the session, and stops and removes it at the end, also when tests
fail. If Slurm cannot be installed or started the fixture fails with the script's output:
CI runs as root, so a missing Slurm is a broken set-up, not a reason to skip.

Slurm 22.05 has no ``scontrol --json``: jobs come from ``squeue --json`` (which lists finished
jobs too, for MinJobAge=300 s, and ignores ``-j``/``-t``), nodes from ``sinfo --json`` (which
ignores ``-n``). See docs/slurm-json.md for the fields.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainpod.testing.wait import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-ci"
HERE = Path(__file__).resolve().parent

#: Job states after which a job never runs again (as squeue --json spells them).
JOB_ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/slurm carries the ``slurm`` marker (``-m 'not slurm'`` skips)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slurm)


def _state(node: dict[str, Any]) -> str:
    return "+".join([node["state"].upper(), *node["state_flags"]])


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
        not responding after ~5 s and DOWN after 13-18 s (SlurmdTimeout=5)."""
        self.script("kill-node", name)

    def start_node(self, name: str) -> None:
        """Start the node's slurmd again (no-op if running); it is idle again in under 1 s."""
        self.script("start-node", name)

    def set_health_command(self, cmdline: str | None) -> None:
        """Make every slurmd run ``cmdline`` (with /bin/sh, SLURMD_NODENAME and SLURM_CONF set)
        as its health check every 5 s; None stops it. A non-zero exit does not drain the
        node: the command must call ``scontrol update ... State=DRAIN`` itself."""
        path = self.dir / "healthcheck.cmd"
        if cmdline is None:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(cmdline + "\n")
        tmp.replace(path)

    def nodes_json(self) -> dict[str, dict[str, Any]]:
        """``sinfo --json`` nodes by name (fields in docs/slurm-json.md)."""
        out = self.run("sinfo", "--json").stdout
        return {n["name"]: n for n in json.loads(out)["nodes"]}

    def node(self, name: str) -> dict[str, Any]:
        return self.nodes_json()[name]

    def node_state(self, name: str) -> str:
        """State as scontrol spells it: ``IDLE``, ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``..."""
        return _state(self.node(name))

    def wait_node(self, name: str, predicate: Callable[[str], bool], timeout_s: float = 30) -> str:
        """Wait until ``predicate(node_state(name))``; return that state."""
        last: list[str] = []

        def probe() -> str | None:
            last[:] = [self.node_state(name)]
            return last[0] if predicate(last[0]) else None

        try:
            return wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what=f"{name} state")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; {name} was {last}") from None

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Wait until every node is plain IDLE (no DRAIN, DOWN or NOT_RESPONDING flag)."""
        last: dict[str, str] = {}

        def probe() -> bool:
            last.clear()
            last.update({name: _state(n) for name, n in self.nodes_json().items()})
            return all(state == "IDLE" for state in last.values())

        try:
            wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what="all nodes idle")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; node states: {last}") from None

    # ------------------------------------------------------------------- jobs

    def submit(self, *sbatch_args: str) -> int:
        """``sbatch --parsable ARGS``; the job id."""
        out = self.run("sbatch", "--parsable", *sbatch_args).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, Any] | None:
        """The job from ``squeue --json`` (finished jobs stay for MinJobAge=300 s), or None."""
        out = self.run("squeue", "--json").stdout
        return next((j for j in json.loads(out)["jobs"] if j["job_id"] == job_id), None)

    def wait_job(
        self, job_id: int, states: frozenset[str] = JOB_ENDED, timeout_s: float = 30
    ) -> dict[str, Any]:
        """Wait until the job's ``job_state`` is one of ``states``; return the job."""
        last: list[str] = []

        def probe() -> dict[str, Any] | None:
            job = self.job(job_id)
            last[:] = [] if job is None else [job["job_state"], job["state_reason"]]
            return job if job is not None and job["job_state"] in states else None

        try:
            return wait_until(probe, timeout_s=timeout_s, interval_s=0.2, what=f"job {job_id}")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}; wanted {sorted(states)}, job was {last}") from None

    def reset(self, timeout_s: float = 45) -> None:
        """Back to a clean, idle cluster: no health command, no live jobs, every slurmd
        running, every node resumed."""
        self.set_health_command(None)
        jobs = json.loads(self.run("squeue", "--json").stdout)["jobs"]
        live = [str(j["job_id"]) for j in jobs if j["job_state"] not in JOB_ENDED]
        if live:
            self.run("scancel", *live, check=False)
        for name in self.nodes:
            self.start_node(name)
        for name, node in self.nodes_json().items():
            if node["state"] != "idle" or node["state_flags"]:
                self.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
        self.wait_idle(timeout_s)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCI]:
    """The session's Slurm cluster; SLURM_CONF is set in os.environ while it runs."""
    # Unique per session (never the developer's /tmp/trainpod-slurm-ci) and short: unix
    # socket paths under it must stay below 108 bytes.
    cluster_dir = Path(f"/tmp/trainpod-slurm-ci-{os.getpid()}")
    try:
        up = run_script("up", "--dir", str(cluster_dir))
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
            yield SlurmCI(dir=cluster_dir, conf=conf, nodes=nodes)
    finally:
        down = run_script("down", "--purge", "--dir", str(cluster_dir))
        if down.returncode != 0:
            pytest.fail(f"scripts/slurm-ci down failed:\n{down.stdout}", pytrace=False)
