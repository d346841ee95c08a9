"""The controller's in-process rung (ADR 0026), stepped with fake agents and a fake clock.

A job with ``recovery: in-process`` keeps its attempt when a rank fails on a healthy node:
the controller orders a new generation of the group, the failed rank runs again in the
same attempt, and anything that goes wrong on the way falls back to a full restart.
"""

from __future__ import annotations

from typing import Any

from trainpod.testing import FakeGroup

from .conftest import PORT
from .healing import HealingCluster, Make

KILLED = 9


def _opted_in(c: HealingCluster, **kw: Any) -> tuple[int, int]:
    job = c.submit(auto_resume=True, recovery="in-process", **kw)
    attempt = c.start(job)
    c.tick(30)
    return job, attempt


def _joined(c: HealingCluster, attempt: int, generation: int, *, skip: int | None = None) -> None:
    """Every rank (but ``skip``) beacons that it joined ``generation``, as elastic.run does."""
    for agent in c.agents.values():
        ranks = [r for r in agent.running_ranks(attempt) if r != skip]
        for r in ranks:
            agent.progress(attempt, r, 10, generation=generation)
        if ranks:
            agent.beat()


def _pids(c: HealingCluster, job: int) -> dict[int, int | None]:
    return {r.rank: r.pid for r in c.job(job).attempts[-1].ranks}


def test_a_killed_rank_runs_again_in_the_same_attempt(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    before = _pids(c, job)
    killed_at = c.clock.now()
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("running", "running")
    (started,) = c.events("in_process_recovery_started", job_id=job)
    assert (started.node, started.data["generation"], started.data["rank"]) == ("workers-1", 1, 3)
    assert started.data["replaced"] == [3]
    assert started.data["master_port"] == PORT + 1  # a fresh store, never the attempt's
    assert started.data["reason"] == "rank 3 on workers-1 was killed by signal 9"

    # every node of the attempt is told; only workers-1 starts a rank again
    (r0,) = a0.beat().recover
    orders = a1.beat()
    (r1,) = orders.recover
    assert (r0.generation, r0.master_port, r0.world_size, r0.replaced) == (1, PORT + 1, 4, [3])
    assert (r0.respawn, r1.respawn) == ([], [3])
    assert orders.launch == [] and orders.kill == []
    c.clock.advance(4)
    assert a1.recover_ranks(orders) == [3]
    a1.beat()

    after = _pids(c, job)
    assert after[3] != before[3] and {r: after[r] for r in (0, 1, 2)} == {
        r: before[r] for r in (0, 1, 2)
    }
    info = c.job(job)
    assert [r.state for r in info.attempts[0].ranks] == ["running"] * 4
    # running again is not done: done is every rank's beacon of the new generation
    assert c.events("in_process_recovery_done", job_id=job) == []
    assert (info.attempts[0].generation, info.attempts[0].generation_confirmed) == (1, False)
    _joined(c, attempt, 1, skip=0)
    assert c.events("in_process_recovery_done", job_id=job) == []
    c.clock.advance(1)
    _joined(c, attempt, 1)
    info = c.job(job)
    assert (info.attempts[0].generation, info.attempts[0].generation_confirmed) == (1, True)
    (done,) = c.events("in_process_recovery_done", job_id=job)
    assert (done.data["generation"], done.data["rank"]) == (1, 3)
    assert done.data["duration_s"] == c.clock.now() - killed_at
    assert c.events("fault_detected", job_id=job) == []
    assert c.decisions(job) == []
    assert a1.recover_ranks(a1.beat()) == []  # a generation is acted on once

    c.finish(job)
    info = c.job(job)
    assert info.state == "completed" and len(info.attempts) == 1


def test_a_second_fault_during_the_recovery_falls_back_to_a_full_restart(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    c.clock.advance(1)
    a0.exit_rank(attempt, 1, code=1)  # before rank 3 runs again
    a0.beat()
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["generation"] == 1
    assert gave_up.data["reason"] == (
        "a second fault while generation 1 was being formed: rank 1 on workers-0 exited with code 1"
    )
    info = c.job(job)
    assert (info.attempts[0].state, info.attempts[0].cause) == ("stopping", "crash")
    assert info.attempts[0].failure["rank"] == 3  # the first fault is the attempt's
    assert a1.recover_ranks(a1.beat()) == []  # a stopping attempt is not recovered
    c.teardown(job)
    info = c.job(job)
    assert [a.number for a in info.attempts] == [1, 2]
    assert c.decisions(job) == [("restart", "restart after crash", ["workers-0", "workers-1"])]
    assert c.events("in_process_recovery_done", job_id=job) == []


def test_a_rank_that_could_not_rejoin_falls_back_to_a_full_restart(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 2, code=75, tail="gave generation 1 up: no message in 60 s")
    a1.beat()
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["generation"] == 0  # none was tried
    assert gave_up.data["reason"] == (
        "rank 2 on workers-1 exited with code 75 (75: it could not re-join its group); "
        "it said: gave generation 1 up: no message in 60 s"
    )
    assert c.events("in_process_recovery_started", job_id=job) == []
    assert c.job(job).attempts[0].state == "stopping"


def test_a_rank_not_running_again_by_the_deadline_falls_back(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    c.tick(c.cfg.in_process_deadline_s - 1)  # the order is there, nobody obeys it
    assert c.job(job).attempts[0].state == "running"
    c.tick(2)
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["reason"] == "generation 1: rank 3 not running again within 60 s"
    info = c.job(job)
    assert (info.attempts[0].state, info.attempts[0].cause) == ("stopping", "crash")
    c.teardown(job)
    assert [a.number for a in c.job(job).attempts] == [1, 2]


def test_a_quarantined_node_during_the_recovery_falls_back(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    a1.set_health("gpu", "fault", "XID 79")
    a1.beat()
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["generation"] == 1
    assert gave_up.data["reason"].startswith("gpu_fault: workers-1: gpu: XID 79")
    assert c.job(job).attempts[0].state == "stopping"


def test_in_process_recoveries_count_against_max_restarts(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c, max_restarts=1)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.recover_ranks(a1.beat())
    a1.beat()
    _joined(c, attempt, 1)
    assert len(c.events("in_process_recovery_done", job_id=job)) == 1
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["reason"].endswith("no restarts left (max_restarts)")
    c.teardown(job)
    info = c.job(job)
    assert info.state == "failed" and "gave up after 1 restarts" in info.reason


def test_a_cancel_during_the_recovery_stops_it_without_a_fallback(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.beat()
    c.controller.cancel(job)
    c.teardown(job)
    c.tick(c.cfg.in_process_deadline_s + 1)
    info = c.job(job)
    assert (info.state, len(info.attempts)) == ("cancelled", 1)
    assert c.events("in_process_recovery_abandoned", job_id=job) == []
    assert a1.recover_ranks(a1.beat()) == []


# -- a lost node: its ranks start on the spare in the same attempt (ADR 0035) --------------
def test_a_lost_node_ranks_start_on_the_spare_in_the_same_attempt(make: Make) -> None:
    c = make()
    job, attempt = _opted_in(c)
    before = _pids(c, job)
    c.tick(c.cfg.heartbeat_timeout_s + 1, "workers-0", "spares-0")  # workers-1 is silent
    info = c.job(job)
    (same,) = info.attempts
    assert (info.state, same.state, same.nodes) == ("running", "running", ["workers-0", "spares-0"])
    (started,) = c.events("in_process_recovery_started", job_id=job)
    assert (started.data["replaced"], started.data["moved"]) == ([2, 3], {"workers-1": "spares-0"})
    assert c.node("spares-0").state == "allocated" and c.node("workers-1").state == "quarantined"
    assert c.events("fault_detected", job_id=job) == [] and c.decisions(job) == []

    # the spare launches the lost node's ranks into generation 1, on the new store
    spare = c.agents["spares-0"]
    orders = spare.beat()
    (launch,) = orders.launch
    assert [s.rank for s in launch.ranks] == [2, 3]
    env = launch.env
    assert (env["MASTER_PORT"], env["TRAINPOD_RECOVER_GENERATION"]) == (str(PORT + 1), "1")
    assert env["TRAINPOD_NODES"] == "workers-0,spares-0" and env["GROUP_RANK"] == "1"
    (rec,) = c.agents["workers-0"].beat().recover  # the healthy node re-forms the group
    assert (rec.generation, rec.replaced, rec.respawn) == (1, [2, 3], [])
    assert spare.start_ranks(orders) == [2, 3]
    spare.beat()
    _joined(c, attempt, 1)
    (done,) = c.events("in_process_recovery_done", job_id=job)
    assert done.data["generation"] == 1
    after = _pids(c, job)
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    assert {r.rank: r.node for r in c.job(job).attempts[0].ranks} == {
        0: "workers-0",
        1: "workers-0",
        2: "spares-0",
        3: "spares-0",
    }
    c.finish(job)
    info = c.job(job)
    assert info.state == "completed" and len(info.attempts) == 1


def test_a_node_quarantined_while_its_agent_lives_is_replaced_in_the_same_attempt(
    make: Make,
) -> None:
    """A GPU fault on a live node: its ranks are killed there and start on the spare in
    the same attempt, like a lost node's; the healthy node's ranks keep running."""
    c = make()
    job, attempt = _opted_in(c)
    before = _pids(c, job)
    a1 = c.agents["workers-1"]
    a1.set_health("gpu", "fault", "XID 79")
    orders = a1.beat()
    info = c.job(job)
    (same,) = info.attempts
    assert (info.state, same.state, same.nodes) == ("running", "running", ["workers-0", "spares-0"])
    assert c.node("workers-1").state == "quarantined" and c.node("spares-0").state == "allocated"
    (started,) = c.events("in_process_recovery_started", job_id=job)
    assert (started.data["replaced"], started.data["moved"]) == ([2, 3], {"workers-1": "spares-0"})
    lost = c.events("rank_lost", job_id=job)
    assert [e.data["rank"] for e in lost] == [2, 3]
    assert lost[0].data["reason"] == "node taken out: gpu: XID 79"
    assert c.decisions(job) == []
    # the quarantined node's agent is told to kill its ranks of the attempt at once
    (kill,) = orders.kill
    assert (kill.attempt_id, kill.grace_s) == (attempt, 0.0)
    assert sorted(a1.kill_ranks(orders)) == [2, 3]
    a1.beat()
    spare = c.agents["spares-0"]
    launch = spare.beat()
    assert [s.rank for s in launch.launch[0].ranks] == [2, 3]
    spare.start_ranks(launch)
    spare.beat()
    c.agents["workers-0"].recover_ranks(c.agents["workers-0"].beat())
    _joined(c, attempt, 1)
    assert c.events("in_process_recovery_done", job_id=job)
    after = _pids(c, job)
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    c.finish(job)
    info = c.job(job)
    assert info.state == "completed" and len(info.attempts) == 1


def test_a_quarantined_node_without_a_free_node_stops_the_attempt_with_its_fault(
    make: Make,
) -> None:
    c = make(groups=(FakeGroup("workers", 2),))
    job, _ = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.set_health("gpu", "fault", "XID 79")
    a1.beat()
    one = c.job(job).attempts[0]
    assert (one.state, one.cause) == ("stopping", "gpu_fault")
    assert c.events("rank_lost", job_id=job) == []


def test_a_lost_node_without_a_free_node_falls_back(make: Make) -> None:
    c = make(groups=(FakeGroup("workers", 2),))
    job, _ = _opted_in(c)
    c.tick(c.cfg.heartbeat_timeout_s + 1, "workers-0")
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert gave_up.data["reason"] == (
        "rank 2 on workers-1 was lost with its node: no free node to start its ranks on in process"
    )
    assert c.job(job).attempts[0].state == "stopping"


def test_a_group_being_formed_is_not_taken_for_a_hang(make: Make) -> None:
    c = make(hang_timeout_s=3.0)
    job, attempt = _opted_in(c)
    c.report(job, 1)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.recover_ranks(a1.beat())
    c.tick(5)  # no rank steps while the replacement joins: longer than hang_timeout_s
    assert c.job(job).attempts[0].state == "running"
    assert c.events("fault_detected", job_id=job) == []
    _joined(c, attempt, 1)
    c.tick(5)  # once every rank joined, silence is a hang again
    assert c.job(job).attempts[0].cause == "hang"


def test_a_beacon_read_before_the_new_process_report_does_not_lose_the_rank(make: Make) -> None:
    # One heartbeat carries the replacement's beacon of generation 1 and the report of its
    # new process; beacons are read first. The rank must still be recorded as running.
    c = make()
    job, attempt = _opted_in(c)
    a1 = c.agents["workers-1"]
    a1.exit_rank(attempt, 3, signal=KILLED)
    a1.recover_ranks(a1.beat())
    for agent in c.agents.values():
        for r in agent.running_ranks(attempt):
            agent.progress(attempt, r, 10, generation=1)
    c.agents["workers-0"].beat()
    a1.beat()  # rank 3's beacon and its new process, together
    info = c.job(job)
    assert [r.state for r in info.attempts[0].ranks] == ["running"] * 4
    assert len(c.events("in_process_recovery_done", job_id=job)) == 1
    assert info.attempts[0].generation_confirmed


def _lost(c: HealingCluster, attempt: int, ranks: dict[int, str], generation: int = 0) -> None:
    """``ranks`` (rank -> node) say they lost ``generation``'s group, as elastic.run does
    once a collective fails or times out."""
    for r, node in ranks.items():
        c.agents[node].progress(attempt, r, 10, lost_generation=generation)


def test_a_stuck_rank_is_replaced_once_its_peers_say_they_lost_their_group(make: Make) -> None:
    c = make()  # the default hang timeout (minutes): the peers' word is what starts it
    job, attempt = _opted_in(c)
    for agent in c.agents.values():
        for r in agent.running_ranks(attempt):
            agent.progress(attempt, r, 10, generation=0, collective_timeout_s=2.0)
    c.tick(2.5)  # rank 3 is stuck (alive, silent); the others' collective times out
    _lost(c, attempt, {0: "workers-0", 1: "workers-0", 2: "workers-1"})
    c.tick(0.1)
    assert c.events("in_process_recovery_started", job_id=job) == []  # the others may follow
    c.tick(c.cfg.heartbeat_interval_s + 1)
    (started,) = c.events("in_process_recovery_started", job_id=job)
    assert (started.data["generation"], started.data["rank"], started.data["replaced"]) == (
        1,
        3,
        [3],
    )
    assert "rank 3 stayed silent while the others lost their group" in started.data["reason"]
    a1 = c.agents["workers-1"]
    orders = a1.beat()
    (rec,) = orders.recover
    assert rec.respawn == [3]  # its agent kills the stuck process and starts it again
    old = a1.pid(attempt, 3)
    a1.set_pid(attempt, 3, old + 1000)  # the new process, reported while its row ran
    a1.beat()
    assert _pids(c, job)[3] == old + 1000
    _joined(c, attempt, 1)
    (done,) = c.events("in_process_recovery_done", job_id=job)
    assert done.data["generation"] == 1 and done.data["duration_s"] > 2.5
    c.finish(job)
    info = c.job(job)
    assert info.state == "completed" and len(info.attempts) == 1


def test_silent_ranks_on_a_node_gone_quiet_move_to_the_spare_not_restart_in_place(
    make: Make,
) -> None:
    """workers-1 died with its ranks: the others lost their group at once. Its ranks are not
    replaced in place (a recover order to a dead agent); the liveness watchdog declares the
    node lost and they move to the spare."""
    c = make()
    job, attempt = _opted_in(c)
    _lost(c, attempt, {0: "workers-0", 1: "workers-0"})
    c.tick(c.cfg.heartbeat_interval_s + 1, "workers-0", "spares-0")
    assert c.events("in_process_recovery_started", job_id=job) == []
    c.tick(c.cfg.heartbeat_timeout_s + 1, "workers-0", "spares-0")
    (started,) = c.events("in_process_recovery_started", job_id=job)
    assert (started.data["replaced"], started.data["moved"]) == ([2, 3], {"workers-1": "spares-0"})


def test_without_a_collective_timeout_a_hang_restarts_the_job_as_before(make: Make) -> None:
    c = make(hang_timeout_s=3.0)
    job, _ = _opted_in(c)
    c.report(job, 1)
    c.tick(5)
    info = c.job(job)
    assert info.attempts[0].cause == "hang"
    (gave_up,) = c.events("in_process_recovery_abandoned", job_id=job)
    assert "report no collective timeout" in gave_up.data["reason"]
