"""A node's hand-over: the report that frees nodes places the next job in the same call, so
its launch order goes back in that reply (and to the other nodes' polls) without waiting for
the reconcile loop's next :meth:`Controller.step` or a periodic heartbeat. No step is called
here after the exit is reported."""

from __future__ import annotations

from trainpod.model.events import AttemptCreated, NodeReleased, RankExited, Recorded
from trainpod.scheduler.base import Scheduler, SchedulerDecision, Snapshot
from trainpod.scheduler.fifo import FifoScheduler
from trainpod.testing import FakeGroup

from .conftest import Cluster, MakeCluster
from .healing import Make


def _since(c: Cluster, after: int) -> list[Recorded]:
    return c.controller.store.typed_events(after=after)


def _last_id(c: Cluster) -> int:
    return max((r.id for r in _since(c, 0)), default=0)


def test_the_exit_report_carries_the_next_jobs_launch(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 1)])
    c.up()
    first = c.submit(nodes=1, procs=1)
    second = c.submit(nodes=1, procs=1)
    attempt = c.start(first)  # the one step of this test
    assert c.job(second).state == "queued"
    agent = c.agents["workers-0"]
    mark = _last_id(c)

    agent.exit_all(attempt)
    orders = agent.beat()  # the agent's immediate report of the exit

    assert c.job(first).state == "completed"
    assert c.job(second).state == "starting"
    assert [launch.job_id for launch in orders.launch] == [second]
    kinds = (RankExited, NodeReleased, AttemptCreated)
    events = [r for r in _since(c, mark) if isinstance(r.event, kinds)]
    assert [type(r.event) for r in events] == [RankExited, NodeReleased, AttemptCreated]
    exited, _, created = events
    assert isinstance(created.event, AttemptCreated)
    assert (created.event.job_id, created.event.nodes) == (second, ("workers-0",))
    assert created.ts == exited.ts  # placed by the pass of that very report


def test_the_other_nodes_of_the_next_job_get_its_launch_at_once(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 2)])
    c.up()
    first = c.submit(nodes=2, procs=1)
    second = c.submit(nodes=2, procs=1)
    attempt = c.start(first)
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a0.exit_all(attempt)
    assert a0.beat().launch == []  # one rank still runs: nothing is free yet
    a1.exit_all(attempt)
    assert [launch.job_id for launch in a1.beat().launch] == [second]
    # workers-0 has not reported anything since: its orders already hold the launch
    orders, _ = c.controller.orders_for("workers-0")
    assert [launch.job_id for launch in orders.launch] == [second]


class _FailsOnce(Scheduler):
    """FIFO, but the first pass after ``arm()`` raises (a scheduler bug)."""

    def __init__(self) -> None:
        self.fifo = FifoScheduler()
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        if self.armed:
            self.armed = False
            raise RuntimeError("scheduler bug")
        return self.fifo.plan(snapshot)


def test_a_failing_pass_after_the_exit_still_records_the_report(make_cluster: MakeCluster) -> None:
    sched = _FailsOnce()
    c = make_cluster(groups=[FakeGroup("workers", 1)], scheduler=sched)
    c.up()
    first = c.submit(nodes=1, procs=1)
    second = c.submit(nodes=1, procs=1)
    attempt = c.start(first)
    agent = c.agents["workers-0"]
    agent.exit_all(attempt)
    sched.arm()
    assert agent.beat().launch == []  # the pass failed, the beat did not
    assert (c.job(first).state, c.job(second).state) == ("completed", "queued")
    assert c.controller.wakeup.is_set()  # the reconcile loop is due ...
    c.controller.step()  # ... and its pass places the job
    assert c.job(second).state == "starting"


def test_a_job_in_recovery_gets_a_freed_node_before_the_queue(make: Make) -> None:
    # As in a step: jobs waiting in recovery for a node are decided again first.
    c = make(groups=[FakeGroup("workers", 3)])
    hurt = c.submit(nodes=2, procs=1, auto_resume=True)
    other = c.submit(nodes=1, procs=1)
    c.start(hurt)
    c.start(other)
    assert c.nodes_of(other) == ["workers-2"]
    c.agents["workers-1"].set_health("gpu", "fault", "XID 79")
    c.agents["workers-1"].beat()
    c.teardown(hurt)
    assert c.job(hurt).state == "recovering"  # waiting for a node, holding workers-0
    queued = c.submit(nodes=1, procs=1)
    c.finish(other)  # frees workers-2, in that report
    assert c.job(hurt).state == "starting"
    assert c.nodes_of(hurt) == ["workers-0", "workers-2"]
    assert c.job(queued).state == "queued"


def test_in_a_batch_of_beats_the_exit_report_places_the_next_job(
    make_cluster: MakeCluster,
) -> None:
    """The API serves beats in batches (:meth:`Controller.serve`, one transaction): the pass
    the exit report runs joins that transaction and the launch is in the batch's replies."""
    c = make_cluster(groups=[FakeGroup("workers", 2)])
    c.up()
    first = c.submit(nodes=1, procs=1)
    second = c.submit(nodes=1, procs=1)
    attempt = c.start(first)
    (node,) = c.job(first).attempts[-1].nodes
    done = c.agents[node]
    (idle,) = [a for name, a in c.agents.items() if name != node]
    done.exit_all(attempt)
    replies = c.controller.serve([done.heartbeat(), idle.node])
    assert not any(isinstance(r, Exception) for r in replies), replies
    placed = c.job(second)
    assert (c.job(first).state, placed.state) == ("completed", "starting")
    (launched_on,) = placed.attempts[-1].nodes
    orders = {done.node: replies[0], idle.node: replies[1]}[launched_on]
    assert not isinstance(orders, Exception)
    assert [launch.job_id for launch in orders[0].launch] == [second]


def test_a_failing_pass_in_a_batch_keeps_the_beats(make_cluster: MakeCluster) -> None:
    sched = _FailsOnce()
    c = make_cluster(groups=[FakeGroup("workers", 1)], scheduler=sched)
    c.up()
    first = c.submit(nodes=1, procs=1)
    second = c.submit(nodes=1, procs=1)
    attempt = c.start(first)
    agent = c.agents["workers-0"]
    agent.exit_all(attempt)
    sched.arm()
    (reply,) = c.controller.serve([agent.heartbeat()])
    assert not isinstance(reply, Exception) and reply[0].launch == []
    assert (c.job(first).state, c.job(second).state) == ("completed", "queued")
    c.controller.step()  # the reconcile loop's pass places it
    assert c.job(second).state == "starting"
