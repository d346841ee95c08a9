"""A job that runs as its owner's POSIX account can write its own TensorBoard runs into
``$TRAINPOD_TENSORBOARD_DIR``: the agent gives the job's logdir to the account."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_accounts import accounts, run_as_user
from trainpod.api.models import NewToken

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")
__all__ = ["accounts"]  # the fixture, used by name

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
storage:
  shared_dir: {root}/shared
  node_scratch_root: {root}/scratch
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
"""


@pytest.fixture
def root() -> Iterator[str]:
    """Shared dir and scratch other accounts can reach (pytest's tmp dirs are root's, 0700)."""
    path = tempfile.mkdtemp(prefix="tp-tb-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_job_running_as_an_account_writes_its_own_runs_into_its_logdir(
    make_cluster_from_spec: Callable[[str], Cluster], accounts: tuple[str, str], root: str
) -> None:
    alice_account, _ = accounts
    c = make_cluster_from_spec(SPEC.format(alice=alice_account, root=root))
    alice = c.client.add_user(NewToken(name="alice")).token
    state, log = run_as_user(
        c,
        alice,
        'id -un; d="$TRAINPOD_TENSORBOARD_DIR"; mkdir "$d/script" && touch "$d/script/x" '
        '&& stat -c "owner=%U" "$d"',
    )
    assert state == "completed", log
    assert log.splitlines()[0] == alice_account
    assert f"owner={alice_account}" in log
