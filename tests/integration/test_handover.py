"""A node's hand-over on a real cluster: the agent reports a rank's exit at once, and that
report's own scheduling pass places the queued job on the freed nodes; the agents then get
the launch (in the reply, or by their parked poll being woken) with no periodic heartbeat
involved: here a heartbeat comes only every 30 s, and the test asserts on the events' order
and cause, not on time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.conftest import Cluster
from trainpod.model.events import AttemptCreated, NodeReleased, RankExited, RankStarted, parse
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 1
health:
  heartbeat_interval_s: 30
  heartbeat_timeout_s: 120
recovery:
  teardown_grace_s: 2
"""
WAIT_FOR_GO = ["sh", "-c", "while [ ! -e go ]; do sleep 0.05; done"]


def test_a_queued_job_is_placed_by_the_exit_report_that_frees_its_nodes(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    c = make_cluster_from_spec(SPEC)
    first = c.submit(WAIT_FOR_GO, nodes=2, procs_per_node=1)
    wait_until(
        lambda: c.client.job(first.id).state == "running", timeout_s=60, what="the first job"
    )
    second = c.submit(["true"], nodes=2, procs_per_node=1)
    assert c.client.job(second.id).state == "queued"  # no node is free
    (c.workdir / "go").touch()
    done = c.wait_job(second.id)
    assert done.state == "completed", done.reason
    assert c.client.job(first.id).state == "completed"

    events = [(e.ts, parse(e)) for e in c.client.events()]  # in the order they happened
    seq: list[tuple[str, float, str]] = []
    for ts, e in events:
        if isinstance(e, RankExited) and e.job_id == first.id:
            seq.append(("exited", ts, e.node or ""))
        elif isinstance(e, NodeReleased) and e.job_id == first.id:
            seq.append(("released", ts, e.node))
        elif isinstance(e, AttemptCreated) and e.job_id == second.id:
            seq.append(("created", ts, ",".join(sorted(e.nodes))))
        elif isinstance(e, RankStarted) and e.job_id == second.id:
            seq.append(("started", ts, e.node or ""))
    kinds = [k for k, _, _ in seq]
    assert kinds == ["exited", "exited", "released", "released", "created", "started", "started"]
    assert seq[4][2] == "workers-0,workers-1"
    assert sorted(n for k, _, n in seq if k == "started") == ["workers-0", "workers-1"]
    # Placed by the pass of the report of the last exit (the same instant: the same call),
    # not by a later pass of the reconcile loop.
    assert seq[4][1] == seq[1][1]
