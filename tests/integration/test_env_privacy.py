"""A job's env values and its private logs are its owner's (and admins'), through the real CLI
with two users' tokens on a real local cluster (issue 14: `trainpod jobs --json` showed every
job's full env, so a token passed with `--env` was readable by anyone who could list jobs)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_users import SPEC, as_user
from trainpod.controller.access import HIDDEN


@pytest.mark.timeout(300)
def test_others_see_a_jobs_env_keys_not_its_values_nor_its_private_logs(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    c = make_cluster_from_spec(SPEC)
    alice = json.loads(c.cli("users", "add", "alice", "--json").stdout)["token"]
    bob = json.loads(c.cli("users", "add", "bob", "--json").stdout)["token"]
    sub = as_user(
        c,
        alice,
        "submit",
        "--json",
        "--private",
        "--env",
        "HF_TOKEN=hf_canary_7f3a",
        "--",
        "sh",
        "-c",
        "echo alice-out-$HF_TOKEN",
    )
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["id"]
    assert c.wait_job(job_id).state == "completed"

    def env_of(out: str) -> str:
        return str(json.loads(out)["spec"]["env"]["HF_TOKEN"])

    listed = as_user(c, bob, "jobs", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    [theirs] = [j for j in json.loads(listed.stdout) if j["id"] == job_id]
    env = theirs["spec"]["env"]  # the CLI adds PATH to what --env gives
    assert "HF_TOKEN" in env and set(env.values()) == {HIDDEN}, env
    shown = as_user(c, bob, "show", str(job_id), "--json")
    assert shown.returncode == 0 and env_of(shown.stdout) == HIDDEN, shown.stderr
    table = as_user(c, bob, "jobs", "--all").stdout + as_user(c, bob, "show", str(job_id)).stdout
    assert "hf_canary_7f3a" not in table
    # The API itself, not only the CLI.
    url = f"http://{c.record.host}:{c.record.port}/v1/jobs/{job_id}"
    raw = httpx.get(url, headers={"Authorization": f"Bearer {bob}"}, timeout=30)
    assert raw.status_code == 200 and set(raw.json()["spec"]["env"].values()) == {HIDDEN}

    # Its owner and the admin (the cluster's creator) see the value.
    assert env_of(as_user(c, alice, "show", str(job_id), "--json").stdout) == "hf_canary_7f3a"
    assert env_of(c.cli("show", str(job_id), "--json").stdout) == "hf_canary_7f3a"

    # Its logs are private: bob is refused with the reason, alice reads them.
    refused = as_user(c, bob, "logs", str(job_id))
    assert refused.returncode != 0
    assert f"bob may not read the logs of job {job_id}" in refused.stderr
    assert "hf_canary_7f3a" not in refused.stdout + refused.stderr
    mine = as_user(c, alice, "logs", str(job_id))
    assert mine.returncode == 0 and "alice-out-hf_canary_7f3a" in mine.stdout, mine.stderr
