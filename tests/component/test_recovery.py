"""Faults the controller must survive: lost nodes, restarted agents, its own restart."""

from __future__ import annotations

from .conftest import Cluster


def test_a_silent_node_loses_its_ranks_and_fails_the_job_with_node_lost(
    cluster: Cluster,
) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    attempt_id = c.start(job)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]

    c.clock.advance(c.cfg.heartbeat_timeout_s + 1)
    a1.beat()  # workers-1 is alive; workers-0 has gone silent
    c.controller.step()
    assert c.node("workers-0").state == "quarantined"
    assert c.node("workers-0").reason == "node lost: no heartbeat for 11.0s"
    info = c.job(job)
    attempt = info.attempts[0]
    assert [r.state for r in attempt.ranks] == ["lost", "lost", "running", "running"]
    assert (attempt.state, attempt.cause) == ("stopping", "node_lost")
    assert attempt.failure["lost"] is True and attempt.failure["node"] == "workers-0"
    assert info.state == "stopping"
    lost = c.events("rank_lost", job_id=job)
    assert [(e.node, e.data["reason"]) for e in lost] == [("workers-0", "node heartbeat lost")] * 2

    orders = a1.beat()
    assert [k.attempt_id for k in orders.kill] == [attempt_id]
    a1.kill_ranks(orders)
    a1.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "failed",
        "failed",
        "node_lost",
    )
    assert info.reason.startswith("rank 0 on workers-0 was lost with its node")
    assert "--auto-resume" in info.reason  # the job did not ask to be recovered
    assert c.node_states() == {"workers-0": "quarantined", "workers-1": "idle"}
    assert c.node("workers-0").job_id is None

    # The node comes back: its agent still runs the lost ranks and is told to kill them.
    orders = a0.beat()
    assert c.node("workers-0").state == "quarantined"  # held until repaired
    assert [(k.attempt_id, k.reason) for k in orders.kill] == [(attempt_id, "attempt ended")]
    a0.kill_ranks(orders)
    assert a0.beat().kill == []
    assert c.job(job).state == "failed"


def test_every_node_silent_fails_the_job_in_one_step(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.start(job)
    c.clock.advance(c.cfg.heartbeat_timeout_s + 1)
    c.controller.step()
    info = c.job(job)
    assert (info.state, info.attempts[0].cause) == ("failed", "node_lost")
    assert set(c.node_states().values()) == {"quarantined"}
    assert {c.node(n).job_id for n in ("workers-0", "workers-1")} == {None}


def test_a_controller_restart_loses_nothing(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    attempt_id = c.start(job)
    before = c.controller.event_infos()
    ids = {name: a.agent_id for name, a in c.agents.items()}

    # The controller dies; meanwhile every rank finishes and nobody can report it.
    c.clock.advance(30)
    for agent in c.agents.values():
        agent.exit_all(attempt_id)
    c.clock.advance(30)
    restarted = c.restart_controller()
    assert restarted.job_info(job).state == "running"
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "allocated"}

    # Heartbeats were refreshed on start-up: a step now must not find anyone silent.
    c.controller.step()
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "allocated"}

    for name, agent in c.agents.items():
        assert agent.agent_id == ids[name]
        agent.beat()  # the same agent re-registers and reports the exits it held
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("completed", "succeeded")
    assert set(c.node_states().values()) == {"idle"}

    after = c.controller.event_infos()
    assert after[: len(before)] == before  # every event from before, unchanged
    ids_after = [e.id for e in after]
    assert ids_after == sorted(set(ids_after))  # strictly increasing
    new = [e.kind for e in after[len(before) :]]
    assert new[0] == "controller_started"
    assert after[len(before)].data == {"restarted": True}
    assert new.count("agent_reconnected") == 2
    assert "agent_registered" not in new
    assert new.count("rank_exited") == 4
    assert c.events("job_state", job_id=job)[-1].data["new"] == "completed"


def test_a_controller_restart_while_a_job_is_queued_still_places_it(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=1)
    c.restart_controller()
    c.up()
    c.controller.step()
    assert c.job(job).state == "starting"
    orders = c.beat()
    assert all(len(o.launch) == 1 for o in orders.values())


def test_a_controller_restart_keeps_launch_orders_identical(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.controller.step()
    first = c.agents["workers-0"].beat()
    c.restart_controller()
    again = c.agents["workers-0"].beat()
    assert again.hash == first.hash  # an agent waiting on its hash is not disturbed
    assert again.launch[0].attempt_id == c.attempt_id(job)


def test_ranks_an_agent_forgot_without_reporting_their_exit_are_lost(cluster: Cluster) -> None:
    """An agent that keeps beating but has forgotten an attempt whose ranks the controller
    holds live (their exits never arrived) says so: the ranks are lost, the attempt stops,
    instead of staying launching for good."""
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.start(job)
    a0 = c.agents["workers-0"]
    attempt_id = c.attempt_id(job)
    stale = a0.heartbeat()  # read before it forgot: lists the attempt, running
    a0.forget(attempt_id)
    forgot = a0.heartbeat()
    assert forgot.attempts == [] and forgot.forgotten == [attempt_id]
    c.controller.heartbeat(stale)  # a late beat from before changes nothing
    assert [r.state for r in c.job(job).attempts[0].ranks] == ["running"] * 4
    a0.beat()
    info = c.job(job)
    attempt = info.attempts[0]
    assert [r.state for r in attempt.ranks] == ["lost", "lost", "running", "running"]
    assert (attempt.state, attempt.cause) == ("stopping", "node_lost")
    lost = c.events("rank_lost", job_id=job)
    assert {e.data["reason"] for e in lost} == {
        "its agent no longer reports it (forgotten before its exit was heard)"
    }
    a0.beat()  # listed again: nothing more is lost
    assert len(c.events("rank_lost", job_id=job)) == 2


def test_an_attempt_forgotten_after_its_exits_were_heard_loses_nothing(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=1)
    c.start(job)
    attempt_id = c.attempt_id(job)
    for agent in c.agents.values():
        agent.exit_all(attempt_id)
        agent.beat()  # the exit is heard, then forgotten
        assert agent.heartbeat().forgotten == [attempt_id]
        agent.beat()
    assert c.events("rank_lost", job_id=job) == []
    c.controller.step()
    assert c.job(job).state == "completed"


def test_a_restarted_agent_without_ranks_loses_them(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.start(job)
    new = c.agents["workers-0"].restarted()
    orders = new.beat()
    info = c.job(job)
    attempt = info.attempts[0]
    assert [r.state for r in attempt.ranks] == ["lost", "lost", "running", "running"]
    assert (attempt.state, attempt.cause) == ("stopping", "node_lost")
    assert info.state == "stopping"
    reasons = {e.data["reason"] for e in c.events("rank_lost", job_id=job)}
    assert reasons == {"agent restarted"}
    registered = c.events("agent_registered", node="workers-0")
    assert registered[-1].data["restarted"] is True
    assert orders.launch == []  # the lost ranks are never launched again in this attempt

    a1 = c.agents["workers-1"]
    a1.kill_ranks(a1.beat())
    a1.beat()
    assert (c.job(job).state, c.job(job).attempts[0].cause) == ("failed", "node_lost")
    assert c.node_states() == {"workers-0": "idle", "workers-1": "idle"}


def test_an_agent_restarting_on_an_allocated_node_while_its_setup_reruns(
    cluster: Cluster,
) -> None:
    """The first beat of a new agent reports its lifecycle as running: no refusal."""
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.start(job)
    new = c.agents["workers-0"].restarted()
    new.beat(lifecycle="running")
    assert c.node("workers-0").state == "setting_up"
    assert c.job(job).state == "stopping"
    new.beat()  # setup done while the job still holds the node
    assert c.node("workers-0").state == "allocated"

    a1 = c.agents["workers-1"]
    a1.kill_ranks(a1.beat())
    a1.beat()
    assert c.job(job).state == "failed"
    assert c.node_states() == {"workers-0": "idle", "workers-1": "idle"}


def test_an_agent_restarting_on_an_allocated_node_whose_setup_fails(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.start(job)
    new = c.agents["workers-0"].restarted()
    new.beat(lifecycle="failed")
    assert c.node("workers-0").state == "failed"
    a1 = c.agents["workers-1"]
    a1.kill_ranks(a1.beat())
    a1.beat()
    assert c.job(job).state == "failed"
    assert c.node_states() == {"workers-0": "failed", "workers-1": "idle"}
    assert c.node("workers-0").job_id is None
    again = c.submit(nodes=1, procs=1)
    c.controller.step()
    assert c.job(again).attempts[0].nodes == ["workers-1"]
