"""A submission whose reply is lost for real makes one job (ADR 0037): the controller commits
and answers, a proxy throws the reply away and drops the connection, and the client's retry
(with the same Idempotency-Key) gets the job the first call made. ``trainpod submit`` run
twice with one ``--idempotency-key`` gives one job too."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.conftest import Cluster
from tests.integration.lossyproxy import LossyProxy, body, header
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import read_secret
from trainpod.spec.job import JobSpec

pytestmark = pytest.mark.integration


def test_a_retry_after_a_lost_reply_gets_the_job_the_first_call_made(cluster: Cluster) -> None:
    spec = JobSpec(
        command=["true"], procs_per_node=1, env=default_env(), workdir=str(cluster.workdir)
    )
    token = read_secret(cluster.paths.admin_token)
    with (
        LossyProxy(cluster.record.url, match=b"POST /v1/jobs ", drops=1) as proxy,
        TrainpodClient(proxy.url, token, retry_s=60) as client,
    ):
        job = client.submit(spec)
    (lost,) = proxy.lost  # the controller made a job and answered; the client never saw it
    assert lost.startswith(b"HTTP/1.1 201"), lost[:200]
    assert json.loads(body(lost))["id"] == job.id
    first, retry = proxy.requests
    key = header(first, "Idempotency-Key")
    assert key and header(retry, "Idempotency-Key") == key  # one key across the retries
    assert body(first) == body(retry)

    assert [j.id for j in cluster.client.jobs(include_ended=True)] == [job.id]
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    kinds = [e.kind for e in cluster.client.events(job_id=job.id)]
    assert kinds.count("job_submitted") == 1 and kinds.count("rank_started") == 1

    # The CLI: the same command with the same key, run twice (a script's own retry).
    args = ("submit", "--idempotency-key", "nightly-2026-12-02", "--", "true")
    ids = [re.search(r"submitted job (\d+)", cluster.cli(*args).stdout) for _ in range(2)]
    assert all(ids), ids
    again = {int(m.group(1)) for m in ids if m}
    assert len(again) == 1 and job.id not in again
    assert len(cluster.client.jobs(include_ended=True)) == 2
