"""``interval="auto"`` learns the cluster's failure rate: restarts carry the observed MTBF."""

from __future__ import annotations

from .healing import TAIL, Make


def test_launches_carry_the_mtbf_this_cluster_has_observed(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    launch_env = c.controller.orders.launch_order(
        c.controller.store.attempts(job)[0], "workers-0"
    ).env
    assert "TRAINPOD_MTBF_S" not in launch_env  # no fault yet: the library's default applies

    c.tick(3600)  # an hour on 3 nodes, then one crash
    c.agents["workers-1"].exit_rank(first, 3, code=1, tail=TAIL)
    c.agents["workers-1"].beat()
    c.teardown(job)
    c.controller.step()
    attempt = c.controller.store.attempts(job)[-1]
    assert attempt.number == 2
    env = c.controller.orders.launch_order(attempt, attempt.nodes[0]).env
    # 3 nodes x ~3600 s per fault, for a job on 2 nodes: ~5400 s.
    assert 5000 < float(env["TRAINPOD_MTBF_S"]) < 6000
    assert "1 faults in 3.00 node-hours" in env["TRAINPOD_MTBF_SOURCE"]


def test_a_job_may_set_its_own_mtbf(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True, env={"TRAINPOD_MTBF_S": "60"})
    first = c.start(job)
    c.tick(100)
    c.agents["workers-1"].exit_rank(first, 3, code=1, tail=TAIL)
    c.agents["workers-1"].beat()
    c.teardown(job)
    c.controller.step()
    attempt = c.controller.store.attempts(job)[-1]
    assert (
        c.controller.orders.launch_order(attempt, attempt.nodes[0]).env["TRAINPOD_MTBF_S"] == "60"
    )
