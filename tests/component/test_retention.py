"""The event log's retention through the controller: every event of a live job is kept,
and those of jobs that ended more than event_retention_days ago go."""

from __future__ import annotations

from .conftest import MakeCluster

DAY_S = 86_400.0


def test_retention_keeps_live_jobs_and_recent_events(make_cluster: MakeCluster) -> None:
    c = make_cluster(heartbeat_timeout_s=100 * DAY_S)
    c.up()
    done = c.submit(nodes=1)
    attempt = c.start(done)
    c.agents[c.job(done).attempts[0].nodes[0]].exit_all(attempt)
    c.beat()
    assert c.job(done).state == "completed"
    live = c.submit(nodes=1)
    c.start(live)
    before_live = len(c.events(job_id=live))
    assert c.events(job_id=done) and before_live

    c.clock.advance(31 * DAY_S)
    recent = c.submit(nodes=1)  # queued now: its events are recent
    assert c.controller.prune_events() > 0
    assert c.events(job_id=done) == []  # ended 31 days ago
    assert len(c.events(job_id=live)) == before_live  # still running: all of its story
    assert c.events("job_submitted", job_id=recent)
    assert c.controller.prune_events() == 0  # idempotent
