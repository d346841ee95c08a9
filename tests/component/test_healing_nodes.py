"""Self-healing of node faults: GPU faults, lost nodes, spares, repair, stragglers.

A real :class:`Controller` on real SQLite, a fake clock and fake agents, stepped by hand;
each test checks states and the story the events tell.
"""

from __future__ import annotations

from typing import Literal

from trainpod.api.models import NodeAction
from trainpod.testing import FakeGroup

from .healing import WORKERS, FakeRepairer, HealingCluster, Make


# -- GPU faults, spares and repair --------------------------------------------------------
def test_a_gpu_fault_quarantines_the_node_and_a_spare_takes_its_place(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    c.tick(100)
    seen_at = c.clock.now()
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a1.set_health("gpu", "fault", "XID 79: GPU has fallen off the bus")
    a1.beat()
    node = c.node("workers-1")
    assert (node.state, node.reason) == (
        "quarantined",
        "gpu: XID 79: GPU has fallen off the bus",
    )
    assert node.job_id == job  # until its attempt is torn down
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "gpu_fault",
    )
    (fault,) = c.events("fault_detected", job_id=job)  # when it was seen, not after teardown
    assert (fault.ts, fault.data["fault"], fault.data["fault_at"]) == (
        seen_at,
        "gpu_fault",
        seen_at,
    )
    assert fault.data["nodes"] == ["workers-1"]
    assert c.moves("workers-1")[-1] == ("allocated", "quarantined")

    o0 = a0.beat()
    assert [(k.attempt_id, k.reason) for k in o0.kill] == [(first, "gpu_fault")]
    assert a1.beat().kill[0].attempt_id == first  # the faulty node kills its ranks too
    c.clock.advance(3)
    c.teardown(job)
    info = c.job(job)
    assert info.state == "starting"
    assert (info.attempts[0].state, info.attempts[0].cause) == ("failed", "gpu_fault")
    two = info.attempts[1]
    assert two.nodes == ["workers-0", "spares-0"]  # the spare in the bad node's position
    assert c.node_states() == {
        "workers-0": "allocated",
        "workers-1": "quarantined",
        "spares-0": "allocated",
    }
    assert c.node("workers-1").job_id is None
    assert c.node("spares-0").job_id == job
    (decision,) = c.events("recovery_decision", job_id=job)
    assert decision.data["action"] == "restart"
    assert decision.data["replaced"] == {"workers-1": "spares-0"}
    assert decision.data["counts"] is False
    created = c.events("attempt_created", job_id=job, attempt=2)[0]
    assert created.data["restart_reason"] == (
        "gpu_fault: workers-1: gpu: XID 79: GPU has fallen off the bus"
    )
    assert c.events("node_released", job_id=job, node="workers-1")

    c.start(job)
    c.finish(job)
    assert c.job(job).state == "completed"
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined", "spares-0": "idle"}
    c.controller.step()
    assert c.node("workers-1").state == "quarantined"  # no repairer: held for an operator

    # With a repairer, the node is replaced like a new instance, deep-checked, and returns.
    repairer = FakeRepairer()
    c.restart_controller(replacer=repairer)
    c.controller.step()
    assert c.node("workers-1").state == "repairing"
    assert repairer.wait_for(1) == ["workers-1"]
    assert a1.beat().deep_check is None  # the old instance is not the one to check
    assert c.node("workers-1").state == "repairing"

    new = c.replace_agent("workers-1")
    assert new.agent_id != a1.agent_id
    assert new.beat(lifecycle="running").deep_check is None  # lifecycle scripts first
    orders = new.beat()
    assert orders.deep_check is not None
    assert orders.deep_check.timeout_s == c.cfg.deep_check_timeout_s
    new.deep_check_result(orders.deep_check.id, "running")
    new.beat()
    assert c.node("workers-1").state == "repairing"
    new.deep_check_result(orders.deep_check.id, "ok")
    new.beat()
    node = c.node("workers-1")
    assert (node.state, node.reason, node.repairs, node.job_id) == ("idle", "", 0, None)
    assert c.moves("workers-1")[-2:] == [("quarantined", "repairing"), ("repairing", "idle")]
    repair = ["node_state", "agent_registered", "deep_check_started", "deep_check_finished"]
    repair.append("node_repaired")
    kinds = [e.kind for e in c.events(node="workers-1") if e.kind in repair]
    assert kinds[-6:] == [
        "node_state",  # quarantined -> repairing
        "agent_registered",  # the new instance
        "deep_check_started",
        "deep_check_finished",
        "node_state",  # repairing -> idle
        "node_repaired",
    ]
    assert new.beat().deep_check is None


def test_failed_repairs_quarantine_again_and_finally_retire_the_node(make: Make) -> None:
    repairer = FakeRepairer()
    c = make(groups=[WORKERS], retire_after=3, replacer=repairer)
    c.agents["workers-1"].set_health("memory", "fault", "uncorrectable ECC")
    c.agents["workers-1"].beat()
    assert c.node("workers-1").state == "quarantined"

    def repair_once(status: Literal["ok", "fault"], expected_calls: int) -> None:
        c.controller.step()
        assert c.node("workers-1").state == "repairing"
        assert len(repairer.wait_for(expected_calls)) == expected_calls
        new = c.replace_agent("workers-1")
        new.beat()
        new.deep_check_result(None, status, "GEMM check: 3 mismatches")
        new.beat()

    repair_once("fault", 1)
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("quarantined", 1)
    assert node.reason == "repair 1 failed: deep check failed: GEMM check: 3 mismatches"
    repair_once("ok", 2)
    assert (c.node("workers-1").state, c.node("workers-1").repairs) == ("idle", 0)  # reset

    c.agents["workers-1"].set_health("gpu", "fault", "XID 48")
    c.agents["workers-1"].beat()
    for n in (1, 2):
        repair_once("fault", 2 + n)
        assert (c.node("workers-1").state, c.node("workers-1").repairs) == ("quarantined", n)
    repair_once("fault", 5)
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("retired", 3)
    assert node.reason.startswith("retired after 3 failed repairs; last: deep check failed")
    c.controller.step()
    assert c.node("workers-1").state == "retired"
    assert len(repairer.calls) == 5  # a retired node is never repaired on its own


def test_a_repair_that_never_reports_fails_after_the_deadline(make: Make) -> None:
    repairer = FakeRepairer()
    c = make(groups=[WORKERS], deep_check_timeout_s=60, replacer=repairer)
    c.agents["workers-1"].set_health("disk", "fault", "scratch full")
    c.agents["workers-1"].beat()
    c.controller.step()
    assert c.node("workers-1").state == "repairing"
    c.tick(60 + 120 + 1, "workers-0")
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("quarantined", 1)
    assert "repair did not finish in time" in node.reason


def test_a_lost_node_is_replaced_by_the_spare(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    last_seen = c.clock.now()
    c.tick(c.cfg.heartbeat_timeout_s + 1, "workers-0", "spares-0")
    node = c.node("workers-1")
    assert node.state == "quarantined"
    assert node.reason.startswith("node lost: no heartbeat for")
    assert c.moves("workers-1")[-2:] == [("allocated", "suspect"), ("suspect", "quarantined")]
    (fault,) = c.events("fault_detected", job_id=job)
    assert (fault.data["fault"], fault.data["fault_at"], fault.node) == (
        "node_lost",
        last_seen,
        "workers-1",
    )
    c.teardown(job, ["workers-0"])
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[0].cause == "node_lost"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    assert c.decisions(job)[0][1] == "replaced workers-1 -> spares-0 after node_lost"

    c.start(job)
    assert c.job(job).state == "running"
    # The lost agent comes back: it is told to kill what it still runs, and stays quarantined.
    orders = c.agents["workers-1"].beat()
    assert [k.attempt_id for k in orders.kill] == [first]
    assert c.node("workers-1").state == "quarantined"
    c.finish(job)
    assert c.job(job).state == "completed"


def test_a_rank_killed_with_its_gpu_is_a_node_fault_not_the_job_s(make: Make) -> None:
    """The rank died first (a crash), the health check said why: it does not count."""
    c = make(max_restarts=1)
    job = c.submit(auto_resume=True)
    first = c.start(job)
    a1 = c.agents["workers-1"]
    a1.exit_rank(first, 3, signal=9)
    a1.set_health("gpu", "fault", "XID 79")
    a1.beat()
    c.teardown(job)
    info = c.job(job)
    assert info.attempts[0].cause == "crash"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    decision = c.events("recovery_decision", job_id=job)[0]
    assert decision.data["counts"] is False
    # Its one counted restart is still there for a real crash of the job.
    c.start(job)
    c.crash(job, rank=0)
    info = c.job(job)
    assert (info.state, len(info.attempts)) == ("starting", 3)
    assert c.decisions(job)[-1][:2] == ("restart", "restart after crash")


# -- no spare left ------------------------------------------------------------------------
def _wait_for_a_node(c: HealingCluster, job: int) -> None:
    c.start(job)
    c.agents["workers-1"].set_health("gpu", "fault", "XID 79")
    c.agents["workers-1"].beat()
    c.teardown(job)


def test_without_a_spare_the_job_waits_holding_its_healthy_nodes(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    info = c.job(job)
    assert info.state == "recovering"
    assert info.reason == "waiting for a healthy node to replace workers-1 (gpu_fault)"
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "quarantined"}
    assert c.node("workers-0").job_id == job  # held while it waits
    assert c.node("workers-1").job_id is None
    assert c.decisions(job) == [
        ("wait", "waiting for a healthy node to replace workers-1 (gpu_fault)", ["workers-0"])
    ]
    # Waiting is quiet: stepping decides again, but records nothing new.
    events = len(c.controller.event_infos())
    c.tick(5)
    c.tick(5)
    assert len(c.controller.event_infos()) == events
    assert c.job(job).state == "recovering"
    assert c.agents["workers-0"].beat().launch == []

    # An operator brings the faulty node back: it is deep-checked and, healthy, rejoins.
    c.controller.node_action("workers-1", NodeAction(action="resume", reason="GPU reseated"))
    assert c.node("workers-1").state == "repairing"
    agent = c.agents["workers-1"]
    agent.set_health("gpu", "ok", "")
    agent.beat()
    agent.deep_check_result(None, "ok")
    agent.beat()
    assert c.node("workers-1").state == "idle"
    c.controller.step()
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[1].nodes == ["workers-0", "workers-1"]
    assert c.decisions(job)[-1][0] == "restart"
    c.start(job)
    c.finish(job)
    assert c.job(job).state == "completed"


def test_a_waiting_job_takes_a_spare_once_it_is_repaired(make: Make) -> None:
    c = make()
    c.controller.node_action("spares-0", NodeAction(action="quarantine", reason="flaky NIC"))
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    assert c.job(job).state == "recovering"
    c.controller.node_action("spares-0", NodeAction(action="resume", reason="NIC replaced"))
    spare = c.agents["spares-0"]
    spare.beat()
    spare.deep_check_result(None, "ok")
    spare.beat()
    c.controller.step()
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]


def test_with_min_nodes_the_job_shrinks_at_once(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True, min_nodes=1)
    _wait_for_a_node(c, job)
    info = c.job(job)
    assert info.state == "starting"
    two = info.attempts[1]
    assert two.nodes == ["workers-0"]
    assert [r.rank for r in two.ranks] == [0, 1]
    (decision,) = c.events("recovery_decision", job_id=job)
    assert decision.data["shrunk"] is True
    assert decision.data["reason"] == "continuing on 1 of 2 nodes (min_nodes 1) after gpu_fault"
    (launch,) = c.agents["workers-0"].beat().launch
    assert (launch.env["WORLD_SIZE"], launch.env["TRAINPOD_NNODES"]) == ("2", "1")


def test_cancel_while_waiting_cancels_and_releases(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    assert c.job(job).state == "recovering"
    row = c.controller.cancel(job)
    assert (row.state, row.reason) == ("cancelled", "cancelled while recovering")
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined"}
    assert {c.node(n).job_id for n in c.node_states()} == {None}
    c.tick(1)
    assert c.job(job).state == "cancelled"
    assert len(c.job(job).attempts) == 1


def test_cancel_during_a_fault_s_teardown_does_not_restart(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.agents["workers-1"].set_health("gpu", "fault", "XID 79")
    c.agents["workers-1"].beat()
    assert c.controller.cancel(job).state == "stopping"
    c.teardown(job)
    info = c.job(job)
    assert (info.state, len(info.attempts)) == ("cancelled", 1)
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined", "spares-0": "idle"}
    assert {c.node(n).job_id for n in c.node_states()} == {None}
    assert not c.events("recovery_decision", job_id=job)


# -- stragglers ---------------------------------------------------------------------------
def test_a_persistent_straggler_is_flagged_and_replaced_by_the_spare(make: Make) -> None:
    c = make(straggler_checks=3)
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(2):
        c.report(job, step, r3=3.0)
        c.tick(1)
    assert not c.events("straggler_detected")
    c.report(job, 2, r3=3.0)
    c.tick(1)
    (flag,) = c.events("straggler_detected", job_id=job)
    assert (flag.node, flag.attempt, flag.data["rank"], flag.data["step_time_s"]) == (
        "workers-1",
        1,
        3,
        3.0,
    )
    node = c.node("workers-1")
    assert node.state == "quarantined"
    assert node.reason == "straggler: rank 3 is persistently slower than its peers"
    info = c.job(job)
    assert (info.state, info.attempts[0].cause) == ("stopping", "straggler")
    c.teardown(job)
    info = c.job(job)
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    assert c.decisions(job)[0][1] == "replaced workers-1 -> spares-0 after straggler"
    c.start(job)
    c.report(job, 3)  # the old attempt's book is gone; nothing is flagged twice
    c.tick(1)
    assert len(c.events("straggler_detected")) == 1


def test_a_straggler_must_be_slow_in_consecutive_fresh_reports(make: Make) -> None:
    c = make(straggler_checks=3)
    job = c.submit(auto_resume=True)
    c.start(job)
    c.report(job, 0, r3=3.0)
    c.tick(1)
    c.report(job, 1, r3=3.0)
    c.tick(1)
    for _ in range(3):  # stale reports (no new beat) are not evaluated again
        c.controller.step()
    c.report(job, 2, r3=1.0)  # caught up: the streak resets
    c.tick(1)
    c.report(job, 3, r3=3.0)
    c.tick(1)
    c.report(job, 4, r3=3.0)
    c.tick(1)
    assert not c.events("straggler_detected")
    assert c.job(job).state == "running"


def test_a_straggler_without_a_spare_is_only_flagged(make: Make) -> None:
    c = make(groups=[WORKERS], straggler_checks=2)
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(3):
        c.report(job, step, r0=3.0)
        c.tick(1)
    assert [e.data["rank"] for e in c.events("straggler_detected", job_id=job)] == [0]
    assert c.node("workers-0").state == "allocated"
    assert c.job(job).state == "running"


def test_a_straggler_is_not_replaced_by_a_spare_of_another_partition(make: Make) -> None:
    c = make(
        groups=[WORKERS, FakeGroup("other", 1, spare=True)],
        partitions={"main": ["workers"], "side": ["other"]},
        straggler_checks=2,
    )
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(3):
        c.report(job, step, r2=3.0)
        c.tick(1)
    assert len(c.events("straggler_detected", job_id=job)) == 1
    assert c.node("workers-1").state == "allocated"  # nothing could take its place
    assert c.job(job).state == "running"


def test_without_auto_resume_a_straggler_is_only_flagged(make: Make) -> None:
    c = make(straggler_checks=2)
    job = c.submit()
    c.start(job)
    for step in range(3):
        c.report(job, step, r1=3.0)
        c.tick(1)
    assert len(c.events("straggler_detected", job_id=job)) == 1
    assert c.job(job).state == "running"
    assert c.node("spares-0").state == "idle"


def test_an_attempt_shows_the_fault_it_ended_of_once_classified(make: Make) -> None:
    """Detected as a crash, classified a GPU fault: both are on the attempt, one each."""
    c = make(max_restarts=1)
    job = c.submit(auto_resume=True)
    first = c.start(job)
    a1 = c.agents["workers-1"]
    a1.exit_rank(first, 3, signal=9)
    a1.set_health("gpu", "fault", "XID 79")
    a1.beat()
    c.teardown(job)
    one = c.job(job).attempts[0]
    assert (one.state, one.cause, one.fault) == ("failed", "crash", "gpu_fault")
    (classified,) = c.events("fault_classified", job_id=job)
    assert (classified.data["was"], classified.data["fault"]) == ("crash", "gpu_fault")
    c.start(job)
    c.crash(job, rank=0)
    two = c.job(job).attempts[1]
    assert (two.cause, two.fault) == ("crash", "crash")  # nothing to reclassify
