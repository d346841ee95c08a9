"""Interactive work through a real pseudo-terminal, as a person would type it: `trainpod alloc`
opens a shell on a held node, `trainpod run` runs ranks in it, exit releases the nodes; a
closed terminal and a killed CLI release them too; `trainpod shell` opens a node's or a
job's shell. Every wait has a deadline; none asserts how long anything took."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from tests.integration.conftest import Cluster
from trainpod.model.events import AllocationExpired, AllocationReleased, parse
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"
PROMPT = "tp-test-prompt> "
SHELL = "bash --norc --noprofile -i"
TIMEOUT_S = 90  # pexpect's, per expect: generous, the box is loaded; never asserted on
# One line a test greps for: the shell prints it, so the command's echo never matches.
PROBE = (
    "echo JOB=${TRAINPOD_JOB_ID-none} ALLOC=${TRAINPOD_ALLOCATION-none} "
    "NODE=$TRAINPOD_NODE NODES=${TRAINPOD_NODES-none} SIM=${TRAINPOD_SIMULATED_DEVICES-none} "
    "CVD=${CUDA_VISIBLE_DEVICES-unset} WS=${WORLD_SIZE-unset} PWD=$PWD"
)
_V = r"[^\s$]+"  # a value the shell expanded (the typed line has $NAMES)
PROBED = re.compile(
    rf"JOB=(?P<job>{_V}) ALLOC=(?P<alloc>{_V}) NODE=(?P<node>{_V}) NODES=(?P<nodes>{_V}) "
    rf"SIM=(?P<sim>{_V}) CVD=(?P<cvd>{_V}) WS=(?P<ws>{_V}) PWD=(?P<pwd>{_V})"
)


class Terminal:
    """The real CLI in a pseudo-terminal, with what it printed kept for failure messages."""

    def __init__(self, cluster: Cluster, *args: str) -> None:
        self.seen = io.StringIO()
        env = {
            **os.environ,
            "TRAINPOD_CLUSTER": cluster.paths.name,
            "PS1": PROMPT,
            "TERM": "dumb",
            "COLUMNS": "200",
        }
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "trainpod.cli.main", *args],
            cwd=str(cluster.workdir),
            env=env,
            encoding="utf-8",
            codec_errors="replace",
            timeout=TIMEOUT_S,
            dimensions=(50, 250),
        )
        self.child.logfile_read = self.seen

    def expect(self, pattern: str | re.Pattern[str]) -> re.Match[str]:
        try:
            self.child.expect(pattern)
        except (pexpect.TIMEOUT, pexpect.EOF) as exc:
            raise AssertionError(
                f"{type(exc).__name__} waiting for {pattern!r}; the terminal showed:\n"
                f"{self.seen.getvalue()}"
            ) from None
        match = self.child.match
        assert isinstance(match, re.Match)
        return match

    def prompt(self) -> None:
        self.expect(re.escape(PROMPT))

    def run(self, line: str) -> None:
        """Type ``line`` at the prompt; returns once the next prompt is there."""
        self.child.sendline(line)
        self.prompt()

    def probe(self) -> re.Match[str]:
        self.child.sendline(PROBE)
        match = self.expect(PROBED)
        self.prompt()
        return match

    def status(self, line: str) -> int:
        """Run ``line``; its exit status as the shell saw it."""
        self.child.sendline(f"{line}; echo STATUS=$?")
        code = int(self.expect(r"STATUS=(\d+)")[1])
        self.prompt()
        return code

    def exit_code(self) -> int | None:
        """The CLI's exit status once it has ended (and closed the terminal)."""
        try:
            self.child.expect(pexpect.EOF)
        except pexpect.TIMEOUT:
            raise AssertionError(
                f"the CLI did not end; the terminal showed:\n{self.seen.getvalue()}"
            ) from None
        self.child.close()
        status: int | None = self.child.exitstatus
        return status

    def close(self) -> None:
        if self.child.isalive():
            self.child.close(force=True)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for t in made:
        t.close()


def open_terminal(terminals: list[Terminal], cluster: Cluster, *args: str) -> Terminal:
    t = Terminal(cluster, *args)
    terminals.append(t)
    return t


def event_of(cluster: Cluster, job_id: int, cls: type) -> object:
    return wait_until(
        lambda: next(
            (e for e in map(parse, cluster.client.events(job_id=job_id)) if isinstance(e, cls)),
            None,
        ),
        timeout_s=60,
        what=f"a {cls.__name__} event of job {job_id}",
    )


def assert_devices(cluster: Cluster, env: re.Match[str]) -> None:
    """The shell has the node's devices as its ranks get them: the GPUs the local backend
    gave the node (CUDA_VISIBLE_DEVICES) or, on a machine without, the CPU slots that stand
    in for the 2 devices each node declares (TRAINPOD_SIMULATED_DEVICES)."""
    node = next(n for n in cluster.client.nodes() if n.name == env["node"])
    devices = node.facts["devices"]
    if devices["simulated"]:
        assert (env["sim"], env["cvd"]) == ("2", "unset"), env.groupdict()
    else:
        assert (env["sim"], env["cvd"]) == ("none", ",".join(devices["visible"]))


@pytest.mark.timeout(300)
def test_alloc_shell_run_and_exit_releases(
    cluster: Cluster, terminals: list[Terminal], tmp_path: Path
) -> None:
    term = open_terminal(terminals, cluster, "alloc", "-N", "2", "--shell", SHELL)
    term.expect(r"allocation (\d+) ")
    term.prompt()
    env = term.probe()
    job_id = int(env["job"])
    assert env["alloc"] == env["job"]
    nodes = env["nodes"].split(",")
    assert sorted(nodes) == ["workers-0", "workers-1"]
    assert env["node"] == nodes[0]  # the shell is on the allocation's first node
    assert_devices(cluster, env)
    assert env["ws"] == "unset"  # the shell is not a rank; `trainpod run` makes ranks
    scratch = Path(cluster.record.scratch_root) / nodes[0] / f"job-{job_id}"
    assert Path(env["pwd"]).resolve() == scratch.resolve()

    job = cluster.client.job(job_id)
    assert job.state == "running" and job.spec.interactive
    held = {n.name: n.job_id for n in cluster.client.nodes()}
    assert held["workers-0"] == held["workers-1"] == job_id

    # A step: two nodes, one rank each, the torchrun contract, Gloo across them.
    term.child.sendline(f"trainpod run -p 1 -- python {WORKERS / 'allreduce.py'}; echo STATUS=$?")
    seen = {}
    for _ in (0, 1):  # in whichever order the two ranks print
        line = term.expect(r"ok rank=(\d) world=2 sum=1.0 node=(\S+) scratch=\S+ job=(\d+)")
        seen[int(line[1])] = (line[2], int(line[3]))
    assert seen == {0: (nodes[0], job_id), 1: (nodes[1], job_id)}
    assert term.expect(r"STATUS=(\d+)")[1] == "0"
    term.prompt()
    # Rank 0 leaves first and rank 1 reads the store after it has gone: this CLI hosts the
    # step's store, as torchrun's launcher does (rank 0 hosting it, rank 1 failed).
    order = tmp_path / "exit-order"
    order.mkdir()
    step = f"trainpod run -p 1 -- python {WORKERS / 'exit_order.py'} {order}"
    term.child.sendline(f"{step}; echo STATUS=$?")
    term.expect(r"rank 0 has gone; tearing down")
    term.expect(r"rank 0 left result 6.0; done")
    assert term.expect(r"STATUS=(\d+)")[1] == "0"
    term.prompt()
    # Its exit status comes back, and nothing was queued for it.
    assert term.status("trainpod run -p 1 -- python -c 'import sys; sys.exit(3)'") == 3
    assert [j.id for j in cluster.client.jobs()] == [job_id]
    kinds = [e.kind for e in cluster.client.events(job_id=job_id)]
    assert kinds.count("step_started") == 3 and kinds.count("step_ended") == 3

    term.child.sendline("exit 0")
    assert term.exit_code() == 0
    done = cluster.wait_job(job_id)
    assert done.state == "cancelled"
    released = event_of(cluster, job_id, AllocationReleased)
    assert isinstance(released, AllocationReleased)
    assert "shell exited with status 0" in released.reason
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_alloc_waits_in_the_queue_and_shows_why(
    cluster: Cluster, terminals: list[Terminal], tmp_path: Path
) -> None:
    release = tmp_path / "hold"
    release.mkdir()
    busy = cluster.submit(["python", str(WORKERS / "hold.py"), str(release)], nodes=2)
    cluster.wait_job(busy.id, {"running"})
    term = open_terminal(terminals, cluster, "alloc", "-N", "1", "--shell", SHELL)
    queued = term.expect(r"allocation (\d+) queued: (.+) \(position 1[,)]")
    job_id = int(queued[1])
    assert cluster.client.job(job_id).state == "queued"
    (release / "release").write_text("")  # the busy job ends: the allocation gets a node
    term.prompt()
    env = term.probe()
    assert int(env["job"]) == job_id
    term.child.sendline("exit 4")
    assert term.exit_code() == 4  # the shell's status is alloc's
    assert cluster.wait_job(job_id).state == "cancelled"
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_closed_terminal_releases_at_once(cluster: Cluster, terminals: list[Terminal]) -> None:
    term = open_terminal(terminals, cluster, "alloc", "-N", "1", "--shell", SHELL)
    term.prompt()
    job_id = int(term.probe()["job"])
    # What the kernel does to a terminal's controlling process when its window closes.
    assert term.child.pid is not None
    os.kill(term.child.pid, signal.SIGHUP)
    assert term.exit_code() == 128 + signal.SIGHUP  # it ends, and takes its shell along
    released = event_of(cluster, job_id, AllocationReleased)
    assert isinstance(released, AllocationReleased) and "SIGHUP" in released.reason
    assert cluster.wait_job(job_id).state == "cancelled"
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_killed_cli_does_not_hold_nodes_forever(
    cluster: Cluster, terminals: list[Terminal]
) -> None:
    term = open_terminal(terminals, cluster, "alloc", "-N", "2", "--shell", SHELL)
    term.prompt()
    job_id = int(term.probe()["job"])
    assert term.child.pid is not None
    os.kill(term.child.pid, signal.SIGKILL)  # no handler runs: only the lease can end it
    expired = event_of(cluster, job_id, AllocationExpired)
    assert isinstance(expired, AllocationExpired)
    assert "stopped renewing the lease" in expired.reason
    assert not any(
        isinstance(e, AllocationReleased) for e in map(parse, cluster.client.events(job_id=job_id))
    )
    assert cluster.wait_job(job_id).state == "cancelled"
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_an_allocation_that_ends_under_its_shell_closes_it(
    cluster: Cluster, terminals: list[Terminal]
) -> None:
    term = open_terminal(terminals, cluster, "alloc", "-N", "2", "--shell", SHELL)
    term.prompt()
    job_id = int(term.probe()["job"])

    def second_hold() -> int | None:
        # A rank is reported running before its process exists (its start runs off the
        # agent's heartbeat); its pid follows with a later report.
        (attempt,) = cluster.client.job(job_id).attempts
        return next(r.pid for r in attempt.ranks if r.node == attempt.nodes[1])

    pid = wait_until(second_hold, timeout_s=60, what="the second node's hold to have a pid")
    os.kill(pid, signal.SIGKILL)  # the second node's hold dies: the allocation fails
    term.expect(rf"allocation {job_id} ended: allocation {job_id} has ended \(failed")
    assert term.exit_code() != 0
    assert cluster.client.job(job_id).state == "failed"
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_shell_on_a_node_and_in_a_job(
    cluster: Cluster, terminals: list[Terminal], tmp_path: Path
) -> None:
    term = open_terminal(terminals, cluster, "shell", "workers-1", "--shell", SHELL)
    term.prompt()
    env = term.probe()
    assert env["node"] == "workers-1" and env["job"] == "none"
    assert_devices(cluster, env)
    node_scratch = Path(cluster.record.scratch_root) / "workers-1"
    assert Path(env["pwd"]).resolve() == node_scratch.resolve()
    term.child.sendline("exit")
    assert term.exit_code() == 0

    release = tmp_path / "hold"
    release.mkdir()
    job = cluster.submit(["python", str(WORKERS / "hold.py"), str(release)], nodes=2)
    running = cluster.wait_job(job.id, {"running"})
    second = running.attempts[-1].nodes[1]
    term = open_terminal(
        terminals, cluster, "shell", str(job.id), "--node", second, "--shell", SHELL
    )
    term.prompt()
    env = term.probe()
    assert int(env["job"]) == job.id and env["alloc"] == "none"  # a job, not an allocation
    assert env["node"] == second and env["nodes"] == ",".join(running.attempts[-1].nodes)
    job_scratch = Path(cluster.record.scratch_root) / second / f"job-{job.id}"
    assert Path(env["pwd"]).resolve() == job_scratch.resolve()
    term.child.sendline("exit")
    assert term.exit_code() == 0
    assert cluster.client.job(job.id).state == "running"  # a shell is no part of the job
    (release / "release").write_text("")
    assert cluster.wait_job(job.id).state == "completed"


def test_run_outside_an_allocation_says_how(cluster: Cluster) -> None:
    env_free = cluster.cli("run", "--", "true", check=False)
    assert env_free.returncode == 2
    assert "works inside an allocation" in env_free.stderr
