"""Jobs through their life: placement, launch, success, failure, cancel, FIFO, spares."""

from __future__ import annotations

import pytest

from trainpod.errors import Conflict, NotFound, SpecError
from trainpod.spec.job import JobSpec
from trainpod.testing import FakeGroup

from .conftest import PORT, Cluster, MakeCluster


def test_a_two_node_job_runs_to_completion(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2, name="gpt")
    assert c.job(job).state == "queued"

    c.controller.step()
    info = c.job(job)
    assert info.state == "starting"
    attempt = info.attempts[0]
    assert (attempt.number, attempt.state) == (1, "launching")
    assert attempt.nodes == ["workers-0", "workers-1"]
    assert (attempt.master_addr, attempt.master_port) == ("127.0.0.1", PORT)
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "allocated"}
    assert {c.node(n).job_id for n in attempt.nodes} == {job}

    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    o0, o1 = a0.beat(), a1.beat()
    assert len(o0.launch) == len(o1.launch) == 1
    l0, l1 = o0.launch[0], o1.launch[0]
    attempt_id = c.attempt_id(job)
    assert l0.attempt_id == l1.attempt_id == attempt_id
    assert [(s.rank, s.local_rank) for s in l0.ranks] == [(0, 0), (1, 1)]
    assert [(s.rank, s.local_rank) for s in l1.ranks] == [(2, 0), (3, 1)]
    assert (l0.env["NODE_RANK"], l1.env["NODE_RANK"]) == ("0", "1")
    assert l0.env["WORLD_SIZE"] == l1.env["WORLD_SIZE"] == "4"
    assert l0.env["MASTER_ADDR"] == "127.0.0.1"
    assert l0.env["MASTER_PORT"] == str(PORT)
    assert l0.argv == ["python", "train.py"]
    assert a0.beat().hash == o0.hash  # the same orders until something changes

    assert a0.start_ranks() == [0, 1]
    a0.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("starting", "launching")
    assert a1.start_ranks() == [2, 3]
    assert a1.beat().launch == []  # nothing left to launch once the ranks run
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("running", "running")
    assert info.started_at == c.clock.now()
    ranks = info.attempts[0].ranks
    assert [(r.rank, r.node, r.state) for r in ranks] == [
        (0, "workers-0", "running"),
        (1, "workers-0", "running"),
        (2, "workers-1", "running"),
        (3, "workers-1", "running"),
    ]
    assert ranks[2].pid == a1.pid(attempt_id, 2)

    c.clock.advance(60)
    a0.exit_all(attempt_id)
    a0.beat()
    assert c.job(job).state == "running"
    a1.exit_all(attempt_id)
    a1.beat()
    info = c.job(job)
    assert (info.state, info.reason, info.ended_at) == ("completed", "", c.clock.now())
    assert info.attempts[0].state == "succeeded"
    assert [r.exit_code for r in info.attempts[0].ranks] == [0, 0, 0, 0]
    assert c.node_states() == {"workers-0": "idle", "workers-1": "idle"}
    assert {c.node(n).job_id for n in attempt.nodes} == {None}
    assert a0.attempts == [] and a1.attempts == []  # exits delivered, forgotten
    orders = a0.beat()
    assert orders.launch == [] and orders.kill == []

    kinds = [e.kind for e in c.events() if e.job_id == job]
    assert kinds[0] == "job_submitted"
    assert kinds.count("rank_started") == kinds.count("rank_exited") == 4
    assert "job_first_start" in kinds
    assert [e.data["new"] for e in c.events("job_state", job_id=job)] == [
        "starting",
        "running",
        "completed",
    ]
    assert [e.data["new"] for e in c.events("attempt_state", job_id=job)] == [
        "running",
        "succeeded",
    ]
    assert len(c.events("node_released", job_id=job)) == 2


def test_ranks_that_end_before_they_were_seen_running_still_count(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=2)
    c.controller.step()
    agent = next(a for a in c.agents.values() if c.node(a.node).job_id == job)
    agent.start_ranks(agent.beat())
    agent.exit_all(c.attempt_id(job))
    agent.beat()  # one report: started and exited
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("completed", "succeeded")
    assert len(c.events("rank_started", job_id=job)) == 2


def test_a_failing_rank_stops_the_attempt_and_fails_the_job_with_its_log_tail(
    cluster: Cluster,
) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    attempt_id = c.start(job)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]

    c.clock.advance(5)
    tail = "Traceback (most recent call last):\n  File train.py\nValueError: loss is nan"
    a1.exit_rank(attempt_id, 3, code=3, tail=tail)
    o1 = a1.beat()
    info = c.job(job)
    attempt = info.attempts[0]
    assert (attempt.state, attempt.cause) == ("stopping", "crash")
    assert attempt.failure["rank"] == 3
    assert attempt.failure["node"] == "workers-1"
    assert attempt.failure["exit_code"] == 3
    assert attempt.failure["log_tail"] == tail
    assert info.state == "stopping"
    assert info.reason.startswith("rank 3 on workers-1 exited with code 3")
    assert "ValueError: loss is nan" in info.reason
    exited = c.events("rank_exited", job_id=job)
    assert [(e.data["rank"], e.data["exit_code"], e.data["log_tail"]) for e in exited] == [
        (3, 3, tail)
    ]

    # both nodes are told to tear the attempt down (workers-1 still runs rank 2)
    o0 = a0.beat()
    assert [k.attempt_id for k in o0.kill] == [attempt_id]
    assert o0.kill[0].grace_s == c.cfg.teardown_grace_s
    assert o0.kill[0].reason == "crash"
    assert [k.attempt_id for k in o1.kill] == [attempt_id]
    assert o0.launch == o1.launch == []
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "allocated"}

    assert a0.kill_ranks() == [0, 1]
    a0.beat()
    assert c.job(job).state == "stopping"  # rank 2 still runs
    assert a1.kill_ranks() == [2]
    a1.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("failed", "failed")
    assert info.attempts[0].failure["rank"] == 3  # the first failure, not the teardown
    assert "ValueError: loss is nan" in info.reason
    assert [r.signal for r in info.attempts[0].ranks] == [15, 15, 15, None]
    assert c.node_states() == {"workers-0": "idle", "workers-1": "idle"}
    assert a0.beat().kill == a1.beat().kill == []


def test_a_rank_killed_by_a_signal_fails_the_job(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=2)
    attempt_id = c.start(job)
    agent = c.agents[c.job(job).attempts[0].nodes[0]]
    agent.exit_rank(attempt_id, 0, signal=9, tail="Killed")
    agent.exit_rank(attempt_id, 1, code=0)
    agent.beat()
    info = c.job(job)
    assert info.state == "failed"
    assert info.reason.startswith("rank 0 on workers-0 was killed by signal 9")


def test_cancel_a_queued_job(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2)
    info = c.controller.cancel(job)
    assert (info.state, info.reason) == ("cancelled", "cancelled while queued")
    c.controller.step()
    assert c.job(job).attempts == []
    assert set(c.node_states().values()) == {"idle"}
    assert [e.kind for e in c.events() if e.job_id == job] == [
        "job_submitted",
        "cancel_requested",
        "job_state",
    ]
    with pytest.raises(Conflict, match="already ended"):
        c.controller.cancel(job)


def test_cancel_an_unknown_job(cluster: Cluster) -> None:
    with pytest.raises(NotFound, match="no job 42"):
        cluster.controller.cancel(42)
    with pytest.raises(NotFound):
        cluster.controller.job_info(42)


def test_cancel_a_running_job(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    attempt_id = c.start(job)
    assert c.job(job).state == "running"

    row = c.controller.cancel(job)
    assert (row.state, row.reason, row.cancel_requested) == ("stopping", "cancelling", True)
    assert c.job(job).attempts[0].state == "stopping"
    assert c.controller.cancel(job).state == "stopping"  # idempotent while it stops
    for agent in c.agents.values():
        orders = agent.beat()
        assert [(k.attempt_id, k.reason) for k in orders.kill] == [(attempt_id, "cancelled")]
        agent.kill_ranks(orders)
        agent.beat()
    info = c.job(job)
    assert (info.state, info.reason) == ("cancelled", "cancelled by request")
    assert (info.attempts[0].state, info.attempts[0].cause) == ("cancelled", "cancelled")
    assert set(c.node_states().values()) == {"idle"}


def test_cancel_before_any_agent_picked_up_the_launch_orders(cluster: Cluster) -> None:
    """No rank ever started: nothing to tear down, the job must not hang in stopping."""
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.controller.step()
    assert c.controller.cancel(job).state == "cancelled"
    assert c.job(job).attempts[0].state == "cancelled"
    assert set(c.node_states().values()) == {"idle"}
    orders = c.beat()
    assert all(o.launch == [] and o.kill == [] for o in orders.values())


def test_cancel_while_only_some_nodes_started_their_ranks(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.controller.step()
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a0.start_ranks(a0.beat())
    a0.beat()
    assert c.controller.cancel(job).state == "stopping"
    assert a1.beat().launch == []  # a stopping attempt is never launched
    a0.kill_ranks(a0.beat())
    a0.beat()
    info = c.job(job)
    assert (info.state, info.attempts[0].state) == ("cancelled", "cancelled")
    assert set(c.node_states().values()) == {"idle"}


def test_an_agent_that_started_ranks_of_an_ended_attempt_is_told_to_kill_them(
    cluster: Cluster,
) -> None:
    """The launch order reached the agent, the cancel reached the controller first."""
    c = cluster
    job = c.submit(nodes=2, procs=2)
    c.controller.step()
    a0 = c.agents["workers-0"]
    a0.start_ranks(a0.beat())
    c.controller.cancel(job)
    assert c.job(job).state == "cancelled"
    attempt_id = c.attempt_id(job)
    orders = a0.beat()  # reports the ranks running
    assert [(k.attempt_id, k.reason) for k in orders.kill] == [(attempt_id, "attempt ended")]
    a0.kill_ranks(orders)
    assert a0.beat().kill == []
    assert a0.attempts == []
    assert c.job(job).state == "cancelled"


def test_a_third_job_waits_in_fifo_order_until_nodes_free(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 4)])
    c.up()
    first, second, third = (c.submit(nodes=2, procs=1) for _ in range(3))
    small = c.submit(nodes=1, procs=1)  # would fit nowhere anyway, and must not jump ahead
    c.controller.step()
    assert [c.job(j).state for j in (first, second, third, small)] == [
        "starting",
        "starting",
        "queued",
        "queued",
    ]
    assert c.job(first).attempts[0].nodes == ["workers-0", "workers-1"]
    assert c.job(second).attempts[0].nodes == ["workers-2", "workers-3"]

    attempt_id = c.start(second)
    for name in ("workers-2", "workers-3"):
        c.agents[name].exit_all(attempt_id)
        c.agents[name].beat()
    assert c.job(second).state == "completed"
    c.controller.step()
    assert c.job(third).state == "starting"
    assert c.job(third).attempts[0].nodes == ["workers-2", "workers-3"]
    assert c.job(small).state == "queued"


def test_head_of_line_blocking_keeps_a_big_job_from_starving(cluster: Cluster) -> None:
    c = cluster
    running = c.submit(nodes=1, procs=1)
    c.controller.step()
    big = c.submit(nodes=2, procs=1)
    small = c.submit(nodes=1, procs=1)
    c.controller.step()
    assert (c.job(big).state, c.job(small).state) == ("queued", "queued")  # one node is free
    c.controller.cancel(running)
    c.controller.step()
    assert (c.job(big).state, c.job(small).state) == ("starting", "queued")


def test_partitions_schedule_independently(make_cluster: MakeCluster) -> None:
    c = make_cluster(
        groups=[FakeGroup("cpu", 1), FakeGroup("gpu", 2)],
        partitions={"cpu": ["cpu"], "gpu": ["gpu"]},
    )
    c.up()
    blocker = c.submit(nodes=2, procs=1, partition="gpu")
    c.controller.step()
    waiting = c.submit(nodes=1, procs=1, partition="gpu")
    other = c.submit(nodes=1, procs=1)  # the default partition, cpu
    c.controller.step()
    assert c.job(blocker).state == "starting"
    assert c.job(waiting).state == "queued"
    assert c.job(other).state == "starting"
    assert c.job(other).attempts[0].nodes == ["cpu-0"]
    assert c.job(other).spec.partition == "cpu"


def test_hot_spares_are_never_allocated(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 2), FakeGroup("spares", 2, spare=True)])
    c.up()
    jobs = [c.submit(nodes=1, procs=1) for _ in range(4)]
    c.controller.step()
    assert [c.job(j).state for j in jobs] == ["starting", "starting", "queued", "queued"]
    assert c.node_states() == {
        "workers-0": "allocated",
        "workers-1": "allocated",
        "spares-0": "idle",
        "spares-1": "idle",
    }
    plan = c.controller.plan(JobSpec(command=["x"], nodes=2, procs_per_node=1))
    assert plan.nodes == ["workers-0", "workers-1"]  # never a spare, even in a plan
    assert "would wait in the queue" in plan.note


def test_a_job_larger_than_the_non_spare_nodes_is_rejected_naming_the_fix(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 2), FakeGroup("spares", 1, spare=True)])
    with pytest.raises(SpecError) as err:
        c.submit(nodes=3)
    message = str(err.value)
    assert "asks for 3 nodes" in message
    assert "2 schedulable nodes" in message
    assert "1 hot spares" in message
    assert "--nodes 2 or fewer" in message
    assert c.controller.job_infos() == []
    assert c.events("job_submitted") == []


def test_an_unknown_partition_is_rejected(cluster: Cluster) -> None:
    with pytest.raises(SpecError) as err:
        cluster.submit(nodes=1, partition="gpu-xl")
    assert "'gpu-xl' does not exist" in str(err.value)
    assert "use one of: default" in str(err.value)
    with pytest.raises(SpecError):
        cluster.controller.plan(JobSpec(command=["x"], partition="gpu-xl"))


def test_too_many_procs_per_node_are_rejected(cluster: Cluster) -> None:
    with pytest.raises(SpecError, match="--procs-per-node 2 or fewer"):
        cluster.submit(nodes=1, procs=3)


def test_procs_per_node_defaults_to_the_device_count(cluster: Cluster) -> None:
    job = cluster.submit(nodes=1, procs=None)
    assert cluster.job(job).spec.procs_per_node == 2
    assert cluster.job(job).spec.partition == "default"


def test_plan_renders_the_launch_without_doing_it(cluster: Cluster) -> None:
    c = cluster
    plan = c.controller.plan(JobSpec(command=["python", "t.py"], nodes=2, procs_per_node=2))
    assert plan.partition == "default" and plan.note == ""
    assert plan.nodes == ["workers-0", "workers-1"]
    assert [s.rank for s in plan.orders["workers-1"].ranks] == [2, 3]
    assert plan.orders["workers-0"].env["WORLD_SIZE"] == "4"
    assert c.controller.job_infos() == []
    assert set(c.node_states().values()) == {"idle"}


def test_job_queries(cluster: Cluster) -> None:
    c = cluster
    done = c.submit(nodes=1, procs=1)
    c.controller.cancel(done)
    live = c.submit(nodes=1, procs=1)
    assert [j.id for j in c.controller.job_infos()] == [done, live]
    assert [j.id for j in c.controller.job_infos(include_ended=False)] == [live]
    assert [j.id for j in c.controller.job_infos(limit=1)] == [live]
    nodes, jobs = c.controller.counts()
    assert nodes == {"idle": 2}
    assert jobs == {"cancelled": 1, "queued": 1}
