"""Beats served in batches (``Controller.serve``, what the API's heartbeat thread calls):
one reply per call, in order; a bad beat costs the others nothing; look-ups see the store
as the beats before them left it."""

from __future__ import annotations

from trainpod.api.models import Orders
from trainpod.errors import NotFound

from .conftest import Cluster


def _orders(reply: tuple[Orders, int] | Exception) -> Orders:
    assert not isinstance(reply, Exception), reply
    return reply[0]


def test_a_batch_answers_each_call_and_a_bad_beat_costs_the_others_nothing(
    cluster: Cluster,
) -> None:
    now = cluster.clock.advance(5.0)
    good = cluster.agents["workers-0"].heartbeat()
    ghost = good.model_copy(update={"node": "ghost-0"})
    other = cluster.agents["workers-1"].heartbeat()
    replies = cluster.controller.serve([good, ghost, "workers-1", other])
    assert len(replies) == 4
    assert isinstance(replies[1], NotFound) and "not part of cluster" in str(replies[1])
    assert [_orders(replies[i]).launch for i in (0, 2, 3)] == [[], [], []]
    # Both good beats were committed, the failed one in between left nothing.
    assert [cluster.node(n).last_heartbeat for n in ("workers-0", "workers-1")] == [now, now]
    assert "ghost-0" not in cluster.node_states()


def test_look_ups_follow_what_the_beats_and_the_scheduler_wrote(cluster: Cluster) -> None:
    names = ["workers-0", "workers-1"]
    job = cluster.submit(nodes=1, procs=1)
    cluster.controller.step()  # placed on one of them: its orders launch the job
    first = [_orders(r) for r in cluster.controller.serve(names)]
    assert sorted(len(o.launch) for o in first) == [0, 1]
    placed = names[[len(o.launch) for o in first].index(1)]
    assert first[names.index(placed)].launch[0].job_id == job
    assert first == [cluster.controller.orders_for(n)[0] for n in names]
    # The rank starts and is reported: the launch order is gone, in the same batch.
    agent = cluster.agents[placed]
    agent.start_ranks(first[names.index(placed)])
    replies = cluster.controller.serve([agent.heartbeat(), placed])
    assert [_orders(r).launch for r in replies] == [[], []]
    assert _orders(replies[1]).active_jobs == [job]
