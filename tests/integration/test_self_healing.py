"""Self-healing end to end: one real fault per class, injected into a real training job.

Each test runs ``workers/beacon_train.py`` (Gloo DDP, progress beacons, checkpoints every
few steps, per-rank progress files) with ``--auto-resume`` on a real local cluster of two
workers and a hot spare, injects a fault through the chaos API once the job has made
progress, and checks that the job completes with nothing lost beyond its last checkpoint,
and that the events tell the story: the fault class, the recovery decision, the new attempt
and the node states.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster, pid_alive
from trainpod.api.models import ChaosRequest, EventInfo, JobInfo
from trainpod.client.http import TrainpodClient
from trainpod.controller.policy import TEARDOWN_TERMINATE
from trainpod.telemetry.goodput import BUCKETS, compute_goodput
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
TRAIN = Path(__file__).parent / "workers" / "beacon_train.py"

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 2
  - name: spares
    count: 1
    devices_per_node: 2
    spare: true
storage:
  node_scratch_quota_gib: 0.05
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 4
  check_interval_s: 0.5
  hang_timeout_s: 4
  straggler_factor: 1.4
  straggler_checks: 3
recovery:
  teardown_grace_s: 2
  deep_check_timeout_s: 60
"""
HANG_TIMEOUT_S = 4.0
HEARTBEAT_TIMEOUT_S = 4.0
STEPS = 70
CKPT_EVERY = 10


@pytest.fixture
def cluster(make_cluster_from_spec: Callable[[str], Cluster]) -> Cluster:
    return make_cluster_from_spec(SPEC)


# -- the training job and what it leaves behind ----------------------------------------
@dataclass
class Training:
    cluster: Cluster
    job_id: int
    ckpt: Path
    world: int
    steps: int

    @property
    def client(self) -> TrainpodClient:
        return self.cluster.client

    def lines(self, rank: int) -> list[tuple[int, str, int]]:
        """(attempt, "resume" | "step", step) per line of the rank's progress file."""
        path = self.ckpt / f"progress-rank{rank}.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            m = re.fullmatch(r"attempt=(\d+) (resume|step)=(\d+)", line)
            if m:  # lines are written whole (line-buffered); anything else is not ours
                out.append((int(m.group(1)), m.group(2), int(m.group(3))))
        return out

    def reached(self, attempt: int, step: int) -> bool:
        """Every rank finished ``step`` (or later) in ``attempt``."""
        return all(
            any(a == attempt and k == "step" and s >= step for a, k, s in self.lines(r))
            for r in range(self.world)
        )

    def wait_progress(self, attempt: int = 1, step: int = 2 * CKPT_EVERY - 5) -> None:
        """Past a checkpoint (and between two), so the fault costs some steps."""
        wait_until(
            lambda: self.reached(attempt, step),
            timeout_s=45,
            what=f"attempt {attempt} of job {self.job_id} to reach step {step}",
        )

    def checkpoints(self) -> dict[int, dict[str, Any]]:
        return {int(p.name[5:11]): json.loads(p.read_text()) for p in self.ckpt.glob("ckpt-*.json")}

    def chaos(self, node: str, fault: str, rank: int | None = None) -> EventInfo:
        order = self.client.chaos(ChaosRequest(node=node, fault=fault, rank=rank))
        (ev,) = [e for e in self.events("chaos_injected") if e.data["id"] == order.id]
        return ev

    def wait(self, timeout_s: float = 60) -> JobInfo:
        return self.cluster.wait_job(self.job_id, timeout_s=timeout_s)

    def events(self, kind: str | None = None) -> list[EventInfo]:
        evs = self.client.events(job_id=self.job_id)
        return [e for e in evs if kind is None or e.kind == kind]

    def check_nothing_lost(self, attempts: int) -> int:
        """The job's final attempt resumed right after the newest checkpoint of the earlier
        ones and did every step from there to the end, once, on every rank; the result is
        the one an uninterrupted run gives. Returns the resume step."""
        done = self.client.job(self.job_id)
        assert done.state == "completed", done.reason
        assert len(done.attempts) == attempts, [(a.number, a.cause) for a in done.attempts]
        final = attempts
        earlier = [c["step"] for c in self.checkpoints().values() if c["attempt"] < final]
        resume = max(earlier, default=0) + 1
        for rank in range(self.world):
            mine = [(k, s) for a, k, s in self.lines(rank) if a == final]
            assert mine[0] == ("resume", resume), (rank, mine[:3], sorted(earlier))
            assert [s for k, s in mine[1:]] == list(range(resume, self.steps + 1)), rank
            for attempt in range(1, final):  # earlier attempts got past what they saved
                steps = [s for a, k, s in self.lines(rank) if a == attempt and k == "step"]
                saved = [c for c in earlier if self.checkpoints()[c]["attempt"] == attempt]
                assert not saved or max(steps) >= max(saved), (rank, attempt)
        w, n = self.world, self.steps
        expected = w * (w + 1) // 2 * n * (n + 1) // 2
        log = self.client.logs(self.job_id, rank=0, attempt=final).data
        assert f"done steps={n} value={expected}" in log, log[-500:]
        return resume

    # -- the story ------------------------------------------------------------------------
    def one(self, kind: str, **match: Any) -> EventInfo:
        found = [e for e in self.events(kind) if _matches(e, match)]
        assert len(found) == 1, (kind, match, [(e.attempt, e.node, e.data) for e in found])
        return found[0]

    def decision(self, attempt: int) -> EventInfo:
        return self.one("recovery_decision", attempt=attempt)

    def fault(self, attempt: int) -> EventInfo:
        return self.one("fault_detected", attempt=attempt)


def _matches(e: EventInfo, match: dict[str, Any]) -> bool:
    for key, want in match.items():
        have = getattr(e, key) if key in ("attempt", "node") else e.data.get(key)
        if have != want:
            return False
    return True


def train(
    cluster: Cluster,
    *,
    steps: int = STEPS,
    nodes: int = 2,
    procs: int = 1,
    step_s: float = 0.05,
    extra: tuple[str, ...] = (),
    **spec: Any,
) -> Training:
    argv = ["python", str(TRAIN), "--steps", str(steps), "--ckpt-every", str(CKPT_EVERY)]
    argv += ["--step-s", str(step_s), *extra]
    job = cluster.submit(argv, nodes=nodes, procs_per_node=procs, auto_resume=True, **spec)
    ckpt = Path(cluster.record.checkpoint_uri.removeprefix("file://")) / f"job-{job.id}"
    return Training(cluster, job.id, ckpt, nodes * procs, steps)


def node_moves(cluster: Cluster, node: str, since: float) -> list[str]:
    """The node's states, in order, from ``since`` on (the first is the state it left)."""
    evs = [e for e in cluster.client.events(node=node) if e.kind == "node_state" and e.ts >= since]
    return [evs[0].data["old"], *(e.data["new"] for e in evs)] if evs else []


def wait_node(cluster: Cluster, node: str, state: str, timeout_s: float = 45) -> None:
    wait_until(
        lambda: next(n for n in cluster.client.nodes() if n.name == node).state == state,
        timeout_s=timeout_s,
        what=f"{node} to be {state}",
    )


def check_replaced_and_repaired(t: Training, bad: str, since: float, lost: bool = False) -> None:
    """``bad`` was quarantined (after being suspect, if ``lost``), the spare took its place,
    and the backend replaced ``bad`` with a fresh instance that passed the deep check and is
    back in the pool.

    On a loaded machine one round of repair may fail (a deep check's device process starved
    past its grace): the node is then quarantined and repaired again, as designed. Such a
    round must say why it failed; the last one must pass."""
    wait_node(t.cluster, bad, "idle", timeout_s=90)
    suspect = ["suspect"] if lost else []
    moves = node_moves(t.cluster, bad, since)
    node_evs = [e for e in t.client.events(node=bad) if e.ts >= since]
    failed = [
        e.data["reason"]
        for e in node_evs
        if e.kind == "node_state"
        and e.data["old"] == "repairing"
        and e.data["new"] == "quarantined"
    ]
    assert moves == [
        "allocated",
        *suspect,
        "quarantined",
        *["repairing", "quarantined"] * len(failed),
        "repairing",
        "idle",
    ], (moves, failed)
    assert len(failed) <= 1, f"more than one failed repair round: {failed}"
    assert all(r.startswith("repair 1 failed: ") for r in failed), failed
    kinds = [e.kind for e in node_evs]
    assert "deep_check_started" in kinds and "node_repaired" in kinds
    deeps = [e for e in node_evs if e.kind == "deep_check_finished"]
    assert deeps and deeps[-1].data["status"] == "ok", [d.data for d in deeps]
    registered = [e for e in node_evs if e.kind == "agent_registered"]
    assert registered and registered[-1].data["restarted"] is True  # a new instance
    assert node_moves(t.cluster, "spares-0", since) == ["idle", "allocated", "idle"]


# -- crash --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_killed_worker_restarts_in_place_from_the_last_checkpoint(cluster: Cluster) -> None:
    t = train(cluster)
    t.wait_progress()
    t.chaos("workers-1", "kill-worker", rank=1)
    t.wait()
    resume = t.check_nothing_lost(attempts=2)
    assert resume > 1  # the first attempt's checkpoints were used

    fault = t.fault(1)
    assert (fault.node, fault.data["fault"], fault.data["rank"]) == ("workers-1", "crash", 1)
    assert fault.data["reason"] == "rank 1 on workers-1 was killed by signal 9"
    d = t.decision(1).data
    assert (d["action"], d["nodes"], d["replaced"]) == (
        "restart",
        ["workers-0", "workers-1"],
        {},
    )
    assert d["counts"] is True  # a crash uses up one of max_restarts
    created = t.one("attempt_created", attempt=2)
    assert created.data["nodes"] == ["workers-0", "workers-1"]  # the same nodes
    assert created.data["restart_reason"].startswith("crash: rank 1 on workers-1")
    job = t.client.job(t.job_id)
    assert [(a.state, a.cause) for a in job.attempts] == [("failed", "crash"), ("succeeded", "")]
    assert all(n.state == "idle" for n in t.client.nodes())  # nobody was quarantined
    moves = {e.data["new"] for e in t.client.events() if e.kind == "node_state"}
    assert not moves & {"suspect", "quarantined", "repairing"}, moves


def test_max_restarts_is_honoured_for_repeated_crashes(cluster: Cluster) -> None:
    t = train(cluster, steps=400, max_restarts=1)
    t.wait_progress()
    t.chaos("workers-1", "kill-worker", rank=1)
    t.wait_progress(attempt=2, step=max(t.checkpoints()) + 3)
    t.chaos("workers-0", "kill-worker", rank=0)
    done = t.wait()
    assert done.state == "failed"
    assert "gave up after 1 restarts (max_restarts)" in done.reason, done.reason
    assert [(a.number, a.cause) for a in done.attempts] == [(1, "crash"), (2, "crash")]
    assert [e.data["action"] for e in t.events("recovery_decision")] == ["restart", "fail"]
    assert [e.attempt for e in t.events("attempt_created")] == [1, 2]
    cluster.wait_idle()


# -- user error ---------------------------------------------------------------------------
def test_a_repeated_user_error_is_retried_once_then_fails_with_its_log(cluster: Cluster) -> None:
    t = train(cluster, extra=("--fail-at", "3"))
    done = t.wait()
    assert done.state == "failed"
    assert done.reason.startswith("user error: the same failure twice on healthy nodes")
    assert "RuntimeError: bad batch at step 3" in done.reason  # the log tail
    assert [(a.number, a.state, a.cause) for a in done.attempts] == [
        (1, "failed", "crash"),
        (2, "failed", "crash"),
    ]
    decisions = [(e.attempt, e.data["action"]) for e in t.events("recovery_decision")]
    assert decisions == [(1, "restart"), (2, "fail")]
    assert [e.attempt for e in t.events("attempt_created")] == [1, 2]
    assert [(f.data["fault"], f.data["rank"]) for f in t.events("fault_detected")] == [
        ("crash", 0),
        ("crash", 0),
    ]
    cluster.wait_idle()


def test_a_user_error_that_aborts_in_its_teardown_is_still_the_same_failure(
    cluster: Cluster,
) -> None:
    # attempt 1's ranks raise, print their traceback, then die of SIGABRT while the
    # interpreter finalizes (pytorch/pytorch#179291); attempt 2's raise the same and exit 1
    t = train(cluster, extra=("--fail-at", "3", "--abort-on-attempt", "1"))
    done = t.wait()
    assert done.state == "failed"
    assert done.reason.startswith("user error: the same failure twice on healthy nodes")
    assert [(a.number, a.cause) for a in done.attempts] == [(1, "crash"), (2, "crash")]
    exits = [(e.attempt, e.data["signal"], e.data["exit_code"]) for e in t.events("rank_exited")]
    assert (1, 6, None) in exits and (2, None, 1) in exits, exits
    tails = [e.data.get("log_tail") or "" for e in t.events("rank_exited") if e.attempt == 1]
    assert any("RuntimeError: bad batch at step 3" in tail for tail in tails), tails
    cluster.wait_idle()


def test_a_finished_run_whose_rank_aborts_in_its_teardown_completes_without_a_restart(
    cluster: Cluster,
) -> None:
    # rank 1 dies of SIGABRT at its interpreter's teardown after the run finished, a second
    # before rank 0 exits 0 (pytorch/pytorch#179291, ADR 0044): one attempt, completed
    t = train(cluster, extra=("--teardown-abort-rank", "1"))
    done = t.wait()
    assert done.state == "completed", (done.reason, done.attempts)
    assert [(a.number, a.state) for a in done.attempts] == [(1, "succeeded")]
    assert "rank 1 aborted (SIGABRT) in its interpreter's teardown" in done.reason
    exited = t.events("rank_exited")
    exits = {e.data["rank"]: (e.data["exit_code"], e.data["signal"]) for e in exited}
    assert exits == {0: (0, None), 1: (None, 6)}, exits
    assert t.events("fault_detected") == [] and t.events("recovery_decision") == []
    cluster.wait_idle()


def test_a_rank_stuck_idle_in_its_teardown_after_its_peer_exited_is_stopped_and_the_job_completes(
    make_cluster: Callable[..., Cluster],
) -> None:
    # rank 1 never leaves its teardown (pytorch/pytorch#75097: CI saw an accelerate rank
    # sleep in a futex for minutes after its final line); rank 0 exits 0. Once rank 1 has
    # used no CPU for the cluster's exit_wait_s after that, it is stopped: one attempt,
    # completed (ADR 0049).
    cluster = make_cluster(exit_wait_s=3)
    t = train(cluster, extra=("--teardown-hang-rank", "1"))
    done = t.wait()
    assert done.state == "completed", (done.reason, done.attempts)
    assert [(a.number, a.state) for a in done.attempts] == [(1, "succeeded")]
    assert "rank 1 on workers-1 stayed running, idle (no CPU for 3s)" in done.reason
    exits = {
        e.data["rank"]: (e.data["exit_code"], e.data["signal"]) for e in t.events("rank_exited")
    }
    assert exits == {0: (0, None), 1: (None, 15)}, exits
    (idle,) = t.events("ranks_left_idle")
    assert (idle.data["ranks"], idle.data["nodes"]) == ([1], ["workers-1"])
    assert t.events("fault_detected") == [] and t.events("recovery_decision") == []
    cluster.wait_idle()


def test_a_user_error_is_recognised_whichever_rank_reports_it_first(cluster: Cluster) -> None:
    t = train(cluster, extra=("--fail-at", "3", "--fail-first", "rotate"))
    decided = wait_until(
        lambda: len(evs := t.events("recovery_decision")) >= 2 and evs,
        timeout_s=45,
        what="the second recovery decision",
    )
    tails = [t.client.job(t.job_id).attempts[i].failure.get("log_tail", "") for i in (0, 1)]
    # The last line of each, but for Gloo's teardown abort at the interpreter's exit, which
    # may follow the traceback of a script that raised (pytorch/pytorch#179291, ADR 0044).
    last = [
        [ln for ln in tail.strip().splitlines() if not ln.endswith(TEARDOWN_TERMINATE)][-1]
        for tail in tails
    ]
    # the same error, seen first on another rank
    assert last == [f"[rank{r}]: RuntimeError: bad batch at step 3" for r in (0, 1)], last
    assert decided[1].data["action"] == "fail", decided[1].data
    assert decided[1].data["reason"].startswith("user error")


# -- hang ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_hung_rank_is_detected_and_the_job_restarted(cluster: Cluster) -> None:
    t = train(cluster)
    t.wait_progress()
    t.chaos("workers-1", "hang", rank=1)
    done = t.wait()
    t.check_nothing_lost(attempts=2)

    fault = t.fault(1)
    assert fault.data["fault"] == "hang"
    assert "sent no progress beacon" in fault.data["reason"]
    # detected once the last beacon is hang_timeout_s old, and not much later
    waited = fault.ts - fault.data["fault_at"]
    assert HANG_TIMEOUT_S <= waited <= HANG_TIMEOUT_S + 3, waited
    d = t.decision(1).data
    assert (d["action"], d["nodes"], d["counts"]) == ("restart", ["workers-0", "workers-1"], True)
    assert t.one("attempt_created", attempt=2).data["restart_reason"].startswith("hang: ")
    assert [(a.state, a.cause) for a in done.attempts] == [("failed", "hang"), ("succeeded", "")]
    # the teardown woke the stopped rank to end it (SIGTERM + SIGCONT, or SIGKILL at last)
    rank1 = next(r for r in done.attempts[0].ranks if r.rank == 1)
    assert rank1.signal in (15, 9), rank1

    # goodput: every second of the wall clock in one bucket; the fault's costs named
    report = compute_goodput(done, t.client.events(job_id=t.job_id), now=0.0)
    b = report.buckets
    assert set(b) == set(BUCKETS)
    assert b["productive"] > 0
    assert sum(b.values()) == pytest.approx(report.wall_s, abs=1e-6)
    assert report.wall_s == pytest.approx(done.ended_at - done.submitted_at)  # type: ignore[operator]
    assert b["detection"] == pytest.approx(waited, abs=0.5)
    assert b["teardown"] >= 0 and b["reload"] > 0 and b["startup"] > 0
    assert b["unaccounted"] < 0.5, report.notes
    assert [(f.attempt, f.fault) for f in report.faults] == [(1, "hang")]
    assert report.lost_by_cause["detection"] == b["detection"]
    assert 0 < report.goodput < 1


# -- node faults --------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_lost_node_is_replaced_by_the_spare(cluster: Cluster) -> None:
    t = train(cluster)
    t.wait_progress()
    injected = t.chaos("workers-1", "kill-agent")
    done = t.wait()
    t.check_nothing_lost(attempts=2)

    # the controller noticed the silence after heartbeat_timeout_s and took the node away
    moves = node_moves(cluster, "workers-1", injected.ts)
    assert moves[:3] == ["allocated", "suspect", "quarantined"], moves
    suspect = next(
        e
        for e in cluster.client.events(node="workers-1")
        if e.kind == "node_state" and e.data["new"] == "suspect"
    )
    silent = re.fullmatch(r"node lost: no heartbeat for ([\d.]+)s", suspect.data["reason"])
    assert silent and float(silent.group(1)) >= HEARTBEAT_TIMEOUT_S, suspect.data
    # its last heartbeat may be up to an interval older than the injection
    assert suspect.ts - injected.ts > HEARTBEAT_TIMEOUT_S - 1
    lost = t.one("rank_lost", attempt=1)
    assert (lost.node, lost.data["rank"], lost.data["reason"]) == (
        "workers-1",
        1,
        "node heartbeat lost",
    )
    d = t.decision(1).data
    assert (d["action"], d["nodes"], d["replaced"]) == (
        "restart",
        ["workers-0", "spares-0"],
        {"workers-1": "spares-0"},
    )
    assert t.one("attempt_created", attempt=2).data["nodes"] == ["workers-0", "spares-0"]
    assert done.attempts[1].nodes == ["workers-0", "spares-0"]
    # the fault's class and the node's repair: see the next test


@pytest.mark.timeout(120)
def test_a_lost_node_is_a_node_fault_and_comes_back_repaired(cluster: Cluster) -> None:
    t = train(cluster, max_restarts=0)  # a node fault must not use up the job's restarts
    t.wait_progress()
    injected = t.chaos("workers-1", "kill-agent")
    old_pid = next(n.agent_pid for n in t.client.nodes() if n.name == "workers-1")

    def settled() -> str | None:
        node = next(n for n in t.client.nodes() if n.name == "workers-1")
        if node.state == "idle" and node.agent_pid != old_pid:
            return "idle"
        new = node.agent_pid not in (None, old_pid)
        if node.state == "repairing" and new and not pid_alive(node.agent_pid):  # type: ignore[arg-type]
            return f"the replacement agent (pid {node.agent_pid}) died while repairing"
        return None

    # (1) the backend replaces the node, the deep check passes, the node is back in the pool
    outcome = wait_until(settled, timeout_s=50, what="workers-1 to be repaired")
    assert outcome == "idle", outcome
    # (2) the fault is the lost node's, and the restart is free
    done = t.wait()
    faults = [(f.node, f.data["fault"]) for f in t.events("fault_detected")]
    decisions = [(e.data["action"], e.data.get("counts")) for e in t.events("recovery_decision")]
    # The peer's rank usually dies first ("connection closed by peer") and is seen as a crash;
    # once the silent node is found out, the fault is classified as the lost node's.
    classified = [(f.node, f.data["fault"]) for f in t.events("fault_classified")]
    assert faults == [("workers-1", "node_lost")] or (classified == [("workers-1", "node_lost")]), (
        faults,
        classified,
        decisions,
        done.reason[:200],
    )
    assert decisions == [("restart", False)]
    t.check_nothing_lost(attempts=2)
    check_replaced_and_repaired(t, "workers-1", injected.ts, lost=True)


@pytest.mark.parametrize(
    ("fault", "says", "repair"),
    [("xid79", "XID 79", True), ("ecc", "uncorrectable ECC", False)],  # one repair is enough
)
@pytest.mark.timeout(120)
def test_a_gpu_fault_quarantines_the_node_and_the_spare_takes_over(
    cluster: Cluster, fault: str, says: str, repair: bool
) -> None:
    t = train(cluster)
    t.wait_progress()
    injected = t.chaos("workers-1", fault)
    done = t.wait()
    t.check_nothing_lost(attempts=2)

    f = t.fault(1)
    assert (f.node, f.data["fault"], f.data["nodes"]) == ("workers-1", "gpu_fault", ["workers-1"])
    assert says in f.data["reason"], f.data["reason"]
    d = t.decision(1).data
    assert (d["action"], d["nodes"], d["replaced"], d["counts"]) == (
        "restart",
        ["workers-0", "spares-0"],
        {"workers-1": "spares-0"},
        False,  # not the job's fault: max_restarts is untouched
    )
    assert t.one("attempt_created", attempt=2).data["nodes"] == ["workers-0", "spares-0"]
    assert [(a.cause, a.nodes) for a in done.attempts] == [
        ("gpu_fault", ["workers-0", "workers-1"]),
        ("", ["workers-0", "spares-0"]),
    ]
    quarantined = next(
        e
        for e in cluster.client.events(node="workers-1")
        if e.kind == "node_state" and e.data["new"] == "quarantined"
    )
    assert quarantined.data["reason"].startswith("gpu: simulated GPU: ")
    assert quarantined.ts >= injected.ts
    if not repair:
        return
    check_replaced_and_repaired(t, "workers-1", injected.ts)
    # the fresh instance's GPU is healthy again
    node = next(n for n in cluster.client.nodes() if n.name == "workers-1")
    gpu = next(h for h in node.facts["health"] if h["check"] == "gpu")
    assert gpu["status"] == "ok", gpu


@pytest.mark.timeout(120)
def test_a_full_disk_quarantines_the_node_and_the_spare_takes_over(cluster: Cluster) -> None:
    t = train(cluster)
    t.wait_progress()
    injected = t.chaos("workers-1", "disk-full")
    done = t.wait()
    t.check_nothing_lost(attempts=2)

    f = t.fault(1)
    assert (f.node, f.data["fault"]) == ("workers-1", "node_fault")
    assert "disk: disk full" in f.data["reason"] and "quota" in f.data["reason"]
    d = t.decision(1).data
    assert (d["action"], d["replaced"], d["counts"]) == (
        "restart",
        {"workers-1": "spares-0"},
        False,
    )
    assert done.attempts[1].nodes == ["workers-0", "spares-0"]
    assert node_moves(cluster, "workers-1", injected.ts)[:2] == ["allocated", "quarantined"]
    # (its repair is the GPU fault's, checked there)


@pytest.mark.timeout(120)
def test_a_hot_gpu_is_only_a_warning(cluster: Cluster) -> None:
    t = train(cluster)
    t.wait_progress()
    t.chaos("workers-1", "thermal")

    def warned() -> dict[str, Any] | None:
        node = next(n for n in t.client.nodes() if n.name == "workers-1")
        gpu = next((h for h in node.facts.get("health", []) if h["check"] == "gpu"), None)
        return gpu if gpu and gpu["status"] == "warn" else None

    gpu = wait_until(warned, timeout_s=20, what="workers-1 to report a thermal warning")
    assert "thermal" in gpu["reason"], gpu
    assert t.client.job(t.job_id).state == "running"
    done = t.wait()
    t.check_nothing_lost(attempts=1)
    assert not t.events("fault_detected") and not t.events("recovery_decision")
    node = next(n for n in t.client.nodes() if n.name == "workers-1")
    assert node.state == "idle" and node.reason == ""
    gpu = next(h for h in node.facts["health"] if h["check"] == "gpu")
    assert gpu["status"] == "warn"  # still hot, still in service
    assert done.attempts[0].nodes == ["workers-0", "workers-1"]


# -- stragglers ---------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_persistent_straggler_is_replaced_by_the_spare(cluster: Cluster) -> None:
    # Ranks sync every 5 steps (like gradient accumulation), so each rank's step time is
    # its own between syncs; see the lockstep test below for why that matters.
    t = train(cluster, steps=200, procs=2, extra=("--sync-every", "5"))
    t.wait_progress()
    injected = t.chaos("workers-1", "slow", rank=2)
    done = t.wait()
    t.check_nothing_lost(attempts=2)

    flag = t.one("straggler_detected", attempt=1)
    assert (flag.node, flag.data["rank"]) == ("workers-1", 2)
    assert flag.ts > injected.ts
    f = t.fault(1)
    assert (f.node, f.data["fault"]) == ("workers-1", "straggler")
    assert "rank 2 is persistently slower than its peers" in f.data["reason"]
    d = t.decision(1).data
    assert (d["action"], d["replaced"], d["counts"]) == (
        "restart",
        {"workers-1": "spares-0"},
        False,
    )
    assert done.attempts[1].nodes == ["workers-0", "spares-0"]
    assert node_moves(cluster, "workers-1", injected.ts)[:3] == [
        "allocated",
        "quarantined",
        "repairing",
    ]
