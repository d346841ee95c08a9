"""The heartbeat long poll on a real HTTP server: parked polls hold no worker thread.

Sixty agents park a long poll each, more than anyio's forty worker threads; the API still
answers other calls while they wait, and a submission reaches every parked agent at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from trainpod.api.models import Orders
from trainpod.testing import FakeGroup

from .conftest import Cluster, MakeCluster, serve

AGENTS = 60  # > anyio's default 40 worker threads
ADMIN = {"Authorization": "Bearer admin-secret"}
AGENT = {"Authorization": "Bearer agent-secret"}
WAIT_S = 12.0  # the parked polls' wait: they are answered at its end
DEADLINE_S = 20.0  # generous bound on what must happen at once; never reached when correct


@pytest.fixture
def served(make_cluster: MakeCluster) -> Iterator[tuple[Cluster, str]]:
    c = make_cluster(groups=(FakeGroup("workers", AGENTS, devices=1),))
    c.up()
    with serve(c, timeout_s=DEADLINE_S) as url:
        yield c, url


def test_parked_long_polls_hold_no_thread_and_all_wake_on_a_change(
    served: tuple[Cluster, str],
) -> None:
    c, url = served
    marks = {}
    for name, agent in c.agents.items():
        agent.beat()  # the orders it holds now: nothing to do
        agent.facts = {"poll": name}
        marks[name] = agent.heartbeat(wait_s=30.0).model_dump(mode="json")

    async def run() -> tuple[list[Orders], int]:
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            polls = [
                asyncio.create_task(client.post("/v1/agent/heartbeat", json=hb, headers=AGENT))
                for hb in marks.values()
            ]

            def parked() -> bool:
                return all(n.facts.get("poll") == n.name for n in c.controller.node_infos())

            while not parked():
                await asyncio.sleep(0.05)
            assert not any(p.done() for p in polls), "a long poll returned without new orders"
            # Every poll is parked; a call that needs a worker thread still gets one.
            nodes = await client.get("/v1/nodes", headers=ADMIN)
            assert nodes.status_code == 200 and len(nodes.json()) == AGENTS
            assert not any(p.done() for p in polls)
            job = await client.post(
                "/v1/jobs",
                json={"command": ["python", "train.py"], "nodes": AGENTS, "procs_per_node": 1},
                headers=ADMIN,
            )
            assert job.status_code == 201, job.text
            c.controller.step()  # the reconcile loop's pass: the job is placed
            replies = await asyncio.gather(*polls)
            return [Orders.model_validate(r.json()) for r in replies], int(job.json()["id"])

    orders, job_id = asyncio.run(run())
    assert len(orders) == AGENTS
    assert all(len(o.launch) == 1 and o.launch[0].job_id == job_id for o in orders)


def test_a_change_answers_only_the_polls_whose_orders_it_changed(
    served: tuple[Cluster, str],
) -> None:
    """A one-node job wakes the parked poll of the node it is placed on, with its launch;
    the other agents' polls stay parked and are answered at their deadline with the orders
    they hold (one look-up of every parked node's orders, not a wake-up of each poll)."""
    c, url = served
    marks = {}
    for name, agent in c.agents.items():
        agent.beat()
        agent.facts = {"poll": name}
        marks[name] = agent.heartbeat(wait_s=WAIT_S).model_dump(mode="json")

    async def run() -> tuple[dict[str, Orders], dict[str, bool] | None]:
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            polls = {
                name: asyncio.create_task(
                    client.post("/v1/agent/heartbeat", json=hb, headers=AGENT)
                )
                for name, hb in marks.items()
            }

            def parked() -> bool:
                return all(n.facts.get("poll") == n.name for n in c.controller.node_infos())

            while not parked():
                await asyncio.sleep(0.05)
            parked_at = time.monotonic()
            job = await client.post(
                "/v1/jobs",
                json={"command": ["python", "train.py"], "nodes": 1, "procs_per_node": 1},
                headers=ADMIN,
            )
            assert job.status_code == 201, job.text
            c.controller.step()  # the job is placed on one node
            await asyncio.wait(polls.values(), return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.5)  # time for any other (wrong) wake-up to land
            early: dict[str, bool] | None = {name: p.done() for name, p in polls.items()}
            if time.monotonic() - parked_at > WAIT_S - 2:  # so slow a box that deadlines came
                early = None
            replies = {name: Orders.model_validate((await p).json()) for name, p in polls.items()}
            return replies, early

    replies, early = asyncio.run(run())
    launched = {name for name, o in replies.items() if o.launch}
    assert len(launched) == 1, launched
    if early is not None:
        assert {name for name, done in early.items() if done} == launched
    held = {name: hb["orders_hash"] for name, hb in marks.items()}
    assert all(replies[name].hash == held[name] for name in replies if name not in launched)
