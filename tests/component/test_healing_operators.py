"""Operator node actions, chaos orders and the events goodput reads.

A real :class:`Controller` on real SQLite, a fake clock and fake agents, stepped by hand;
each test checks states and the story the events tell.
"""

from __future__ import annotations

import pytest

from trainpod.api.models import ChaosRequest, NodeAction
from trainpod.errors import Conflict
from trainpod.testing import FakeGroup

from .healing import WORKERS, FakeRepairer, Make


# -- operators ----------------------------------------------------------------------------
def test_drain_keeps_new_work_off_a_node_but_leaves_its_job_alone(make: Make) -> None:
    c = make(groups=[FakeGroup("workers", 3)])
    running = c.submit(nodes=1)
    c.start(running)
    assert c.nodes_of(running) == ["workers-0"]
    row = c.controller.node_action("workers-0", NodeAction(action="drain", reason="kernel update"))
    assert (row.state, row.drained) == ("allocated", True)
    c.controller.node_action("workers-1", NodeAction(action="drain", reason="kernel update"))
    assert c.node("workers-1").reason == "drained (operator: kernel update)"
    job = c.submit(nodes=1)
    c.controller.step()
    assert c.nodes_of(job) == ["workers-2"]  # not the drained idle node
    assert c.job(running).state == "running"
    c.tick(1)
    assert c.job(running).state == "running"
    c.finish(running)
    assert c.job(running).state == "completed"
    assert (c.node("workers-0").state, c.node("workers-0").drained) == ("idle", True)
    queued = c.submit(nodes=1)
    c.controller.step()
    assert c.job(queued).state == "queued"  # two drained nodes, one busy
    c.controller.node_action("workers-1", NodeAction(action="resume", reason="done"))
    assert (c.node("workers-1").state, c.node("workers-1").drained) == ("idle", False)
    c.controller.step()
    assert c.nodes_of(queued) == ["workers-1"]
    assert [e.kind for e in c.events(node="workers-1")][-3:-1] == ["node_drain", "node_resume"]


def test_an_operator_quarantine_stops_the_job_and_never_repairs_on_its_own(make: Make) -> None:
    repairer = FakeRepairer()
    c = make(replacer=repairer)
    job = c.submit(auto_resume=True)
    c.start(job)
    c.controller.node_action("workers-0", NodeAction(action="quarantine", reason="bad DIMM"))
    node = c.node("workers-0")
    assert (node.state, node.reason) == ("quarantined", "operator: bad DIMM")
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "quarantined",
    )
    c.teardown(job)
    assert c.job(job).attempts[1].nodes == ["spares-0", "workers-1"]
    for _ in range(3):
        c.tick(1)
    assert c.node("workers-0").state == "quarantined"
    assert repairer.calls == []
    assert c.events("node_quarantine", node="workers-0")[0].data["reason"] == "bad DIMM"


def test_resume_deep_checks_a_quarantined_node_before_it_returns(make: Make) -> None:
    c = make(groups=[WORKERS])
    c.controller.node_action("workers-1", NodeAction(action="quarantine", reason="suspicious"))
    row = c.controller.node_action("workers-1", NodeAction(action="resume", reason="looks fine"))
    assert (row.state, row.reason) == ("repairing", "repairing (check)")
    agent = c.agents["workers-1"]
    orders = agent.beat()  # the same agent: a check, not a replacement
    assert orders.deep_check is not None
    job = c.submit(nodes=2)
    c.controller.step()
    assert c.job(job).state == "queued"  # not schedulable while it is checked
    agent.deep_check_result(orders.deep_check.id, "ok")
    agent.beat()
    assert c.node("workers-1").state == "idle"
    c.controller.step()
    assert c.job(job).state == "starting"


def test_replace_needs_a_backend_that_can_replace_nodes(make: Make) -> None:
    c = make(groups=[WORKERS])
    with pytest.raises(Conflict, match="cannot replace nodes"):
        c.controller.node_action("workers-0", NodeAction(action="replace", reason="old"))
    assert c.node("workers-0").state == "idle"
    assert not c.events("node_replace")  # the refusal left no trace

    repairer = FakeRepairer()
    c.restart_controller(replacer=repairer)
    c.controller.node_action("workers-0", NodeAction(action="replace", reason="old"))
    assert c.node("workers-0").state == "quarantined"
    c.controller.step()
    assert c.node("workers-0").state == "repairing"
    assert repairer.wait_for(1) == ["workers-0"]


# -- chaos --------------------------------------------------------------------------------
def test_a_chaos_order_reaches_the_agent_until_it_is_acknowledged(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    order = c.controller.chaos(ChaosRequest(node="workers-1", fault="xid79"))
    assert (order.fault, order.rank) == ("xid79", None)
    (event,) = c.events("chaos_injected", node="workers-1")
    assert (event.job_id, event.data["fault"], event.data["id"]) == (job, "xid79", order.id)
    agent = c.agents["workers-1"]
    agent.ack_chaos = False
    assert agent.beat().chaos == [order]
    assert agent.beat().chaos == [order]  # still pending: not acknowledged
    agent.ack_chaos = True
    assert agent.heartbeat().chaos_done == [order.id]
    assert agent.beat().chaos == []
    assert agent.chaos == [order]  # recorded once
    assert c.agents["workers-0"].beat().chaos == []

    kill = c.controller.chaos(ChaosRequest(node="workers-1", fault="kill-worker"))
    assert kill.rank == 2  # the node's first running rank
    slow = c.controller.chaos(ChaosRequest(node="workers-1", fault="slow", rank=3))
    assert [o.id for o in agent.beat().chaos] == [kill.id, slow.id]


def test_a_fault_that_needs_a_rank_is_refused_without_one(make: Make) -> None:
    c = make()
    for fault in ("kill-worker", "hang", "slow"):
        with pytest.raises(Conflict, match="needs a running rank on workers-0"):
            c.controller.chaos(ChaosRequest(node="workers-0", fault=fault))
    job = c.submit(nodes=1)
    c.start(job)
    with pytest.raises(Conflict, match="rank 5 is not running on workers-0"):
        c.controller.chaos(ChaosRequest(node="workers-0", fault="hang", rank=5))
    assert c.controller.chaos(ChaosRequest(node="workers-1", fault="disk-full")).rank is None
    assert not c.events("chaos_injected", fault="hang")


def test_chaos_needs_a_running_agent(make: Make) -> None:
    c = make()
    c.agents["workers-0"].beat(leaving=True)
    assert c.node("workers-0").state == "stopped"
    with pytest.raises(Conflict, match="no running agent"):
        c.controller.chaos(ChaosRequest(node="workers-0", fault="xid79"))


# -- goodput inputs -----------------------------------------------------------------------
def test_beacons_give_first_beacon_and_attempt_progress_events(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.tick(4)  # start-up: no beacon yet
    first_at = c.clock.now()
    for step in range(10, 15):
        c.report(job, step, step_time=0.5)
        c.tick(1)
    c.report(job, 15, step_time=0.5)
    c.agents["workers-0"].progress(c.attempt_id(job), 0, 16, checkpoint_step=15)
    c.tick(1)
    (first,) = c.events("first_beacon", job_id=job)
    assert (first.attempt, first.data["at"], first.data["step"]) == (1, first_at, 10)
    assert first.ts == first_at + 1  # the beat that carried it
    assert not c.events("attempt_progress", job_id=job)  # only at the end of the attempt

    c.crash(job, rank=2)
    (progress,) = c.events("attempt_progress", job_id=job)
    assert progress.attempt == 1
    assert progress.data["first_step"] == 10
    assert progress.data["last_step"] == 15  # the step every rank finished
    assert progress.data["step_time_s"] == 0.5
    assert progress.data["first_beacon_at"] == first_at
    assert progress.data["last_beacon_at"] == first_at + 5
    assert progress.data["last_checkpoint_step"] == 15
    assert progress.data["ranks"] == 4

    c.start(job)
    c.report(job, 16, step_time=0.5)
    c.tick(1)
    c.report(job, 17, step_time=0.5)
    c.tick(1)
    c.finish(job)
    assert c.job(job).state == "completed"
    assert [e.attempt for e in c.events("first_beacon", job_id=job)] == [1, 2]
    assert [
        (e.attempt, e.data["first_step"], e.data["last_step"])
        for e in c.events("attempt_progress", job_id=job)
    ] == [(1, 10, 15), (2, 16, 17)]
    assert c.story(job, ["first_beacon", "fault_detected", "attempt_progress"]) == [
        ("first_beacon", 1),
        ("fault_detected", 1),
        ("attempt_progress", 1),
        ("first_beacon", 2),
        ("attempt_progress", 2),
    ]


def test_an_attempt_without_beacons_records_no_progress(make: Make) -> None:
    c = make()
    job = c.submit()
    c.start(job)
    c.finish(job)
    assert not c.events("first_beacon") and not c.events("attempt_progress")
