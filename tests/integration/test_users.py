"""Users and tokens through the real CLI on a real local cluster."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable

from tests.integration.conftest import Cluster

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 1
    devices_per_node: 2
teams:
  - name: vision
    quota: {{default: 1}}
  - name: nlp
    quota: {{default: 1}}
users:
  - {{name: alice, team: vision}}
  - {{name: bob, team: nlp}}
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
"""


def as_user(c: Cluster, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRAINPOD_CLUSTER": c.paths.name, "TRAINPOD_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "trainpod.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=c.workdir,
        env=env,
    )


def test_users_get_tokens_and_cannot_cancel_each_others_jobs(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    c = make_cluster_from_spec(SPEC)
    out = c.cli("users", "add", "alice", "--json").stdout
    alice = json.loads(out)["token"]
    # --save stores bob's token for this CLI, 0600 under $TRAINPOD_HOME/tokens.
    c.cli("users", "add", "bob", "--save")
    saved = c.paths.home / "tokens" / f"{c.paths.name}.token"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    bob = saved.read_text().strip()
    saved.unlink()

    me = as_user(c, alice, "whoami")
    assert me.returncode == 0 and "alice (user, team vision)" in me.stdout
    sub = as_user(c, alice, "submit", "--json", "--", "sleep", "60")
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["id"]

    refused = as_user(c, bob, "cancel", str(job_id))
    assert refused.returncode != 0
    assert f"bob may not cancel job {job_id}" in refused.stderr
    assert "belongs to alice" in refused.stderr

    assert as_user(c, alice, "cancel", str(job_id)).returncode == 0
    assert c.wait_job(job_id).state == "cancelled"

    # `trainpod login` stores a token given on stdin (checked first), then the CLI uses it.
    login = subprocess.run(
        [sys.executable, "-m", "trainpod.cli.main", "login"],
        input=bob + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRAINPOD_CLUSTER": c.paths.name},
    )
    assert login.returncode == 0 and "as bob" in login.stdout, login.stderr
    assert "bob (user, team nlp)" in c.cli("whoami").stdout
    saved.unlink()
    bad = subprocess.run(
        [sys.executable, "-m", "trainpod.cli.main", "login", "--token", "tp_wrong"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRAINPOD_CLUSTER": c.paths.name},
    )
    assert bad.returncode != 0 and "401" in bad.stderr and not saved.exists()

    listed = c.cli("users", "list").stdout
    assert "alice" in listed and "vision" in listed
    c.cli("users", "revoke", "alice")
    gone = as_user(c, alice, "jobs")
    assert gone.returncode != 0 and "401" in gone.stderr
