"""Self-healing: the recovery ladder executed by a real controller, stepped by hand.

Each test drives a real :class:`Controller` on a real SQLite file with a fake clock and fake
agents, and checks the states of jobs, attempts and nodes *and* the story the events tell
(goodput, the dashboard and the audit trail are built from it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

from trainpod.api.models import ChaosRequest, NodeAction
from trainpod.controller.core import Controller
from trainpod.errors import Conflict
from trainpod.store.repo import Store
from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config

from .conftest import PORT, Cluster

WORKERS = FakeGroup("workers", 2)
SPARE = FakeGroup("spares", 1, spare=True)
TAIL = "step 7 loss 2.31\nValueError: bad batch"


class HealingCluster(Cluster):
    """A cluster whose attempts get a new rendezvous port each (PORT, PORT+1, ...)."""

    def __init__(self, cfg: Any, db: Path, clock: FakeClock) -> None:
        self._next_port = itertools.count(PORT)
        super().__init__(cfg, db, clock)

    def _start(self) -> Controller:
        controller = Controller(
            Store.open(self.db), self.cfg, clock=self.clock, ports=lambda _: next(self._next_port)
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


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    made: list[HealingCluster] = []

    def build(groups: Sequence[FakeGroup] = (WORKERS, SPARE), **kw: Any) -> HealingCluster:
        root = tmp_path / f"cluster-{len(made)}"
        root.mkdir()
        c = HealingCluster(make_config(root, groups=groups, **kw), root / "state.db", FakeClock())
        made.append(c)
        c.up()
        return c

    yield build
    for c in made:
        c.close()


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


# -- GPU faults, spares and repair --------------------------------------------------------
def test_a_gpu_fault_quarantines_the_node_and_a_spare_takes_its_place(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    c.tick(100)
    seen_at = c.clock.now()
    a0, a1 = c.agents["workers-0"], c.agents["workers-1"]
    a1.set_health("gpu", "fault", "XID 79: GPU has fallen off the bus")
    a1.beat()
    node = c.node("workers-1")
    assert (node.state, node.reason) == (
        "quarantined",
        "gpu: XID 79: GPU has fallen off the bus",
    )
    assert node.job_id == job  # until its attempt is torn down
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "gpu_fault",
    )
    (fault,) = c.events("fault_detected", job_id=job)  # when it was seen, not after teardown
    assert (fault.ts, fault.data["fault"], fault.data["fault_at"]) == (
        seen_at,
        "gpu_fault",
        seen_at,
    )
    assert fault.data["nodes"] == ["workers-1"]
    assert c.moves("workers-1")[-1] == ("allocated", "quarantined")

    o0 = a0.beat()
    assert [(k.attempt_id, k.reason) for k in o0.kill] == [(first, "gpu_fault")]
    assert a1.beat().kill[0].attempt_id == first  # the faulty node kills its ranks too
    c.clock.advance(3)
    c.teardown(job)
    info = c.job(job)
    assert info.state == "starting"
    assert (info.attempts[0].state, info.attempts[0].cause) == ("failed", "gpu_fault")
    two = info.attempts[1]
    assert two.nodes == ["workers-0", "spares-0"]  # the spare in the bad node's position
    assert c.node_states() == {
        "workers-0": "allocated",
        "workers-1": "quarantined",
        "spares-0": "allocated",
    }
    assert c.node("workers-1").job_id is None
    assert c.node("spares-0").job_id == job
    (decision,) = c.events("recovery_decision", job_id=job)
    assert decision.data["action"] == "restart"
    assert decision.data["replaced"] == {"workers-1": "spares-0"}
    assert decision.data["counts"] is False
    created = c.events("attempt_created", job_id=job, attempt=2)[0]
    assert created.data["restart_reason"] == (
        "gpu_fault: workers-1: gpu: XID 79: GPU has fallen off the bus"
    )
    assert c.events("node_released", job_id=job, node="workers-1")

    c.start(job)
    c.finish(job)
    assert c.job(job).state == "completed"
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined", "spares-0": "idle"}
    c.controller.step()
    assert c.node("workers-1").state == "quarantined"  # no repairer: held for an operator

    # With a repairer, the node is replaced like a new instance, deep-checked, and returns.
    repairer = FakeRepairer()
    c.controller.repairer = repairer
    c.controller.step()
    assert c.node("workers-1").state == "repairing"
    assert repairer.wait_for(1) == ["workers-1"]
    assert a1.beat().deep_check is None  # the old instance is not the one to check
    assert c.node("workers-1").state == "repairing"

    new = c.replace_agent("workers-1")
    assert new.agent_id != a1.agent_id
    assert new.beat(lifecycle="running").deep_check is None  # lifecycle scripts first
    orders = new.beat()
    assert orders.deep_check is not None
    assert orders.deep_check.timeout_s == c.cfg.deep_check_timeout_s
    new.deep_check_result(orders.deep_check.id, "running")
    new.beat()
    assert c.node("workers-1").state == "repairing"
    new.deep_check_result(orders.deep_check.id, "ok")
    new.beat()
    node = c.node("workers-1")
    assert (node.state, node.reason, node.repairs, node.job_id) == ("idle", "", 0, None)
    assert c.moves("workers-1")[-2:] == [("quarantined", "repairing"), ("repairing", "idle")]
    repair = ["node_state", "agent_registered", "deep_check_started", "deep_check_finished"]
    repair.append("node_repaired")
    kinds = [e.kind for e in c.events(node="workers-1") if e.kind in repair]
    assert kinds[-6:] == [
        "node_state",  # quarantined -> repairing
        "agent_registered",  # the new instance
        "deep_check_started",
        "deep_check_finished",
        "node_state",  # repairing -> idle
        "node_repaired",
    ]
    assert new.beat().deep_check is None


def test_failed_repairs_quarantine_again_and_finally_retire_the_node(make: Make) -> None:
    c = make(groups=[WORKERS], retire_after=3)
    repairer = FakeRepairer()
    c.controller.repairer = repairer
    c.agents["workers-1"].set_health("memory", "fault", "uncorrectable ECC")
    c.agents["workers-1"].beat()
    assert c.node("workers-1").state == "quarantined"

    def repair_once(status: Literal["ok", "fault"], expected_calls: int) -> None:
        c.controller.step()
        assert c.node("workers-1").state == "repairing"
        assert len(repairer.wait_for(expected_calls)) == expected_calls
        new = c.replace_agent("workers-1")
        new.beat()
        new.deep_check_result(None, status, "GEMM check: 3 mismatches")
        new.beat()

    repair_once("fault", 1)
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("quarantined", 1)
    assert node.reason == "repair 1 failed: deep check failed: GEMM check: 3 mismatches"
    repair_once("ok", 2)
    assert (c.node("workers-1").state, c.node("workers-1").repairs) == ("idle", 0)  # reset

    c.agents["workers-1"].set_health("gpu", "fault", "XID 48")
    c.agents["workers-1"].beat()
    for n in (1, 2):
        repair_once("fault", 2 + n)
        assert (c.node("workers-1").state, c.node("workers-1").repairs) == ("quarantined", n)
    repair_once("fault", 5)
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("retired", 3)
    assert node.reason.startswith("retired after 3 failed repairs; last: deep check failed")
    c.controller.step()
    assert c.node("workers-1").state == "retired"
    assert len(repairer.calls) == 5  # a retired node is never repaired on its own


def test_a_repair_that_never_reports_fails_after_the_deadline(make: Make) -> None:
    c = make(groups=[WORKERS], deep_check_timeout_s=60)
    repairer = FakeRepairer()
    c.controller.repairer = repairer
    c.agents["workers-1"].set_health("disk", "fault", "scratch full")
    c.agents["workers-1"].beat()
    c.controller.step()
    assert c.node("workers-1").state == "repairing"
    c.tick(60 + 120 + 1, "workers-0")
    node = c.node("workers-1")
    assert (node.state, node.repairs) == ("quarantined", 1)
    assert "repair did not finish in time" in node.reason


def test_a_lost_node_is_replaced_by_the_spare(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    first = c.start(job)
    last_seen = c.clock.now()
    c.tick(c.cfg.heartbeat_timeout_s + 1, "workers-0", "spares-0")
    node = c.node("workers-1")
    assert node.state == "quarantined"
    assert node.reason.startswith("node lost: no heartbeat for")
    assert c.moves("workers-1")[-2:] == [("allocated", "suspect"), ("suspect", "quarantined")]
    (fault,) = c.events("fault_detected", job_id=job)
    assert (fault.data["fault"], fault.data["fault_at"], fault.node) == (
        "node_lost",
        last_seen,
        "workers-1",
    )
    c.teardown(job, ["workers-0"])
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[0].cause == "node_lost"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    assert c.decisions(job)[0][1] == "replaced workers-1 -> spares-0 after node_lost"

    c.start(job)
    assert c.job(job).state == "running"
    # The lost agent comes back: it is told to kill what it still runs, and stays quarantined.
    orders = c.agents["workers-1"].beat()
    assert [k.attempt_id for k in orders.kill] == [first]
    assert c.node("workers-1").state == "quarantined"
    c.finish(job)
    assert c.job(job).state == "completed"


def test_a_rank_killed_with_its_gpu_is_a_node_fault_not_the_job_s(make: Make) -> None:
    """The rank died first (a crash), the health check said why: it does not count."""
    c = make(max_restarts=1)
    job = c.submit(auto_resume=True)
    first = c.start(job)
    a1 = c.agents["workers-1"]
    a1.exit_rank(first, 3, signal=9)
    a1.set_health("gpu", "fault", "XID 79")
    a1.beat()
    c.teardown(job)
    info = c.job(job)
    assert info.attempts[0].cause == "crash"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    decision = c.events("recovery_decision", job_id=job)[0]
    assert decision.data["counts"] is False
    # Its one counted restart is still there for a real crash of the job.
    c.start(job)
    c.crash(job, rank=0)
    info = c.job(job)
    assert (info.state, len(info.attempts)) == ("starting", 3)
    assert c.decisions(job)[-1][:2] == ("restart", "restart after crash")


# -- no spare left ------------------------------------------------------------------------
def _wait_for_a_node(c: HealingCluster, job: int) -> None:
    c.start(job)
    c.agents["workers-1"].set_health("gpu", "fault", "XID 79")
    c.agents["workers-1"].beat()
    c.teardown(job)


def test_without_a_spare_the_job_waits_holding_its_healthy_nodes(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    info = c.job(job)
    assert info.state == "recovering"
    assert info.reason == "waiting for a healthy node to replace workers-1 (gpu_fault)"
    assert c.node_states() == {"workers-0": "allocated", "workers-1": "quarantined"}
    assert c.node("workers-0").job_id == job  # held while it waits
    assert c.node("workers-1").job_id is None
    assert c.decisions(job) == [
        ("wait", "waiting for a healthy node to replace workers-1 (gpu_fault)", ["workers-0"])
    ]
    # Waiting is quiet: stepping decides again, but records nothing new.
    events = len(c.controller.event_infos())
    c.tick(5)
    c.tick(5)
    assert len(c.controller.event_infos()) == events
    assert c.job(job).state == "recovering"
    assert c.agents["workers-0"].beat().launch == []

    # An operator brings the faulty node back: it is deep-checked and, healthy, rejoins.
    c.controller.node_action("workers-1", NodeAction(action="resume", reason="GPU reseated"))
    assert c.node("workers-1").state == "repairing"
    agent = c.agents["workers-1"]
    agent.set_health("gpu", "ok", "")
    agent.beat()
    agent.deep_check_result(None, "ok")
    agent.beat()
    assert c.node("workers-1").state == "idle"
    c.controller.step()
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[1].nodes == ["workers-0", "workers-1"]
    assert c.decisions(job)[-1][0] == "restart"
    c.start(job)
    c.finish(job)
    assert c.job(job).state == "completed"


def test_a_waiting_job_takes_a_spare_once_it_is_repaired(make: Make) -> None:
    c = make()
    c.controller.node_action("spares-0", NodeAction(action="quarantine", reason="flaky NIC"))
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    assert c.job(job).state == "recovering"
    c.controller.node_action("spares-0", NodeAction(action="resume", reason="NIC replaced"))
    spare = c.agents["spares-0"]
    spare.beat()
    spare.deep_check_result(None, "ok")
    spare.beat()
    c.controller.step()
    info = c.job(job)
    assert info.state == "starting"
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]


def test_with_min_nodes_the_job_shrinks_at_once(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True, min_nodes=1)
    _wait_for_a_node(c, job)
    info = c.job(job)
    assert info.state == "starting"
    two = info.attempts[1]
    assert two.nodes == ["workers-0"]
    assert [r.rank for r in two.ranks] == [0, 1]
    (decision,) = c.events("recovery_decision", job_id=job)
    assert decision.data["shrunk"] is True
    assert decision.data["reason"] == "continuing on 1 of 2 nodes (min_nodes 1) after gpu_fault"
    (launch,) = c.agents["workers-0"].beat().launch
    assert (launch.env["WORLD_SIZE"], launch.env["TRAINPOD_NNODES"]) == ("2", "1")


def test_cancel_while_waiting_cancels_and_releases(make: Make) -> None:
    c = make(groups=[WORKERS])
    job = c.submit(auto_resume=True)
    _wait_for_a_node(c, job)
    assert c.job(job).state == "recovering"
    row = c.controller.cancel(job)
    assert (row.state, row.reason) == ("cancelled", "cancelled while recovering")
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined"}
    assert {c.node(n).job_id for n in c.node_states()} == {None}
    c.tick(1)
    assert c.job(job).state == "cancelled"
    assert len(c.job(job).attempts) == 1


def test_cancel_during_a_fault_s_teardown_does_not_restart(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.agents["workers-1"].set_health("gpu", "fault", "XID 79")
    c.agents["workers-1"].beat()
    assert c.controller.cancel(job).state == "stopping"
    c.teardown(job)
    info = c.job(job)
    assert (info.state, len(info.attempts)) == ("cancelled", 1)
    assert c.node_states() == {"workers-0": "idle", "workers-1": "quarantined", "spares-0": "idle"}
    assert {c.node(n).job_id for n in c.node_states()} == {None}
    assert not c.events("recovery_decision", job_id=job)


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


# -- stragglers ---------------------------------------------------------------------------
def test_a_persistent_straggler_is_flagged_and_replaced_by_the_spare(make: Make) -> None:
    c = make(straggler_checks=3)
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(2):
        c.report(job, step, r3=3.0)
        c.tick(1)
    assert not c.events("straggler_detected")
    c.report(job, 2, r3=3.0)
    c.tick(1)
    (flag,) = c.events("straggler_detected", job_id=job)
    assert (flag.node, flag.attempt, flag.data["rank"], flag.data["step_time_s"]) == (
        "workers-1",
        1,
        3,
        3.0,
    )
    node = c.node("workers-1")
    assert node.state == "quarantined"
    assert node.reason == "straggler: rank 3 is persistently slower than its peers"
    info = c.job(job)
    assert (info.state, info.attempts[0].cause) == ("stopping", "straggler")
    c.teardown(job)
    info = c.job(job)
    assert info.attempts[1].nodes == ["workers-0", "spares-0"]
    assert c.decisions(job)[0][1] == "replaced workers-1 -> spares-0 after straggler"
    c.start(job)
    c.report(job, 3)  # the old attempt's book is gone; nothing is flagged twice
    c.tick(1)
    assert len(c.events("straggler_detected")) == 1


def test_a_straggler_must_be_slow_in_consecutive_fresh_reports(make: Make) -> None:
    c = make(straggler_checks=3)
    job = c.submit(auto_resume=True)
    c.start(job)
    c.report(job, 0, r3=3.0)
    c.tick(1)
    c.report(job, 1, r3=3.0)
    c.tick(1)
    for _ in range(3):  # stale reports (no new beat) are not evaluated again
        c.controller.step()
    c.report(job, 2, r3=1.0)  # caught up: the streak resets
    c.tick(1)
    c.report(job, 3, r3=3.0)
    c.tick(1)
    c.report(job, 4, r3=3.0)
    c.tick(1)
    assert not c.events("straggler_detected")
    assert c.job(job).state == "running"


def test_a_straggler_without_a_spare_is_only_flagged(make: Make) -> None:
    c = make(groups=[WORKERS], straggler_checks=2)
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(3):
        c.report(job, step, r0=3.0)
        c.tick(1)
    assert [e.data["rank"] for e in c.events("straggler_detected", job_id=job)] == [0]
    assert c.node("workers-0").state == "allocated"
    assert c.job(job).state == "running"


def test_a_straggler_is_not_replaced_by_a_spare_of_another_partition(make: Make) -> None:
    c = make(
        groups=[WORKERS, FakeGroup("other", 1, spare=True)],
        partitions={"main": ["workers"], "side": ["other"]},
        straggler_checks=2,
    )
    job = c.submit(auto_resume=True)
    c.start(job)
    for step in range(3):
        c.report(job, step, r2=3.0)
        c.tick(1)
    assert len(c.events("straggler_detected", job_id=job)) == 1
    assert c.node("workers-1").state == "allocated"  # nothing could take its place
    assert c.job(job).state == "running"


def test_without_auto_resume_a_straggler_is_only_flagged(make: Make) -> None:
    c = make(straggler_checks=2)
    job = c.submit()
    c.start(job)
    for step in range(3):
        c.report(job, step, r1=3.0)
        c.tick(1)
    assert len(c.events("straggler_detected", job_id=job)) == 1
    assert c.job(job).state == "running"
    assert c.node("spares-0").state == "idle"


# -- operators ----------------------------------------------------------------------------
def test_drain_keeps_new_work_off_a_node_but_leaves_its_job_alone(make: Make) -> None:
    c = make(groups=[FakeGroup("workers", 3)])
    running = c.submit(nodes=1)
    c.start(running)
    assert c.nodes_of(running) == ["workers-0"]
    row = c.controller.node_action("workers-0", NodeAction(action="drain", reason="kernel update"))
    assert (row.state, row.drained) == ("allocated", True)
    c.controller.node_action("workers-1", NodeAction(action="drain", reason="kernel update"))
    assert c.node("workers-1").reason == "drained (operator: kernel update)"
    job = c.submit(nodes=1)
    c.controller.step()
    assert c.nodes_of(job) == ["workers-2"]  # not the drained idle node
    assert c.job(running).state == "running"
    c.tick(1)
    assert c.job(running).state == "running"
    c.finish(running)
    assert c.job(running).state == "completed"
    assert (c.node("workers-0").state, c.node("workers-0").drained) == ("idle", True)
    queued = c.submit(nodes=1)
    c.controller.step()
    assert c.job(queued).state == "queued"  # two drained nodes, one busy
    c.controller.node_action("workers-1", NodeAction(action="resume", reason="done"))
    assert (c.node("workers-1").state, c.node("workers-1").drained) == ("idle", False)
    c.controller.step()
    assert c.nodes_of(queued) == ["workers-1"]
    assert [e.kind for e in c.events(node="workers-1")][-3:-1] == ["node_drain", "node_resume"]


def test_an_operator_quarantine_stops_the_job_and_never_repairs_on_its_own(make: Make) -> None:
    c = make()
    repairer = FakeRepairer()
    c.controller.repairer = repairer
    job = c.submit(auto_resume=True)
    c.start(job)
    c.controller.node_action("workers-0", NodeAction(action="quarantine", reason="bad DIMM"))
    node = c.node("workers-0")
    assert (node.state, node.reason) == ("quarantined", "operator: bad DIMM")
    info = c.job(job)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "quarantined",
    )
    c.teardown(job)
    assert c.job(job).attempts[1].nodes == ["spares-0", "workers-1"]
    for _ in range(3):
        c.tick(1)
    assert c.node("workers-0").state == "quarantined"
    assert repairer.calls == []
    assert c.events("node_quarantine", node="workers-0")[0].data["reason"] == "bad DIMM"


def test_resume_deep_checks_a_quarantined_node_before_it_returns(make: Make) -> None:
    c = make(groups=[WORKERS])
    c.controller.node_action("workers-1", NodeAction(action="quarantine", reason="suspicious"))
    row = c.controller.node_action("workers-1", NodeAction(action="resume", reason="looks fine"))
    assert (row.state, row.reason) == ("repairing", "repairing (check)")
    agent = c.agents["workers-1"]
    orders = agent.beat()  # the same agent: a check, not a replacement
    assert orders.deep_check is not None
    job = c.submit(nodes=2)
    c.controller.step()
    assert c.job(job).state == "queued"  # not schedulable while it is checked
    agent.deep_check_result(orders.deep_check.id, "ok")
    agent.beat()
    assert c.node("workers-1").state == "idle"
    c.controller.step()
    assert c.job(job).state == "starting"


def test_replace_needs_a_backend_that_can_replace_nodes(make: Make) -> None:
    c = make(groups=[WORKERS])
    with pytest.raises(Conflict, match="cannot replace nodes"):
        c.controller.node_action("workers-0", NodeAction(action="replace", reason="old"))
    assert c.node("workers-0").state == "idle"
    assert not c.events("node_replace")  # the refusal left no trace

    repairer = FakeRepairer()
    c.controller.repairer = repairer
    c.controller.node_action("workers-0", NodeAction(action="replace", reason="old"))
    assert c.node("workers-0").state == "quarantined"
    c.controller.step()
    assert c.node("workers-0").state == "repairing"
    assert repairer.wait_for(1) == ["workers-0"]


# -- chaos --------------------------------------------------------------------------------
def test_a_chaos_order_reaches_the_agent_until_it_is_acknowledged(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    order = c.controller.chaos(ChaosRequest(node="workers-1", fault="xid79"))
    assert (order.fault, order.rank) == ("xid79", None)
    (event,) = c.events("chaos_injected", node="workers-1")
    assert (event.job_id, event.data["fault"], event.data["id"]) == (job, "xid79", order.id)
    agent = c.agents["workers-1"]
    agent.ack_chaos = False
    assert agent.beat().chaos == [order]
    assert agent.beat().chaos == [order]  # still pending: not acknowledged
    agent.ack_chaos = True
    assert agent.heartbeat().chaos_done == [order.id]
    assert agent.beat().chaos == []
    assert agent.chaos == [order]  # recorded once
    assert c.agents["workers-0"].beat().chaos == []

    kill = c.controller.chaos(ChaosRequest(node="workers-1", fault="kill-worker"))
    assert kill.rank == 2  # the node's first running rank
    slow = c.controller.chaos(ChaosRequest(node="workers-1", fault="slow", rank=3))
    assert [o.id for o in agent.beat().chaos] == [kill.id, slow.id]


def test_a_fault_that_needs_a_rank_is_refused_without_one(make: Make) -> None:
    c = make()
    for fault in ("kill-worker", "hang", "slow"):
        with pytest.raises(Conflict, match="needs a running rank on workers-0"):
            c.controller.chaos(ChaosRequest(node="workers-0", fault=fault))  # type: ignore[arg-type]
    job = c.submit(nodes=1)
    c.start(job)
    with pytest.raises(Conflict, match="rank 5 is not running on workers-0"):
        c.controller.chaos(ChaosRequest(node="workers-0", fault="hang", rank=5))
    assert c.controller.chaos(ChaosRequest(node="workers-1", fault="disk-full")).rank is None
    assert not c.events("chaos_injected", fault="hang")


def test_chaos_needs_a_running_agent(make: Make) -> None:
    c = make()
    c.agents["workers-0"].beat(leaving=True)
    assert c.node("workers-0").state == "stopped"
    with pytest.raises(Conflict, match="no running agent"):
        c.controller.chaos(ChaosRequest(node="workers-0", fault="xid79"))


# -- goodput inputs -----------------------------------------------------------------------
def test_beacons_give_first_beacon_and_attempt_progress_events(make: Make) -> None:
    c = make()
    job = c.submit(auto_resume=True)
    c.start(job)
    c.tick(4)  # start-up: no beacon yet
    first_at = c.clock.now()
    for step in range(10, 15):
        c.report(job, step, step_time=0.5)
        c.tick(1)
    c.report(job, 15, step_time=0.5)
    c.agents["workers-0"].progress(c.attempt_id(job), 0, 16, checkpoint_step=15)
    c.tick(1)
    (first,) = c.events("first_beacon", job_id=job)
    assert (first.attempt, first.data["at"], first.data["step"]) == (1, first_at, 10)
    assert first.ts == first_at + 1  # the beat that carried it
    assert not c.events("attempt_progress", job_id=job)  # only at the end of the attempt

    c.crash(job, rank=2)
    (progress,) = c.events("attempt_progress", job_id=job)
    assert progress.attempt == 1
    assert progress.data["first_step"] == 10
    assert progress.data["last_step"] == 15  # the step every rank finished
    assert progress.data["step_time_s"] == 0.5
    assert progress.data["first_beacon_at"] == first_at
    assert progress.data["last_beacon_at"] == first_at + 5
    assert progress.data["last_checkpoint_step"] == 15
    assert progress.data["ranks"] == 4

    c.start(job)
    c.report(job, 16, step_time=0.5)
    c.tick(1)
    c.report(job, 17, step_time=0.5)
    c.tick(1)
    c.finish(job)
    assert c.job(job).state == "completed"
    assert [e.attempt for e in c.events("first_beacon", job_id=job)] == [1, 2]
    assert [
        (e.attempt, e.data["first_step"], e.data["last_step"])
        for e in c.events("attempt_progress", job_id=job)
    ] == [(1, 10, 15), (2, 16, 17)]
    assert c.story(job, ["first_beacon", "fault_detected", "attempt_progress"]) == [
        ("first_beacon", 1),
        ("fault_detected", 1),
        ("attempt_progress", 1),
        ("first_beacon", 2),
        ("attempt_progress", 2),
    ]


def test_an_attempt_without_beacons_records_no_progress(make: Make) -> None:
    c = make()
    job = c.submit()
    c.start(job)
    c.finish(job)
    assert not c.events("first_beacon") and not c.events("attempt_progress")


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
