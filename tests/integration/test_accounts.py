"""Jobs run as their owner's POSIX account: real accounts, a real cluster with root agents."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import trainpod
from tests.integration.conftest import Cluster
from tests.integration.test_interactive import Terminal, open_terminal
from trainpod.api.models import NewToken
from trainpod.client.http import TrainpodClient
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until

PURELIB = sysconfig.get_paths()["purelib"]  # the venv's packages (torch, pydantic, fsspec)
SRC = str(Path(trainpod.__file__).resolve().parents[1])  # an editable install's .pth is not
# read from a PYTHONPATH entry, so the sources go on the path themselves
ACCOUNT_PYTHONPATH = os.pathsep.join(
    p for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), SRC, PURELIB] if p
)


def _others_can_read(path: str) -> bool:
    """Whether another account can reach ``path``: every directory above it searchable."""
    p = Path(path).resolve()
    return all(d.stat().st_mode & stat.S_IXOTH for d in (p, *p.parents)) and bool(
        p.stat().st_mode & stat.S_IROTH
    )


needs_a_readable_checkout = pytest.mark.skipif(
    not all(_others_can_read(p) for p in (SRC, PURELIB)),
    reason=f"another account cannot read this checkout's sources or venv ({SRC}, {PURELIB});"
    " clone it where every account can read it (not under /root) to run this test",
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")

SPEC = """\
name: {{name}}
backend: local
instance_groups:
  - name: workers
    count: 1
    devices_per_node: 1
teams:
  - name: vision
    quota: {{{{default: 1}}}}
users:
  - {{{{name: alice, team: vision, account: {alice}}}}}
  - {{{{name: bob, team: vision, account: {bob}}}}}
storage:
  node_scratch_root: {scratch}
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
"""


@pytest.fixture
def scratch() -> Iterator[str]:
    """A scratch root other accounts can reach (pytest's tmp dirs are root's, 0700)."""
    root = tempfile.mkdtemp(prefix="tp-scratch-", dir="/tmp")
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def accounts() -> Iterator[tuple[str, str]]:
    """Two fresh POSIX accounts with homes (what a lifecycle script's useradd makes)."""
    tag = uuid.uuid4().hex[:6]
    names = (f"tpa{tag}", f"tpb{tag}")
    for n in names:
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", n], check=True)
    try:
        yield names
    finally:
        for n in names:
            subprocess.run(["userdel", "-r", n], check=False, capture_output=True)


def run_as_user(c: Cluster, token: str, script: str) -> tuple[str, str]:
    """Submit ``sh -c script`` with ``token``; the job's end state and rank 0's log."""
    with TrainpodClient(c.record.url, token) as user:
        job = user.submit(JobSpec(command=["sh", "-c", script], workdir="/tmp"))
        ended = c.wait_job(job.id)
        return ended.state.value, user.logs(job.id, rank=0).data


def test_ranks_run_as_the_owners_account_and_cannot_read_another_users_files(
    make_cluster_from_spec: Callable[[str], Cluster],
    accounts: tuple[str, str],
    scratch: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alice_account, bob_account = accounts
    monkeypatch.setenv("TRAINPOD_TEST_AGENT_SECRET", "root-only")  # the agents inherit it
    c = make_cluster_from_spec(SPEC.format(alice=alice_account, bob=bob_account, scratch=scratch))
    alice = c.client.add_user(NewToken(name="alice")).token
    bob = c.client.add_user(NewToken(name="bob")).token

    state, log = run_as_user(
        c,
        alice,
        'id -un; echo "home=$HOME user=$USER"; env | grep -c TRAINPOD_TEST_AGENT_SECRET; '
        "echo private > $HOME/secret; chmod 600 $HOME/secret; touch $TRAINPOD_JOB_SCRATCH_DIR/x",
    )
    assert state == "completed", log
    lines = log.splitlines()
    assert lines[0] == alice_account
    assert f"home=/home/{alice_account} user={alice_account}" in lines[1]
    assert lines[2] == "0"  # nothing of the agent's (root's) environment

    state, log = run_as_user(c, bob, f"id -un; cat /home/{alice_account}/secret")
    assert state == "failed"
    assert log.splitlines()[0] == bob_account
    assert "Permission denied" in log and "private" not in log


def test_an_account_that_does_not_exist_fails_the_rank_with_the_reason(
    make_cluster_from_spec: Callable[[str], Cluster], scratch: str
) -> None:
    c = make_cluster_from_spec(
        SPEC.format(alice="tp-nobody-here", bob="tp-nobody-either", scratch=scratch)
    )
    alice = c.client.add_user(NewToken(name="alice")).token
    state, log = run_as_user(c, alice, "id -un")
    assert state == "failed"
    assert "no POSIX account 'tp-nobody-here' on this node" in log


WORKER = str(Path(__file__).parent / "workers" / "account_ckpt.py")
# The tests' interpreter lives in root's home here, where accounts cannot run it; the
# system's Python (the same 3.11) with the venv's packages on the path stands in for it.
SYSTEM_PYTHON = Path("/usr/bin/python3")
# Connects to argv[1..] as whoever runs it; prints one word per socket.
_CONNECT = """
import socket, sys
for path in sys.argv[1:]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        c.connect(path)
        print("connected")
    except OSError as exc:
        print(type(exc).__name__)
    finally:
        c.close()
"""

# Lists each directory, reads each file of argv[1..] as whoever runs it; one word per path.
_READ = """
import os, sys
for path in sys.argv[1:]:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).read()
        print("read")
    except OSError as exc:
        print(type(exc).__name__)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 for accounts")
@needs_a_readable_checkout
def test_an_accounts_rank_reports_progress_and_commits_checkpoints_and_nobody_else_gets_in(
    make_cluster_from_spec: Callable[[str], Cluster],
    accounts: tuple[str, str],
    scratch: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alice_account, bob_account = accounts
    monkeypatch.setenv("PYTHONPATH", ACCOUNT_PYTHONPATH)  # the agents' persisters get it
    monkeypatch.setenv("TRAINPOD_PERSIST_PYTHON", str(SYSTEM_PYTHON))
    c = make_cluster_from_spec(SPEC.format(alice=alice_account, bob=bob_account, scratch=scratch))
    alice = c.client.add_user(NewToken(name="alice")).token
    alice_pw = pwd.getpwnam(alice_account)
    durable = Path(tempfile.mkdtemp(prefix="tp-durable-", dir="/tmp"))
    os.chown(durable, alice_pw.pw_uid, alice_pw.pw_gid)
    try:
        with TrainpodClient(c.record.url, alice) as user:
            job = user.submit(
                JobSpec(
                    command=[str(SYSTEM_PYTHON), WORKER, str(durable)],
                    workdir="/tmp",
                    env={"PYTHONPATH": ACCOUNT_PYTHONPATH},
                )
            )

            def progressed() -> dict[str, object] | None:
                shown = json.loads(c.cli("show", str(job.id), "--json").stdout)
                progress = shown.get("progress") or {}
                step = progress.get("last_step")
                return progress if isinstance(step, int) and step >= 5 else None

            progress = wait_until(progressed, timeout_s=120, what="beacons of alice's rank")
            assert isinstance(progress["last_step"], int)

            def committed() -> list[int]:
                events = c.client.events(job_id=job.id)
                return [
                    int(e.data["step"])
                    for e in events
                    if e.kind == "checkpoint_committed" and e.data.get("tier") == "durable"
                ]

            # durable: the persister's copy (a memory-tier commit comes before it is written)
            steps = wait_until(committed, timeout_s=120, what="a durable checkpoint")
            log = user.logs(job.id, rank=0).data
        [line] = [ln for ln in log.splitlines() if ln.startswith("sockets ")]
        beacon_sock, ckpt_sock = (Path(w.split("=", 1)[1]) for w in line.split()[1:])
        theirs = beacon_sock.parent
        assert theirs == ckpt_sock.parent and theirs.name == f"u{alice_pw.pw_uid}"
        st = theirs.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice_pw.pw_uid, 0o700)
        written = list(durable.rglob("*"))  # the persister, as alice, wrote the durable copy
        assert written and steps
        assert all(p.stat().st_uid == alice_pw.pw_uid for p in durable.rglob("*"))

        # Bob's processes reach neither alice's sockets nor the agent's own.
        agent_socks = [theirs.parent / "workers-0.sock", theirs.parent / "workers-0.ckpt.sock"]
        assert all(p.exists() for p in agent_socks)
        bob_pw = pwd.getpwnam(bob_account)
        tried = subprocess.run(
            [
                str(SYSTEM_PYTHON),
                "-c",
                _CONNECT,
                str(beacon_sock),
                str(ckpt_sock),
                *map(str, agent_socks),
            ],
            user=bob_pw.pw_uid,
            group=bob_pw.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert tried == ["PermissionError"] * 4, tried

        # Its memory tier (RAM) and scratch are alice's alone, its rank log the agent's alone.
        [dirs] = [ln for ln in log.splitlines() if ln.startswith("dirs ")]
        where = dict(w.split("=", 1) for w in dirs.split()[1:])
        for d in (where["memory"], where["scratch"]):
            st = os.stat(d)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice_pw.pw_uid, 0o700), d
        assert any(Path(where["memory"]).rglob("*")), "the memory tier holds the checkpoints"
        [rank_log] = (c.paths.jobs_dir / str(job.id)).rglob("rank-0.log")
        st = rank_log.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o600)
        read = subprocess.run(
            [str(SYSTEM_PYTHON), "-c", _READ, where["memory"], where["scratch"], str(rank_log)],
            user=bob_pw.pw_uid,
            group=bob_pw.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert read == ["PermissionError"] * 3, read

        # A preemption notice reaches alice's rank by its file too (in her scratch, hers).
        c.client.preempt(job.id, reason="a test", grace_s=60)

        def noticed() -> str | None:
            text = c.client.logs(job.id, rank=0, attempt=1).data
            return text if "noticed" in text else None

        first = wait_until(noticed, timeout_s=60, what="alice's rank to see the notice")
        assert "noticed file=True" in first, first
        st = os.stat(where["notice"])
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice_pw.pw_uid, 0o600)
        assert Path(where["notice"]).parent == Path(where["scratch"])
        c.client.cancel(job.id)
        c.wait_job(job.id)
    finally:
        shutil.rmtree(durable, ignore_errors=True)


WHO = (
    'echo "WHO=$(id -un) HOME=$HOME LEAK=${TRAINPOD_TEST_AGENT_SECRET-none}'
    ' JOB=${TRAINPOD_JOB_ID-none}"'
)
WHOAMI = re.compile(r"WHO=(?P<who>[\w-]+) HOME=(?P<home>/\S+) LEAK=(?P<leak>\S+) JOB=(?P<job>\S+)")


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for t in made:
        t.close()


@pytest.fixture
def shim() -> Iterator[Path]:
    """A dir whose ``python`` other accounts may run (ours is under /root): the hold process
    of `trainpod alloc`, which runs as the account, starts ``python``."""
    d = Path(tempfile.mkdtemp(prefix="tp-py-", dir="/tmp"))
    d.chmod(0o755)
    (d / "python").symlink_to(SYSTEM_PYTHON)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 for accounts")
@needs_a_readable_checkout
def test_shells_of_a_job_and_of_an_allocation_run_as_the_callers_account(
    make_cluster_from_spec: Callable[[str], Cluster],
    accounts: tuple[str, str],
    scratch: str,
    shim: Path,
    terminals: list[Terminal],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alice_account, bob_account = accounts
    monkeypatch.setenv("TRAINPOD_TEST_AGENT_SECRET", "root-only")  # the CLI has it: not the shell
    c = make_cluster_from_spec(SPEC.format(alice=alice_account, bob=bob_account, scratch=scratch))
    alice = c.client.add_user(NewToken(name="alice")).token
    alice_pw = pwd.getpwnam(alice_account)
    monkeypatch.setenv("TRAINPOD_TOKEN", alice)  # the terminals' CLI is alice's
    with TrainpodClient(c.record.url, alice) as user:
        job = user.submit(JobSpec(command=["sleep", "600"], workdir="/tmp"))
    c.wait_job(job.id, {"running"})

    term = open_terminal(terminals, c, "shell", str(job.id), "--shell", "sh -i")
    term.expect(f"the shell runs as account {alice_account}")
    term.child.sendline(WHO)
    seen = term.expect(WHOAMI)
    assert (seen["who"], seen["home"]) == (alice_account, f"/home/{alice_account}")
    assert (seen["leak"], seen["job"]) == ("none", str(job.id))
    term.child.sendline("exit 0")
    assert term.exit_code() == 0
    c.client.cancel(job.id)
    c.wait_job(job.id)

    python = ACCOUNT_PYTHONPATH
    term = open_terminal(
        terminals,
        c,
        "alloc",
        "--shell",
        "sh -i",
        "--env",
        f"PATH={shim}:/usr/bin:/bin",
        "--env",
        f"PYTHONPATH={python}",
    )
    alloc_id = int(term.expect(r"allocation (\d+) ")[1])
    term.expect(f"the shell runs as account {alice_account}")
    term.child.sendline(WHO)
    seen = term.expect(WHOAMI)
    assert (seen["who"], seen["job"], seen["leak"]) == (alice_account, str(alloc_id), "none")

    # Inside it, trainpod is alice's: a home of the shell's own with her token, hers alone.
    term.child.sendline('echo "TPHOME=$TRAINPOD_HOME TOKEN=${TRAINPOD_TOKEN-none}"')
    seen = term.expect(r"TPHOME=(?P<home>/\S+) TOKEN=(?P<token>\S+)")
    home, shown = Path(seen["home"]), seen["token"]
    assert shown == "none"  # the token is in no variable the shell's processes inherit
    [token_file] = (home / "tokens").iterdir()
    assert token_file.read_text() == alice
    for p in (home, home / "tokens", token_file):
        st = p.lstat()
        mode = 0o600 if p == token_file else 0o700
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice_pw.pw_uid, mode), p

    # `trainpod run` starts a step in the allocation, as alice's account (srun in salloc).
    cli = "python -m trainpod.cli.main"
    step = "sh -c 'echo STEP=$(id -un)/$RANK/$TRAINPOD_STEP'"
    term.child.sendline(f"{cli} run -- {step}; echo RAN=$?")
    seen = term.expect(r"STEP=(?P<who>[\w-]+)/(?P<rank>\d+)/(?P<step>\d+)")
    assert (seen["who"], seen["rank"], seen["step"]) == (alice_account, "0", "1")
    term.expect("RAN=0")
    term.child.sendline(f"{cli} submit --name from-the-shell -- true; echo SUBMITTED=$?")
    term.expect("SUBMITTED=0")
    term.child.sendline(f"{cli} jobs --json | grep -c from-the-shell; echo LISTED=$?")
    term.expect("LISTED=0")
    [queued] = [j for j in c.client.jobs() if j.name == "from-the-shell"]
    assert queued.spec.user == "alice"  # submitted with her token, not root's
    c.client.cancel(queued.id)

    term.child.sendline("exit 0")
    assert term.exit_code() == 0
    assert c.wait_job(alloc_id).state == "cancelled"
    assert not home.exists()  # the shell's trainpod home goes with it
