"""Secret env values and tokens on a real local cluster, through the real CLI (issue 14 item
5, ADR 0032): ``--secret-env`` / ``--secret-env-file`` values reach the ranks and nothing
else (shown as ``***`` to the owner and admins, not at all to other users, in no event, log,
metric or the job's stored spec); no token (users', the admin's, the agents', the scrape
token) appears in any log or event after a run that used them all."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_users import SPEC, as_user
from trainpod.paths import read_secret
from trainpod.store.db import open_db

pytestmark = pytest.mark.integration

CANARY = "hf_secret_canary_91b7"
FILE_CANARY = "wandb_secret_canary_5e02"
# The ranks prove they got the values without printing them: their SHA-256.
SHOW = (
    "import hashlib, os; "
    "print('got', *(hashlib.sha256(os.environ[k].encode()).hexdigest() "
    "for k in ('HF_TOKEN', 'WANDB_API_KEY')), flush=True)"
)


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def logs_of(c: Cluster) -> dict[str, str]:
    """Every log file of the cluster: controller, agents, lifecycle, persisters, ranks."""
    return {
        str(p.relative_to(c.paths.state_dir)): p.read_text(errors="replace")
        for p in c.paths.state_dir.rglob("*.log")
    }


@pytest.mark.timeout(300)
def test_secret_env_reaches_the_ranks_only_and_no_token_is_logged(
    make_cluster_from_spec: Callable[[str], Cluster], tmp_path: Path
) -> None:
    c = make_cluster_from_spec(SPEC)
    alice = json.loads(c.cli("users", "add", "alice", "--json").stdout)["token"]
    bob = json.loads(c.cli("users", "add", "bob", "--json").stdout)["token"]
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"# wandb\nWANDB_API_KEY={FILE_CANARY}\n")
    env_file.chmod(0o600)
    sub = as_user(
        c,
        alice,
        *("submit", "--json", "--secret-env", f"HF_TOKEN={CANARY}"),
        *("--secret-env-file", str(env_file), "--", "python", "-c", SHOW),
    )
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["id"]
    assert CANARY not in sub.stdout  # the submission's answer shows it masked too
    assert c.wait_job(job_id).state == "completed"
    mine = as_user(c, alice, "logs", str(job_id))
    assert f"got {sha(CANARY)} {sha(FILE_CANARY)}" in mine.stdout, mine.stdout + mine.stderr

    masked = {"HF_TOKEN": "***", "WANDB_API_KEY": "***"}
    shown = json.loads(as_user(c, alice, "show", str(job_id), "--json").stdout)
    assert shown["spec"]["secret_env"] == masked  # the owner knows they exist
    assert json.loads(c.cli("show", str(job_id), "--json").stdout)["spec"]["secret_env"] == masked
    [theirs] = [
        j
        for j in json.loads(as_user(c, bob, "jobs", "--all", "--json").stdout)
        if j["id"] == job_id
    ]
    assert theirs["spec"]["secret_env"] == {}  # another user does not even know
    url = f"http://{c.record.host}:{c.record.port}"
    raw = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {bob}"})
    assert raw.status_code == 200 and raw.json()["spec"]["secret_env"] == {}

    # Tokens of every kind were used: users' (above), the admin's (c.cli), the agents' (every
    # heartbeat), the scrape token (a /metrics scrape).
    scrape = read_secret(c.paths.scrape_token)
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {scrape}"})
    assert metrics.status_code == 200, metrics.text
    tokens = {
        "alice's": alice,
        "bob's": bob,
        "admin": read_secret(c.paths.admin_token),
        "agents'": read_secret(c.paths.agent_token),
        "scrape": scrape,
    }
    db = open_db(c.paths.db)
    try:  # the whole event log, and what the CLI shows of it
        events = "\n".join(str(tuple(r)) for r in db.execute("SELECT * FROM events"))
    finally:
        db.close()
    events += c.cli("events", "--json").stdout
    cli_out = sub.stdout + sub.stderr + mine.stdout + mine.stderr
    places = {**logs_of(c), "events": events, "/metrics": metrics.text, "CLI": cli_out}
    secrets = {"HF_TOKEN": CANARY, "WANDB_API_KEY": FILE_CANARY}
    for what, value in {**tokens, **secrets}.items():
        leaks = [where for where, text in places.items() if value in text]
        assert not leaks, f"{what} value found in {leaks}"
    assert "rank-0.log" in " ".join(places) and "controller.log" in " ".join(places)
    assert "job_submitted" in events  # the log was read (the names are no secret)

    # The stored spec holds the names only; the values are gone once the job ended.
    db = open_db(c.paths.db)
    try:
        [(spec,)] = db.execute("SELECT spec FROM jobs WHERE id = ?", (job_id,)).fetchall()
        assert json.loads(spec)["secret_env"] == masked
        assert db.execute("SELECT count(*) FROM job_secrets").fetchone()[0] == 0
    finally:
        db.close()
