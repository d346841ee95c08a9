"""The controller with an external scheduler (Slurm's seam, faked): placement inside the
job's allocation, spares from it, requeue without the bad node, Slurm's own view."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from trainpod.api.models import HealthResult, JobInfo, NodeAction, NodeInfo
from trainpod.controller.core import Controller
from trainpod.controller.ops import ClusterOps, ExternalJob, ExternalNode, Observed
from trainpod.errors import SpecError
from trainpod.slurm.cli import SlurmError
from trainpod.slurm.scheduling import slurm_scheduling
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config

NODES = ["node1", "node2", "node3", "node4"]


class FakeSlurm(ClusterOps):
    places_jobs = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.next_id = 100
        self.refuse_resume: list[SlurmError] = []  # raised, one per call, before resuming

    def render(self, job_id: int, spec: JobSpec) -> str:
        return f"#!/bin/bash\n# job {job_id}: {spec.nodes}+{spec.spares}\n"

    def submit(self, job_id: int, spec: JobSpec) -> str:
        self.next_id += 1
        self.calls.append(("submit", str(job_id), str(spec.nodes + spec.spares)))
        return str(self.next_id)

    def cancel(self, external: str) -> None:
        self.calls.append(("cancel", external))

    def requeue(self, external: str, exclude: list[str]) -> None:
        self.calls.append(("requeue", external, *exclude))

    def drain(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node))

    def release(self, external: str) -> None:
        self.calls.append(("release", external))

    def resume(self, node: str) -> None:
        if self.refuse_resume:
            raise self.refuse_resume.pop()
        self.calls.append(("resume", node))


class Slurmish:
    def __init__(self, root: Path) -> None:
        cfg = make_config(root, groups=(FakeGroup("workers", 4, devices=1),))
        cfg = replace(
            cfg,
            backend="slurm",
            nodes=[replace(d, name=n) for d, n in zip(cfg.nodes, NODES, strict=True)],
        )
        self.clock = FakeClock()
        self.ops = FakeSlurm()
        self.controller = Controller(
            Store.open(root / "db.sqlite"),
            cfg,
            clock=self.clock,
            scheduling=slurm_scheduling(self.ops),
        )
        self.controller.bootstrap()
        self.agents: dict[str, FakeAgent] = {}

    def allocate(self, job_id: int, nodes: list[str], round_: int = 0) -> None:
        """Slurm runs the job: an agent per node registers with its allocation."""
        for n in nodes:
            a = FakeAgent(self.controller, n)
            a.allocation = {
                "allocation": job_id,
                "allocation_round": round_,
                "external_id": "",
                "group": "workers",
                "devices": 1,
            }
            self.agents[n] = a
            a.beat()

    def start(self, job_id: int) -> list[str]:
        self.controller.step()
        nodes = self.job(job_id).attempts[-1].nodes
        for n in nodes:
            self.agents[n].start_ranks(self.agents[n].beat())
            self.agents[n].beat()
        return nodes

    def job(self, job_id: int) -> JobInfo:
        return self.controller.job_info(job_id)

    def node(self, name: str) -> NodeInfo:
        return next(n for n in self.controller.node_infos() if n.name == name)

    def submit(self, nodes: int = 2, **kw: object) -> int:
        spec = JobSpec(command=["train"], nodes=nodes, procs_per_node=1, **kw)
        return self.controller.submit(spec)

    def gpu_fault(self, node: str) -> None:
        a = self.agents[node]
        a.health["gpu"] = HealthResult(check="gpu", status="fault", reason="XID 79")
        a.beat()

    def teardown(self, nodes: list[str]) -> None:
        for n in nodes:
            self.agents[n].kill_ranks(self.agents[n].beat())
        for n in nodes:
            self.agents[n].beat()
        self.controller.step()

    def kinds(self, job_id: int) -> list[str]:
        return [e.kind for e in self.controller.event_infos(job_id=job_id)]


@pytest.fixture
def s(tmp_path: Path) -> Iterator[Slurmish]:
    c = Slurmish(tmp_path)
    yield c
    c.controller.store.close()


def test_submit_goes_to_slurm_and_nodes_appear_with_the_allocation(s: Slurmish) -> None:
    job = s.submit(2, spares=1)
    assert s.ops.calls == [("submit", str(job), "3")]
    assert s.job(job).external == "101" and s.job(job).state == "queued"
    assert s.controller.node_infos() == []  # Slurm nodes appear when an agent registers
    s.allocate(job, ["node2"])
    s.controller.step()
    assert s.job(job).state == "queued"  # one agent of two
    s.allocate(job, ["node3"])
    s.controller.step()
    # Enough agents for the ranks: it starts; the spare joins as soon as its agent is up.
    assert s.job(job).state == "starting" and s.job(job).attempts[-1].nodes == ["node2", "node3"]
    s.allocate(job, ["node4"])
    assert s.node("node4").allocation == job and s.node("node4").state == "idle"


def test_a_job_starts_on_its_own_allocation_only(s: Slurmish) -> None:
    first = s.submit(2, spares=1)
    second = s.submit(1)
    s.allocate(second, ["node1"])
    nodes = s.start(second)
    assert nodes == ["node1"]
    s.allocate(first, ["node2", "node3", "node4"])
    assert s.start(first) == ["node2", "node3"]
    assert s.node("node4").allocation == first and s.node("node4").state == "idle"


def test_a_gpu_fault_drains_and_the_spare_in_the_allocation_takes_over(s: Slurmish) -> None:
    job = s.submit(2, spares=1, auto_resume=True)
    s.allocate(job, ["node1", "node2", "node3"])
    nodes = s.start(job)
    s.gpu_fault(nodes[1])
    assert ("drain", nodes[1]) in s.ops.calls
    s.teardown(nodes)
    attempt = s.job(job).attempts[-1]
    assert attempt.number == 2 and sorted(attempt.nodes) == ["node1", "node3"]
    assert not any(c[0] == "requeue" for c in s.ops.calls)


def test_without_a_spare_the_job_is_requeued_and_old_agents_leave(s: Slurmish) -> None:
    job = s.submit(2, auto_resume=True)
    s.allocate(job, ["node1", "node2"])
    nodes = s.start(job)
    s.gpu_fault("node1")
    s.teardown(nodes)
    assert ("requeue", "101", "node1") in s.ops.calls
    info = s.job(job)
    assert info.state == "queued" and "requeued" in info.reason
    assert "job_requeued" in s.kinds(job)
    # The old allocation's agents (round 0) are told to leave and never used again.
    assert s.agents["node2"].beat().leave == 1
    s.controller.step()
    assert len(s.job(job).attempts) == 1
    # Slurm runs it again (restart 1) on node2 and node3.
    s.allocate(job, ["node2", "node3"], round_=1)
    assert s.start(job) == ["node2", "node3"]
    attempt = s.job(job).attempts[-1]
    assert attempt.number == 2
    assert s.controller.store.attempts(job)[-1].restart_reason.startswith("requeued")


def test_agents_leave_with_the_job_result(s: Slurmish) -> None:
    job = s.submit(1, spares=1)
    s.allocate(job, ["node1", "node2"])
    nodes = s.start(job)
    s.agents[nodes[0]].exit_all(s.controller.store.attempts(job)[-1].id)
    s.agents[nodes[0]].beat()
    assert s.job(job).state == "completed"
    assert s.agents["node1"].beat().leave == 0 and s.agents["node2"].beat().leave == 0


def test_slurm_ending_the_job_ends_it_here(s: Slurmish) -> None:
    job = s.submit(2)
    s.allocate(job, ["node1", "node2"])
    s.start(job)
    s.controller.observe(Observed(jobs={"101": ExternalJob("101", "TIMEOUT")}, nodes={}))
    info = s.job(job)
    assert info.state == "failed" and "TIMEOUT" in info.reason
    # Its agents are gone with the allocation: not a node fault.
    s.clock.advance(60)
    s.controller.step()
    assert {s.node(n).state for n in ("node1", "node2")} == {"stopped"}


def test_a_node_slurm_marks_down_is_quarantined_and_drained(s: Slurmish) -> None:
    job = s.submit(2, spares=1, auto_resume=True)
    s.allocate(job, ["node1", "node2", "node3"])
    nodes = s.start(job)
    down = ExternalNode(nodes[0], "DOWN", frozenset({"NOT_RESPONDING"}), "Not responding")
    s.controller.observe(Observed(jobs={}, nodes={nodes[0]: down}))
    assert s.node(nodes[0]).state == "quarantined"
    assert ("drain", nodes[0]) in s.ops.calls
    assert "external_node_down" in [e.kind for e in s.controller.event_infos()]


def test_pending_reasons_come_from_slurm(s: Slurmish) -> None:
    job = s.submit(2)
    s.controller.observe(
        Observed(jobs={"101": ExternalJob("101", "PENDING", "Dependency")}, nodes={})
    )
    assert s.job(job).reason == "pending in Slurm: Dependency"


def test_cancel_scancels(s: Slurmish) -> None:
    job = s.submit(2)
    s.controller.cancel(job)
    assert ("cancel", "101") in s.ops.calls and s.job(job).state == "cancelled"


def test_slurm_options_are_refused_on_the_embedded_backend(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    c = Controller(Store.open(tmp_path / "db.sqlite"), cfg, clock=FakeClock())
    c.bootstrap()
    with pytest.raises(SpecError, match="--spares, --nice only apply on a Slurm cluster"):
        c.submit(JobSpec(command=["x"], spares=1, nice=3, time_limit="10"))
    c.store.close()


def test_a_requeue_by_slurm_itself_ends_the_attempt_and_waits_for_the_new_allocation(
    s: Slurmish,
) -> None:
    job = s.submit(2, spares=1, auto_resume=True)
    s.allocate(job, ["node1", "node2", "node3"])
    s.start(job)
    # The batch host died: Slurm requeued the job on its own (NODE_FAIL, --requeue).
    s.controller.observe(
        Observed(jobs={"101": ExternalJob("101", "PENDING", "BeginTime", restarts=1)}, nodes={})
    )
    info = s.job(job)
    assert info.state == "queued" and "Slurm requeued" in info.reason
    assert info.attempts[-1].state == "failed"
    assert s.agents["node2"].beat().leave == 1  # the old allocation's agents leave
    s.allocate(job, ["node2", "node4"], round_=1)
    assert s.start(job) == ["node2", "node4"]
    assert s.job(job).attempts[-1].number == 2


def test_slurm_preempting_the_allocation_is_a_preemption_and_its_requeue_waits_as_preempted(
    s: Slurmish,
) -> None:
    job = s.submit(2, spares=1)
    s.allocate(job, ["node1", "node2", "node3"])
    nodes = s.start(job)
    attempt = s.controller.store.attempts(job)[-1].id
    # Slurm chose the job: its batch trap wrote the notice, each agent reports it.
    for n in ["node1", "node2", "node3"]:
        s.agents[n].allocation["preempted_at"] = s.clock.now()
        s.agents[n].beat()
    info = s.job(job)
    assert info.state == "stopping" and "preempted by Slurm" in info.reason
    orders = s.agents[nodes[0]].beat()
    kill = next(k for k in orders.kill if k.attempt_id == attempt)  # the controller's notice
    assert kill.notice_signal == "SIGUSR1"  # given locally already: launcher.kill is idempotent
    for n in nodes:  # the ranks saved on the notice and exited 0
        s.agents[n].exit_all(attempt, 0)
        s.agents[n].beat()
    s.controller.step()
    info = s.job(job)
    assert info.state == "preempted", info.reason
    assert info.attempts[-1].state == "failed" and info.attempts[-1].cause == "preempted"
    assert len(info.attempts) == 1  # not restarted on the allocation Slurm takes back
    # After its GraceTime Slurm ends the allocation and requeues the job (PreemptMode=REQUEUE).
    s.controller.observe(
        Observed(jobs={"101": ExternalJob("101", "PENDING", "BeginTime", restarts=1)}, nodes={})
    )
    info = s.job(job)
    assert info.state == "preempted" and "Slurm preempted and requeued" in info.reason
    kinds = s.kinds(job)
    assert "job_preempted" in kinds and "job_requeued" in kinds
    assert "fault_detected" not in kinds and "recovery_decision" not in kinds
    s.allocate(job, ["node2", "node4", "node1"], round_=1)
    assert sorted(s.start(job)) == ["node1", "node2"]
    assert s.job(job).attempts[-1].number == 2 and s.job(job).state == "running"


def test_a_late_notice_from_the_last_allocation_does_not_stop_the_new_one(s: Slurmish) -> None:
    job = s.submit(1)
    s.allocate(job, ["node1"])
    s.start(job)
    old = s.agents["node1"]
    old.allocation["preempted_at"] = s.clock.now()
    old.beat()
    old.exit_all(s.controller.store.attempts(job)[-1].id, 0)
    old.beat()
    s.controller.step()
    assert s.job(job).state == "preempted"
    # Slurm runs it again (round 1) before the controller has seen the requeue; the last
    # round's agent, not yet gone, still reports its notice.
    s.allocate(job, ["node2"], round_=1)
    assert s.start(job) == ["node2"]
    old.beat()
    info = s.job(job)
    assert info.state == "running" and len(info.attempts) == 2, info.reason


def test_a_job_slurm_held_after_a_failed_launch_is_released(s: Slurmish) -> None:
    job = s.submit(2)
    held = ExternalJob("101", "PENDING", "launch failed requeued held")
    s.controller.observe(Observed(jobs={"101": held}, nodes={}))
    s.controller.observe(Observed(jobs={"101": held}, nodes={}))
    assert s.ops.calls.count(("release", "101")) == 1
    assert s.job(job).reason == "pending in Slurm: launch failed requeued held"
    assert "external_released" in s.kinds(job)


def test_ranks_on_a_node_slurm_took_down_are_lost_when_its_agent_goes_silent(
    s: Slurmish,
) -> None:
    job = s.submit(2, spares=1, auto_resume=True)
    s.allocate(job, ["node1", "node2", "node3"])
    s.start(job)
    down = ExternalNode("node1", "DOWN", frozenset({"NOT_RESPONDING"}), "Not responding")
    s.controller.observe(Observed(jobs={}, nodes={"node1": down}))
    assert s.node("node1").state == "quarantined"
    # node1's agent never answers again; the others tear their ranks down.
    s.clock.advance(30)
    for n in ("node2", "node3"):
        s.agents[n].kill_ranks(s.agents[n].beat())
        s.agents[n].beat()
    s.controller.step()
    attempt = s.job(job).attempts[-1]
    assert attempt.number == 2 and sorted(attempt.nodes) == ["node2", "node3"]


def test_a_slurm_job_that_outlives_its_trainpod_job_is_cancelled(s: Slurmish) -> None:
    job = s.submit(1)
    s.allocate(job, ["node1"])
    (node,) = s.start(job)
    s.agents[node].exit_all(s.controller.store.attempts(job)[-1].id)
    s.agents[node].beat()
    assert s.job(job).state == "completed"
    running = Observed(jobs={"101": ExternalJob("101", "RUNNING")}, nodes={})
    s.controller.observe(running)
    assert ("cancel", "101") not in s.ops.calls  # its agents may still be leaving
    s.clock.advance(11)
    s.controller.observe(running)
    s.controller.observe(running)
    assert s.ops.calls.count(("cancel", "101")) == 1
    assert "external_reaped" in s.kinds(job)


def test_a_resume_slurm_refused_is_retried_until_it_takes(s: Slurmish) -> None:
    job = s.submit(2)
    s.allocate(job, ["node1", "node2"])
    s.ops.refuse_resume = [SlurmError("scontrol: error: Socket timed out on send/recv")]
    s.controller.node_action("node1", NodeAction(action="resume", reason="fixed"))
    (error,) = [e for e in s.controller.event_infos() if e.kind == "external_error"]
    assert error.data["action"] == "resume" and "timed out" in error.data["error"]
    drained = ExternalNode("node1", "IDLE", frozenset({"DRAIN"}))
    s.controller.observe(Observed(jobs={}, nodes={"node1": drained}))
    assert s.ops.calls.count(("resume", "node1")) == 1  # the retry took
    s.controller.observe(Observed(jobs={}, nodes={"node1": replace(drained, flags=frozenset())}))
    assert s.ops.calls.count(("resume", "node1")) == 1  # and is not repeated
