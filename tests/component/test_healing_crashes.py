"""Self-healing of crashes and hangs, and robustness of the progress bookkeeping.

A real :class:`Controller` on real SQLite, a fake clock and fake agents, stepped by hand;
each test checks states and the story the events tell.
"""

from __future__ import annotations

from .conftest import PORT
from .healing import TAIL, Make


# -- crashes ------------------------------------------------------------------------------
def test_a_crash_restarts_the_job_on_the_same_nodes(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    assert c.job(job).attempts[0].master_port == PORT
    c.tick(30)
    crashed_at = c.clock.now()
    a1 = c.agents["workers-1"]
    a1.exit_rank(first, 3, code=1, tail=TAIL)
    a1.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "crash",
    )
    (fault,) = c.events("fault_detected", job_id=job)  # seen at once, not after teardown
    assert (fault.attempt, fault.node, fault.data["fault"], fault.data["rank"]) == (
        1,
        "workers-1",
        "crash",
        3,
    )
    assert fault.data["fault_at"] == crashed_at
    assert fault.data["reason"] == "rank 3 on workers-1 exited with code 1"

    c.clock.advance(2)
    c.teardown(job)
    info = c.job(job)
    assert info.state == "starting"
    one, two = info.attempts
    assert (one.state, one.cause) == ("failed", "crash")
    assert (two.number, two.state, two.nodes) == (2, "launching", ["workers-0", "workers-1"])
    assert two.master_port == PORT + 1  # never the old rendezvous port
    assert c.node_states() == {
        "workers-0": "allocated",
        "workers-1": "allocated",
        "spares-0": "idle",
    }
    assert c.decisions(job) == [
        ("restart", "restart after crash", ["workers-0", "workers-1"]),
    ]
    (decision,) = c.events("recovery_decision", job_id=job)
    assert (decision.attempt, decision.data["counts"], decision.data["replaced"]) == (1, True, {})
    created = c.events("attempt_created", job_id=job)
    assert [e.data["restart_reason"] for e in created] == [
        "",
        "crash: rank 3 on workers-1 exited with code 1",
    ]
    assert c.job_moves(job) == [
        "queued",
        "starting",
        "running",
        "stopping",
        "recovering",
        "starting",
    ]
    assert c.story(job, ["fault_detected", "recovery_decision", "attempt_created"]) == [
        ("attempt_created", 1),
        ("fault_detected", 1),
        ("recovery_decision", 1),
        ("attempt_created", 2),
    ]
    assert not c.events("node_released", job_id=job)  # the job kept its nodes throughout

    orders = c.agents["workers-0"].beat()
    (launch,) = orders.launch
    assert launch.attempt_number == 2
    env = launch.env
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert env["TRAINPOD_ATTEMPT"] == "2"
    assert env["TRAINPOD_RESTART_REASON"] == "crash: rank 3 on workers-1 exited with code 1"
    assert env["MASTER_PORT"] == str(PORT + 1)

    second = c.start(job)
    assert c.job(job).state == "running"
    c.finish(job)
    info = c.job(job)
    assert (info.state, [a.state for a in info.attempts]) == ("completed", ["failed", "succeeded"])
    assert second != first
    assert set(c.node_states().values()) == {"idle"}


def test_the_same_crash_twice_is_a_user_error(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.crash(job, rank=3)
    c.start(job)
    c.crash(job, rank=1)  # another rank, the same ending: the job's own bug
    info = c.job(job)
    assert info.state == "failed"
    assert info.reason.startswith("user error: the same failure twice on healthy nodes")
    assert info.reason.endswith(TAIL)  # with the log tail
    assert [a.state for a in info.attempts] == ["failed", "failed"]
    assert c.decisions(job)[-1][0] == "fail"
    assert set(c.node_states().values()) == {"idle"}
    assert {c.node(n).job_id for n in c.node_states()} == {None}


def test_a_different_second_crash_gets_a_third_attempt(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.crash(job, rank=3)
    c.start(job)
    c.crash(job, rank=0, code=2, tail="RuntimeError: NCCL timeout")
    info = c.job(job)
    assert info.state == "starting"
    assert [a.number for a in info.attempts] == [1, 2, 3]
    assert [d[0] for d in c.decisions(job)] == ["restart", "restart"]
    created = c.events("attempt_created", job_id=job, attempt=3)
    assert created[0].data["restart_reason"] == "crash: rank 0 on workers-0 exited with code 2"
    assert info.attempts[2].master_port == PORT + 2


def test_max_restarts_is_honoured(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True, max_restarts=1)
    c.start(job)
    c.crash(job, rank=3)
    c.start(job)
    c.crash(job, rank=0, code=2, tail="RuntimeError: other")
    info = c.job(job)
    assert info.state == "failed"
    assert "gave up after 1 restarts (max_restarts)" in info.reason
    assert len(info.attempts) == 2
    assert set(c.node_states().values()) == {"idle"}


def test_max_restarts_defaults_to_the_cluster_s(make: Make) -> None:
    c = make(max_restarts=0)
    job = c.submit(auto_resume=True)
    c.start(job)
    c.crash(job, rank=3)
    info = c.job(job)
    assert info.state == "failed"
    assert "gave up after 0 restarts" in info.reason


def test_without_auto_resume_a_crash_fails_naming_the_flag(make: Make) -> None:
    c = make()
    job = c.submit()
    c.start(job)
    c.crash(job, rank=3)
    info = c.job(job)
    assert info.state == "failed"
    assert "--auto-resume" in info.reason and TAIL in info.reason
    assert c.decisions(job)[0][0] == "fail"


# -- hangs --------------------------------------------------------------------------------
def test_a_job_that_stops_beaconing_is_hung_and_restarted_on_the_same_nodes(make: Make) -> None:
    c = make(hang_timeout_s=30)
    job = c.submit(auto_resume=True)
    first = c.start(job)
    for step in range(5):
        c.report(job, step)
        c.tick(5)
    last = c.clock.now() - 5  # the last beacon
    for _ in range(5):
        c.tick(5)
        assert c.job(job).state == "running"
    c.tick(5)  # 35 s since the last beacon
    info = c.job(job)
    one = info.attempts[0]
    assert (info.state, one.state, one.cause) == ("stopping", "stopping", "hang")
    assert one.failure["reason"].startswith("rank 0 sent no progress beacon for 35.0s")
    assert one.failure["fault_at"] == last
    (fault,) = c.events("fault_detected", job_id=job)
    assert (fault.data["fault"], fault.data["fault_at"]) == ("hang", last)
    orders = c.agents["workers-0"].beat()
    assert [(k.attempt_id, k.reason) for k in orders.kill] == [(first, "hang")]
    c.teardown(job)
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[1].nodes == ["workers-0", "workers-1"]
    assert c.decisions(job) == [("restart", "restart after hang", ["workers-0", "workers-1"])]
    reason = c.events("attempt_created", job_id=job, attempt=2)[0].data["restart_reason"]
    assert reason.startswith("hang: rank 0 sent no progress beacon")
    # The new attempt starts with a clean book: no beacons yet, so it is not hung.
    c.start(job)
    c.tick(5)
    c.tick(5)
    assert c.job(job).state == "running"


def test_a_job_s_own_hang_timeout_wins(make: Make) -> None:
    c = make(hang_timeout_s=300)
    job = c.submit(auto_resume=True, hang_timeout_s=8)
    c.start(job)
    c.report(job, 1)
    c.tick(5)
    assert c.job(job).state == "running"
    c.tick(5)
    assert c.job(job).attempts[0].cause == "hang"


def test_a_job_without_beacons_is_never_hung(make: Make) -> None:
    c = make(hang_timeout_s=10)
    job = c.submit(auto_resume=True)
    c.start(job)
    for _ in range(20):
        c.tick(5)
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("running", "running")
    assert not c.events("fault_detected", job_id=job)


def test_the_startup_timeout_applies_before_the_first_beacon(make: Make) -> None:
    c = make(hang_timeout_s=10)
    job = c.submit(auto_resume=True, startup_timeout_s=60)
    c.start(job)
    started = c.job(job).attempts[0].started_at
    for _ in range(12):
        c.tick(5)
    assert c.job(job).state == "running"  # 60 s is not more than 60 s
    c.tick(5)
    one = c.job(job).attempts[0]
    assert (one.state, one.cause) == ("stopping", "hang")
    assert one.failure["reason"] == "no progress beacon within the startup timeout of 60s"
    assert one.failure["fault_at"] == started


def test_the_startup_timeout_no_longer_applies_once_beacons_flow(make: Make) -> None:
    c = make(hang_timeout_s=30)
    job = c.submit(auto_resume=True, startup_timeout_s=10)
    c.start(job)
    c.tick(5)
    for step in range(10):
        c.report(job, step)
        c.tick(5)
    assert c.job(job).state == "running"


# -- robustness -----------------------------------------------------------------------------
def test_ranks_that_finished_do_not_make_the_job_look_hung(make: Make) -> None:
    c = make(hang_timeout_s=30)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    c.report(job, 100)
    c.tick(1)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a1.exit_all(attempt_id)  # workers-1 is done; rank 0 uploads the final checkpoint
    a1.beat()
    for _ in range(10):
        a0.progress(attempt_id, 0, 100)
        a0.progress(attempt_id, 1, 100)
        c.tick(5)
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("running", "running")
    a0.exit_all(attempt_id)
    a0.beat()
    assert c.job(job).state == "completed"


def test_a_controller_restart_does_not_forget_that_beacons_flowed(make: Make) -> None:
    c = make(hang_timeout_s=30)
    job = c.submit(auto_resume=True, startup_timeout_s=60)
    c.start(job)
    for step in range(20):
        c.report(job, step)
        c.tick(5)
    c.restart_controller()
    c.controller.step()  # before any agent has reported again
    assert c.job(job).attempts[0].state == "running"
    c.report(job, 20)
    c.tick(5)
    assert c.job(job).state == "running"
    assert len(c.events("first_beacon", job_id=job)) == 1


def test_a_beacon_for_a_rank_the_attempt_does_not_have_is_ignored(make: Make) -> None:
    c = make(straggler_checks=2, hang_timeout_s=30)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    agent = c.agents["workers-0"]
    for step in range(3):
        c.report(job, step)
        hb = agent.heartbeat()
        good = hb.attempts[0].beacons[0]
        bogus = good.model_copy(update={"rank": 9, "step_time_s": 10.0})
        hb.attempts[0].beacons.append(bogus)
        c.clock.advance(1)
        c.controller.heartbeat(hb)
        c.agents["workers-1"].beat()
        c.controller.step()
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("running", "running")
    assert not c.events("straggler_detected")
    assert attempt_id == c.attempt_id(job)


def test_a_hang_of_rank_0_names_its_node(make: Make) -> None:
    c = make(hang_timeout_s=30)
    job = c.submit(auto_resume=True)
    c.start(job)
    c.report(job, 1)
    for _ in range(7):
        c.tick(5)
    one = c.job(job).attempts[0]
    assert one.cause == "hang"
    assert one.failure["reason"].startswith("rank 0 ")
    assert (one.failure["rank"], one.failure["node"], one.failure["nodes"]) == (
        0,
        "workers-0",
        ["workers-0"],
    )
    (fault,) = c.events("fault_detected", job_id=job)
    assert fault.node == "workers-0"
