"""The heartbeat long poll: new orders reach a waiting agent at once, and only then."""

from __future__ import annotations

import threading
import time

from trainpod.api.models import Orders
from trainpod.controller.daemon import run_reconciler
from trainpod.testing import FakeAgent
from trainpod.testing.wait import wait_until

from .conftest import Cluster

DEADLINE_S = 10.0  # generous bound on what must happen at once; never reached when correct


class Poll:
    """One agent beat with ``wait_s`` in a thread, and a way to see it is parked."""

    def __init__(self, cluster: Cluster, agent: FakeAgent, wait_s: float) -> None:
        self.cluster = cluster
        self.agent = agent
        self.done = threading.Event()
        self.orders: Orders | None = None
        self.error: BaseException | None = None
        agent.facts = {"poll": id(self)}  # marks the heartbeat of this poll in the store
        self.thread = threading.Thread(target=self._run, args=(wait_s,), daemon=True)
        self.thread.start()

    def _run(self, wait_s: float) -> None:
        try:
            self.orders = self.agent.beat(wait_s=wait_s)
        except BaseException as exc:  # surfaced by result()
            self.error = exc
        finally:
            self.done.set()

    def parked(self) -> None:
        """Return once the heartbeat is recorded and the reply is waiting for a change.

        The controller records the beat and starts waiting under one lock, so once a query
        (which takes that lock) sees the beat, the reply is parked (or already sent).
        """
        wait_until(
            lambda: self.cluster.node(self.agent.node).facts.get("poll") == id(self),
            timeout_s=DEADLINE_S,
            what=f"the beat of poll {id(self)} in the store",
        )
        assert not self.done.is_set(), "the long poll returned without new orders"

    def result(self) -> Orders:
        assert self.done.wait(DEADLINE_S), "the long poll did not return"
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.orders is not None
        return self.orders


def test_a_waiting_agent_gets_its_launch_order_as_soon_as_a_job_is_placed(
    cluster: Cluster,
) -> None:
    c = cluster
    agent = c.agents["workers-0"]
    held = agent.beat()
    poll = Poll(c, agent, wait_s=30)
    poll.parked()

    job = c.submit(nodes=1, procs=2)  # places on workers-0, the first idle node
    c.controller.step()
    orders = poll.result()
    assert orders.hash != held.hash
    assert [o.job_id for o in orders.launch] == [job]


def test_the_reconcile_loop_places_a_job_submitted_from_another_thread(cluster: Cluster) -> None:
    """The daemon's loop wakes on a submit, places the job, and the waiting agent hears."""
    c = cluster
    agent = c.agents["workers-0"]
    agent.beat()
    stop = threading.Event()
    loop = threading.Thread(target=run_reconciler, args=(c.controller, stop), daemon=True)
    loop.start()
    try:
        poll = Poll(c, agent, wait_s=30)
        poll.parked()
        submitter = threading.Thread(target=c.submit, kwargs={"nodes": 1, "procs": 1})
        submitter.start()
        orders = poll.result()
        submitter.join(DEADLINE_S)
        assert len(orders.launch) == 1
    finally:
        stop.set()
        c.controller.wakeup.set()
        loop.join(DEADLINE_S)
    assert not loop.is_alive()


def test_a_waiting_agent_gets_its_kill_order_as_soon_as_the_job_is_cancelled(
    cluster: Cluster,
) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=1)
    attempt_id = c.start(job)
    agent = c.agents[c.job(job).attempts[0].nodes[0]]
    agent.beat()
    poll = Poll(c, agent, wait_s=30)
    poll.parked()
    c.controller.cancel(job)
    assert [k.attempt_id for k in poll.result().kill] == [attempt_id]


def test_changes_elsewhere_do_not_end_the_wait(cluster: Cluster) -> None:
    c = cluster
    agent = c.agents["workers-1"]
    held = agent.beat()
    poll = Poll(c, agent, wait_s=30)
    poll.parked()
    job = c.submit(nodes=1, procs=1)
    c.controller.step()  # placed on workers-0: nothing for workers-1
    c.agents["workers-0"].beat()
    assert not poll.done.is_set()
    second = c.submit(nodes=1, procs=1)
    c.controller.step()  # this one lands on workers-1
    orders = poll.result()
    assert orders.hash != held.hash
    assert [o.job_id for o in orders.launch] == [second]
    assert c.job(job).attempts[0].nodes == ["workers-0"]


def test_unchanged_orders_are_returned_after_wait_s_even_with_a_fake_clock(
    cluster: Cluster,
) -> None:
    """The wait is real time: a fake clock that never moves must not make it endless."""
    agent = cluster.agents["workers-0"]
    held = agent.beat()
    start = time.monotonic()
    poll = Poll(cluster, agent, wait_s=0.05)
    orders = poll.result()
    assert orders.hash == held.hash
    assert time.monotonic() - start >= 0.05


def test_stale_orders_are_answered_at_once(cluster: Cluster) -> None:
    c = cluster
    agent = c.agents["workers-0"]
    agent.beat()
    c.submit(nodes=1, procs=1)
    c.controller.step()
    # The agent still holds the hash of the empty orders: the reply must not wait.
    poll = Poll(c, agent, wait_s=30)
    assert len(poll.result().launch) == 1
