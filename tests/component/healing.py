"""Shared fixtures of the self-healing component tests: a cluster with fake agents, a fake
repairer, and the ``make`` fixture."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from trainpod.controller.core import Controller
from trainpod.controller.repair import Replacer
from trainpod.store.repo import Store
from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config

from .conftest import PORT, Cluster

WORKERS = FakeGroup("workers", 2)
SPARE = FakeGroup("spares", 1, spare=True)
TAIL = "step 7 loss 2.31\nValueError: bad batch"


class HealingCluster(Cluster):
    """A cluster whose attempts get a new rendezvous port each (PORT, PORT+1, ...)."""

    def __init__(
        self, cfg: Any, db: Path, clock: FakeClock, replacer: Replacer | None = None
    ) -> None:
        self._next_port = itertools.count(PORT)
        super().__init__(cfg, db, clock, replacer)

    def _start(self) -> Controller:
        controller = Controller(
            Store.open(self.db),
            self.cfg,
            clock=self.clock,
            ports=lambda _: next(self._next_port),
            replacer=self.replacer,
        )
        controller.bootstrap()
        return controller

    # -- acting ---------------------------------------------------------------------------
    def nodes_of(self, job_id: int) -> list[str]:
        return self.job(job_id).attempts[-1].nodes

    def teardown(self, job_id: int, nodes: Sequence[str] | None = None) -> None:
        """Every node (default: the attempt's) obeys its kill orders and reports the exits."""
        names = list(nodes if nodes is not None else self.nodes_of(job_id))
        for name in names:
            agent = self.agents[name]
            agent.kill_ranks(agent.beat())
        for name in names:
            self.agents[name].beat()

    def crash(self, job_id: int, rank: int, code: int = 1, tail: str = TAIL) -> None:
        """Rank ``rank`` of the job's current attempt exits with ``code``; the rest is torn
        down."""
        attempt = self.job(job_id).attempts[-1]
        node = next(r.node for r in attempt.ranks if r.rank == rank)
        self.agents[node].exit_rank(self.attempt_id(job_id), rank, code=code, tail=tail)
        self.agents[node].beat()
        self.teardown(job_id)

    def finish(self, job_id: int) -> None:
        attempt_id = self.attempt_id(job_id)
        for name in self.nodes_of(job_id):
            self.agents[name].exit_all(attempt_id)
            self.agents[name].beat()

    def tick(self, seconds: float, *names: str) -> None:
        """Time passes; the named agents (default: every one) keep beating, then a step."""
        self.clock.advance(seconds)
        for name in names or self.agents:
            self.agents[name].beat()
        self.controller.step()

    def report(self, job_id: int, step: int, step_time: float = 1.0, **slow: float) -> None:
        """Every rank of the job's current attempt reports ``step``; ``slow={"r3": 3.0}``
        gives rank 3 another step time."""
        attempt = self.job(job_id).attempts[-1]
        attempt_id = self.attempt_id(job_id)
        for r in attempt.ranks:
            t = slow.get(f"r{r.rank}", step_time)
            self.agents[r.node].progress(attempt_id, r.rank, step, step_time_s=t)

    def replace_agent(self, name: str) -> FakeAgent:
        """A new instance of the node came up: a new agent, knowing nothing."""
        self.agents[name] = FakeAgent(self.controller, name)
        return self.agents[name]

    # -- looking --------------------------------------------------------------------------
    def moves(self, node: str) -> list[tuple[str, str]]:
        return [(e.data["old"], e.data["new"]) for e in self.events("node_state", node=node)]

    def job_moves(self, job_id: int) -> list[str]:
        states = [e.data["new"] for e in self.events("job_state", job_id=job_id)]
        return ["queued", *states]

    def decisions(self, job_id: int) -> list[tuple[str, str, list[str]]]:
        return [
            (e.data["action"], e.data["reason"], e.data["nodes"])
            for e in self.events("recovery_decision", job_id=job_id)
        ]

    def story(self, job_id: int, kinds: Sequence[str]) -> list[tuple[str, int | None]]:
        return [
            (e.kind, e.attempt) for e in self.events() if e.job_id == job_id and e.kind in kinds
        ]


class FakeRepairer:
    """Records the nodes it was asked to replace (it runs on the controller's thread)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._called = threading.Condition()

    def __call__(self, node: str) -> None:
        with self._called:
            self.calls.append(node)
            self._called.notify_all()

    def wait_for(self, count: int) -> list[str]:
        with self._called:
            assert self._called.wait_for(lambda: len(self.calls) >= count, timeout=5)
            return list(self.calls)


Make = Callable[..., HealingCluster]


@pytest.fixture(name="make")
def make_healing_cluster(tmp_path: Path) -> Iterator[Make]:
    made: list[HealingCluster] = []

    def build(
        groups: Sequence[FakeGroup] = (WORKERS, SPARE),
        replacer: Replacer | None = None,
        **kw: Any,
    ) -> HealingCluster:
        root = tmp_path / f"cluster-{len(made)}"
        root.mkdir()
        cfg = make_config(root, groups=groups, **kw)
        c = HealingCluster(cfg, root / "state.db", FakeClock(), replacer)
        made.append(c)
        c.up()
        return c

    yield build
    for c in made:
        c.close()
