"""The orders name the attempts whose rendezvous store a node's agent hosts (ADR 0028): the
attempt's first node, from its launch until every rank on every node has ended."""

from __future__ import annotations

from .conftest import Cluster


def test_the_leader_keeps_the_store_until_the_last_rank_anywhere_ends(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=1)
    c.controller.step()
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    attempt_id = c.attempt_id(job)
    o0, o1 = a0.beat(), a1.beat()
    assert o0.launch[0].env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (o0.stores, o1.stores) == ([attempt_id], [])  # with the launch, on the leader only
    a0.start_ranks(o0)
    a1.start_ranks(o1)
    a0.beat()
    a1.beat()
    a0.exit_all(attempt_id)  # rank 0 ends first ...
    assert a0.beat().stores == [attempt_id]  # ... rank 1 still needs the store
    a1.exit_all(attempt_id)
    a1.beat()
    assert c.job(job).state == "completed"
    assert a0.beat().stores == []


def test_a_cancelled_attempt_keeps_its_store_until_its_ranks_are_gone(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=1)
    c.controller.step()
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    attempt_id = c.attempt_id(job)
    a0.start_ranks(a0.beat())
    a1.start_ranks(a1.beat())
    a0.beat()
    a1.beat()
    assert c.controller.cancel(job).state == "stopping"
    a0.kill_ranks(a0.beat())
    assert a0.beat().stores == [attempt_id]  # the other node's rank is still being stopped
    a1.kill_ranks(a1.beat())
    a1.beat()
    assert c.job(job).state == "cancelled"
    assert a0.beat().stores == []
