"""A rank left running, idle, after every other rank exited 0 (ADR 0049).

``destroy_process_group`` may hang in a rank whose peer has already gone
(pytorch/pytorch#75097; CI saw an accelerate script's rank 1 sleep in a futex for minutes
after printing its final line, its peer gone with exit 0). The controller stops such a rank
once it has used no CPU for ``exit_wait_s`` after the last of its peers ended, and the
attempt counts as a success. A real controller on SQLite, a fake clock and fake agents.
"""

from __future__ import annotations

from .healing import HealingCluster, Make


def _finish_all_but_rank_3(c: HealingCluster, job: int, attempt_id: int) -> None:
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a0.exit_all(attempt_id)
    a1.exit_rank(attempt_id, 2, code=0)
    a0.beat()
    a1.beat()


def test_a_rank_idle_after_every_peer_exited_0_is_stopped_and_the_job_completes(
    make: Make,
) -> None:
    c = make(exit_wait_s=60)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    c.tick(30)
    _finish_all_but_rank_3(c, job, attempt_id)
    c.agents["workers-1"].set_idle(attempt_id, 3, True)
    c.tick(50)  # idle 50 s, its peers ended 50 s ago: it may still be finishing
    assert c.job(job).attempts[0].state == "running"
    c.tick(11)
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("stopping", "stopping")
    (idle,) = c.events("ranks_left_idle", job_id=job)
    assert (idle.data["ranks"], idle.data["nodes"], idle.data["waited_s"]) == (
        [3],
        ["workers-1"],
        60,
    )
    assert not c.events("fault_detected", job_id=job)  # its work was done: no fault
    c.teardown(job, ["workers-1"])  # SIGTERM ends it
    info = c.job(job)
    assert (info.state, len(info.attempts), info.attempts[0].state) == (
        "completed",
        1,
        "succeeded",
    )
    assert "rank 3 on workers-1 stayed running, idle" in (info.reason or "")
    assert (info.attempts[0].cause, info.attempts[0].fault) == ("left_idle", "")  # no fault
    assert not c.events("recovery_decision", job_id=job)


def test_a_rank_that_still_works_after_its_peers_exited_is_left_to_finish(make: Make) -> None:
    c = make(exit_wait_s=60)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    _finish_all_but_rank_3(c, job, attempt_id)  # rank 3 writes the final model, alone
    for _ in range(10):
        c.tick(30)
    assert c.job(job).attempts[0].state == "running"
    # It rests for a while between two pieces of work: the count starts again each time.
    c.agents["workers-1"].set_idle(attempt_id, 3, True)
    c.tick(40)
    c.agents["workers-1"].set_idle(attempt_id, 3, False)
    c.tick(1)
    c.agents["workers-1"].set_idle(attempt_id, 3, True)
    c.tick(40)
    assert c.job(job).attempts[0].state == "running"
    c.agents["workers-1"].exit_rank(attempt_id, 3, code=0)
    c.agents["workers-1"].beat()
    assert c.job(job).state == "completed"
    assert not c.events("ranks_left_idle", job_id=job)


def test_an_idle_rank_whose_peer_failed_is_torn_down_as_a_crash(make: Make) -> None:
    c = make(exit_wait_s=60)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a1.set_idle(attempt_id, 3, True)
    a0.exit_all(attempt_id)
    a0.beat()
    a1.exit_rank(attempt_id, 2, code=1, tail="RuntimeError: boom")
    a1.beat()
    info = c.job(job)
    assert (info.attempts[0].state, info.attempts[0].cause) == ("stopping", "crash")
    c.teardown(job)
    assert c.job(job).attempts[0].state == "failed"
    assert not c.events("ranks_left_idle", job_id=job)


def test_exit_wait_0_waits_for_an_idle_rank_forever(make: Make) -> None:
    c = make(exit_wait_s=0)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    _finish_all_but_rank_3(c, job, attempt_id)
    c.agents["workers-1"].set_idle(attempt_id, 3, True)
    for _ in range(20):
        c.tick(60)
    assert c.job(job).attempts[0].state == "running"
    assert not c.events("ranks_left_idle", job_id=job)


def test_a_rank_idle_since_before_its_peers_ended_still_waits_from_their_end(
    make: Make,
) -> None:
    c = make(exit_wait_s=60)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    c.agents["workers-1"].set_idle(attempt_id, 3, True)  # blocked in a collective, say
    c.tick(100)
    _finish_all_but_rank_3(c, job, attempt_id)
    c.tick(30)
    assert c.job(job).attempts[0].state == "running"
    c.tick(31)
    assert c.job(job).attempts[0].state == "stopping"


def test_a_cancel_while_an_idle_rank_is_torn_down_ends_cancelled(make: Make) -> None:
    c = make(exit_wait_s=60)
    job = c.submit(auto_resume=True)
    attempt_id = c.start(job)
    _finish_all_but_rank_3(c, job, attempt_id)
    c.agents["workers-1"].set_idle(attempt_id, 3, True)
    c.tick(61)
    assert c.job(job).attempts[0].state == "stopping"
    c.controller.cancel(job)
    c.teardown(job, ["workers-1"])
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("cancelled", "cancelled")
    assert not c.events("recovery_decision", job_id=job)
