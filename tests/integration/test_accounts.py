"""Jobs run as their owner's POSIX account: real accounts, a real cluster with root agents."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import NewToken
from trainpod.client.http import TrainpodClient
from trainpod.spec.job import JobSpec

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
