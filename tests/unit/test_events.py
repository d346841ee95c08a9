"""Typed events: each kind written as it always was, read back as its class, never raising."""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trainpod
from trainpod.api.models import EventInfo
from trainpod.model import events as ev
from trainpod.model.states import AttemptState, JobState, NodeState
from trainpod.store.repo import Store
from trainpod.store.rows import EventRow

N0, N1, S0 = "workers-0", "workers-1", "spares-0"

# Each kind as its producer builds it now, and the add_event call that wrote it before
# (the keywords of the controller at 1369dc0): the two must write the same row.
SAMPLES: list[tuple[ev.Event, dict[str, Any]]] = [
    (
        ev.NodeStateChanged(node=N0, old=NodeState.IDLE, new=NodeState.ALLOCATED, reason=""),
        dict(kind="node_state", node=N0, old="idle", new="allocated", reason=""),
    ),
    (
        ev.NodeDeclared(node=N0, group="workers"),
        dict(kind="node_declared", node=N0, group="workers"),
    ),
    (ev.NodeAllocated(node=N0, job_id=3), dict(kind="node_allocated", node=N0, job_id=3)),
    (ev.NodeReleased(node=N0, job_id=3), dict(kind="node_released", node=N0, job_id=3)),
    (
        ev.AgentRegistered(node=N0, agent_pid=41, address="10.0.0.2", restarted=True),
        dict(kind="agent_registered", node=N0, agent_pid=41, address="10.0.0.2", restarted=True),
    ),
    (ev.AgentReconnected(node=N0), dict(kind="agent_reconnected", node=N0)),
    (
        ev.DeepCheckStarted(node=N1, check_id="dc-1"),
        dict(kind="deep_check_started", node=N1, id="dc-1"),
    ),
    (
        ev.DeepCheckFinished(node=N1, status="fault", reason="xid 79"),
        dict(kind="deep_check_finished", node=N1, status="fault", reason="xid 79"),
    ),
    (ev.NodeRepaired(node=N1, mode=None), dict(kind="node_repaired", node=N1, mode=None)),
    (
        ev.ExternalNodeDown(node=N1, reason="Not responding"),
        dict(kind="external_node_down", node=N1, reason="Not responding"),
    ),
    (ev.NodeDrain(node=N1, reason="bios"), dict(kind="node_drain", node=N1, reason="bios")),
    (
        ev.NodeQuarantine(node=N1, reason="flaky"),
        dict(kind="node_quarantine", node=N1, reason="flaky"),
    ),
    (ev.NodeResume(node=N1, reason="fixed"), dict(kind="node_resume", node=N1, reason="fixed")),
    (ev.NodeReplace(node=N1, reason="dead"), dict(kind="node_replace", node=N1, reason="dead")),
    (ev.ControllerStarted(restarted=False), dict(kind="controller_started", restarted=False)),
    (
        ev.ControllerStepFailed(error="OperationalError: disk I/O error"),
        dict(kind="controller_step_failed", error="OperationalError: disk I/O error"),
    ),
    (
        ev.ControllerStepRecovered(failures=3),
        dict(kind="controller_step_recovered", failures=3),
    ),
    (
        ev.JobSubmitted(
            job_id=3,
            nodes=2,
            procs_per_node=1,
            partition="main",
            user="ada",
            command=("python", "train.py"),
            auto_resume=True,
        ),
        dict(
            kind="job_submitted",
            job_id=3,
            nodes=2,
            procs_per_node=1,
            partition="main",
            user="ada",
            command=["python", "train.py"],
            auto_resume=True,
        ),
    ),
    (ev.CancelRequested(job_id=3), dict(kind="cancel_requested", job_id=3)),
    (
        ev.JobStateChanged(job_id=3, old=JobState.QUEUED, new=JobState.STARTING, reason=""),
        dict(kind="job_state", job_id=3, old="queued", new="starting", reason=""),
    ),
    (ev.JobFirstStart(job_id=3), dict(kind="job_first_start", job_id=3)),
    (ev.JobHeld(job_id=3, by="alice"), dict(kind="job_held", job_id=3, by="alice")),
    (ev.JobReleased(job_id=3, by="root"), dict(kind="job_released", job_id=3, by="root")),
    (
        ev.AccessDenied(user="bob", action="cancel", job_id=3, reason="it belongs to alice"),
        dict(
            kind="access_denied",
            user="bob",
            action="cancel",
            job_id=3,
            reason="it belongs to alice",
        ),
    ),
    (
        ev.AuthFailed(
            client="10.0.0.7",
            method="POST",
            path="/v1/jobs/3/cancel",
            reason="unknown or revoked token",
            unrecorded=2,
        ),
        dict(
            kind="auth_failed",
            client="10.0.0.7",
            method="POST",
            path="/v1/jobs/3/cancel",
            reason="unknown or revoked token",
            unrecorded=2,
        ),
    ),
    (
        ev.AuthThrottled(client="10.0.0.7", failures=10, window_s=60.0, retry_after_s=42.0),
        dict(
            kind="auth_throttled",
            client="10.0.0.7",
            failures=10,
            window_s=60.0,
            retry_after_s=42.0,
        ),
    ),
    (
        ev.TokenIssued(user="alice", token_id="ab12cd34", by="root"),
        dict(kind="token_issued", user="alice", token_id="ab12cd34", by="root"),
    ),
    (
        ev.TokensRevoked(user="alice", token_ids=("ab12cd34",), by="root"),
        dict(kind="tokens_revoked", user="alice", token_ids=["ab12cd34"], by="root"),
    ),
    (
        ev.JobPreempted(job_id=3, attempt=1, reason="priority 10 job 4 needs the nodes"),
        dict(kind="job_preempted", job_id=3, attempt=1, reason="priority 10 job 4 needs the nodes"),
    ),
    (
        ev.ChaosInjected(node=N1, job_id=3, fault="xid79", rank=None, order_id="c-1"),
        dict(kind="chaos_injected", node=N1, job_id=3, fault="xid79", rank=None, id="c-1"),
    ),
    (
        ev.AttemptCreated(
            job_id=3,
            attempt=2,
            attempt_id=9,
            nodes=(N0, S0),
            master_addr="10.0.0.2",
            master_port=29500,
            reason="gpu_fault: xid 79",
        ),
        dict(
            kind="attempt_created",
            job_id=3,
            attempt=2,
            attempt_id=9,
            nodes=[N0, S0],
            master_addr="10.0.0.2",
            master_port=29500,
            restart_reason="gpu_fault: xid 79",
        ),
    ),
    (
        ev.AttemptStateChanged(
            job_id=3, attempt=1, old=AttemptState.RUNNING, new=AttemptState.STOPPING, cause="crash"
        ),
        dict(
            kind="attempt_state", job_id=3, attempt=1, old="running", new="stopping", cause="crash"
        ),
    ),
    (
        ev.AttemptProgress(
            job_id=3,
            attempt=1,
            first_step=0,
            last_step=38,
            first_beacon_at=11.5,
            last_beacon_at=49.75,
            step_time_s=1.0,
            steps=39,
            last_checkpoint_step=None,
            checkpoint_stall_s=0.25,
            ranks=2,
        ),
        dict(
            kind="attempt_progress",
            job_id=3,
            attempt=1,
            first_step=0,
            last_step=38,
            first_beacon_at=11.5,
            last_beacon_at=49.75,
            step_time_s=1.0,
            steps=39,
            last_checkpoint_step=None,
            checkpoint_stall_s=0.25,
            ranks=2,
        ),
    ),
    (
        ev.RankStarted(node=N0, job_id=3, attempt=1, rank=0, pid=100, started_at=3.0),
        dict(kind="rank_started", node=N0, job_id=3, attempt=1, rank=0, pid=100, started_at=3.0),
    ),
    (
        ev.RankExited(
            node=N0, job_id=3, attempt=1, rank=0, exited_at=9.0, exit_code=0, signal=None
        ),
        dict(
            kind="rank_exited",
            node=N0,
            job_id=3,
            attempt=1,
            rank=0,
            exited_at=9.0,
            exit_code=0,
            signal=None,
        ),
    ),
    (
        ev.RankLost(node=N1, job_id=3, attempt=1, rank=1, reason="agent restarted"),
        dict(kind="rank_lost", node=N1, job_id=3, attempt=1, rank=1, reason="agent restarted"),
    ),
    (
        ev.FirstBeacon(node=N0, job_id=3, attempt=1, rank=0, at=11.5, step=0),
        dict(kind="first_beacon", node=N0, job_id=3, attempt=1, at=11.5, step=0, rank=0),
    ),
    (
        ev.StragglerDetected(node=N1, job_id=3, attempt=1, rank=1, step_time_s=2.5),
        dict(kind="straggler_detected", node=N1, job_id=3, attempt=1, rank=1, step_time_s=2.5),
    ),
    (
        ev.RanksLeftIdle(job_id=3, attempt=1, ranks=(1,), nodes=(N1,), waited_s=60.0),
        dict(kind="ranks_left_idle", job_id=3, attempt=1, ranks=[1], nodes=[N1], waited_s=60.0),
    ),
    (
        ev.FaultDetected(
            job_id=3,
            attempt=1,
            node=N1,
            cause="crash",
            fault_at=50.0,
            reason="rank 1 exited 1",
            rank=1,
            nodes=(N1,),
        ),
        dict(
            kind="fault_detected",
            job_id=3,
            attempt=1,
            node=N1,
            fault="crash",
            fault_at=50.0,
            reason="rank 1 exited 1",
            rank=1,
            nodes=[N1],
        ),
    ),
    (
        ev.FaultClassified(
            job_id=3,
            attempt=1,
            node=N1,
            cause="node_lost",
            previous_cause="crash",
            nodes=(N1,),
            reason="its agent went silent",
        ),
        dict(
            kind="fault_classified",
            job_id=3,
            attempt=1,
            node=N1,
            fault="node_lost",
            was="crash",
            nodes=[N1],
            reason="its agent went silent",
        ),
    ),
    (
        ev.InProcessRecoveryStarted(
            job_id=3,
            attempt=1,
            node=N1,
            generation=1,
            rank=3,
            replaced=(3,),
            master_port=29501,
            deadline_s=60.0,
            reason="rank 3 on workers-1 was killed by signal 9",
        ),
        dict(
            kind="in_process_recovery_started",
            job_id=3,
            attempt=1,
            node=N1,
            generation=1,
            rank=3,
            replaced=[3],
            master_port=29501,
            deadline_s=60.0,
            reason="rank 3 on workers-1 was killed by signal 9",
        ),
    ),
    (
        ev.InProcessRecoveryDone(job_id=3, attempt=1, generation=1, rank=3, duration_s=6.5),
        dict(
            kind="in_process_recovery_done",
            job_id=3,
            attempt=1,
            generation=1,
            rank=3,
            duration_s=6.5,
        ),
    ),
    (
        ev.InProcessRecoveryAbandoned(
            job_id=3, attempt=1, generation=1, reason="a second fault while generation 1"
        ),
        dict(
            kind="in_process_recovery_abandoned",
            job_id=3,
            attempt=1,
            generation=1,
            reason="a second fault while generation 1",
        ),
    ),
    (
        ev.RecoveryDecision(
            job_id=3,
            attempt=1,
            action="restart",
            reason="replaced workers-1",
            nodes=(N0, S0),
            replaced={N1: S0},
            counts=True,
            shrunk=False,
        ),
        dict(
            kind="recovery_decision",
            job_id=3,
            attempt=1,
            action="restart",
            reason="replaced workers-1",
            nodes=[N0, S0],
            replaced={N1: S0},
            counts=True,
            shrunk=False,
        ),
    ),
    (
        ev.ExternalScript(job_id=3, path="/tmp/job-3.sbatch"),
        dict(kind="external_script", job_id=3, path="/tmp/job-3.sbatch"),
    ),
    (
        ev.ExternalSubmitted(job_id=3, external_id="77"),
        dict(kind="external_submitted", job_id=3, external_id="77"),
    ),
    (
        ev.ExternalError(action="drain", error="scontrol: busy", node=N1),
        dict(kind="external_error", action="drain", error="scontrol: busy", node=N1),
    ),
    (
        ev.JobRequeued(job_id=3, external_id="77", exclude=(N1,), reason="no spare left"),
        dict(kind="job_requeued", job_id=3, external_id="77", exclude=[N1], reason="no spare left"),
    ),
    (
        ev.ExternalReaped(job_id=3, external_id="77", external_state="RUNNING"),
        dict(kind="external_reaped", job_id=3, external_id="77", was="RUNNING"),
    ),
    (
        ev.ExternalReleased(job_id=3, external_id="77", reason="job ended"),
        dict(kind="external_released", job_id=3, external_id="77", reason="job ended"),
    ),
    (
        ev.CheckpointSaved(
            job_id=3,
            attempt=1,
            at=20.5,
            step=25,
            tier="memory",
            scope="node",
            stall_s=0.125,
            bytes=1024,
            by=N0,
        ),
        dict(
            kind="checkpoint_saved",
            node=None,
            job_id=3,
            attempt=1,
            at=20.5,
            step=25,
            tier="memory",
            scope="node",
            stall_s=0.125,
            bytes=1024,
            by=N0,
        ),
    ),
    (
        ev.CheckpointCommitted(
            job_id=3,
            attempt=1,
            node=None,
            at=None,
            step=25,
            tier="durable",
            scope="job",
            bytes=2048,
            seconds=1.5,
            since_save_s=2.0,
            by=N0,
            wrote_manifest=True,
        ),
        dict(
            kind="checkpoint_committed",
            node=None,
            job_id=3,
            attempt=1,
            at=None,
            step=25,
            tier="durable",
            scope="job",
            bytes=2048,
            seconds=1.5,
            since_save_s=2.0,
            by=N0,
            wrote_manifest=True,
        ),
    ),
    (
        ev.CheckpointTierFull(
            job_id=3,
            attempt=2,
            node=N1,
            at=21.5,
            step=26,
            tier="memory",
            path="/dev/shm/trainpod/job-3-abcd/n1",
            reason="ENOSPC: not enough free space (checked before writing)",
            needed_bytes=4096,
            free_bytes=1024,
            to="scratch",
        ),
        dict(
            kind="checkpoint_tier_full",
            node=N1,
            job_id=3,
            attempt=2,
            at=21.5,
            step=26,
            tier="memory",
            path="/dev/shm/trainpod/job-3-abcd/n1",
            reason="ENOSPC: not enough free space (checked before writing)",
            needed_bytes=4096,
            free_bytes=1024,
            to="scratch",
        ),
    ),
    (
        ev.CheckpointFailed(
            job_id=3,
            attempt=None,
            node=N1,
            at=21.0,
            step=25,
            tier="peer",
            scope="node",
            reason="peer down",
            bytes=0,
        ),
        dict(
            kind="checkpoint_failed",
            node=N1,
            job_id=3,
            attempt=None,
            at=21.0,
            step=25,
            tier="peer",
            scope="node",
            reason="peer down",
            bytes=0,
        ),
    ),
    (
        ev.AllocationReleased(job_id=3, reason="the shell exited with status 0"),
        dict(kind="allocation_released", job_id=3, reason="the shell exited with status 0"),
    ),
    (
        ev.AllocationExpired(job_id=3, reason="its --time 1 ran out"),
        dict(kind="allocation_expired", job_id=3, reason="its --time 1 ran out"),
    ),
    (
        ev.StepStarted(
            job_id=3, attempt=1, step=2, nodes=(N0, N1), procs_per_node=2, command=("python",)
        ),
        dict(
            kind="step_started",
            job_id=3,
            attempt=1,
            step=2,
            nodes=[N0, N1],
            procs_per_node=2,
            command=["python"],
        ),
    ),
    (
        ev.StepEnded(job_id=3, attempt=1, step=2, exit_code=3),
        dict(kind="step_ended", job_id=3, attempt=1, step=2, exit_code=3),
    ),
]

# The same kinds in their other shapes: keys some producers write only sometimes.
VARIANTS: list[tuple[ev.Event, dict[str, Any]]] = [
    (
        ev.RankExited(
            node=N1,
            job_id=3,
            attempt=1,
            rank=1,
            exited_at=None,
            exit_code=None,
            signal=9,
            log_tail="Killed",
        ),
        dict(
            kind="rank_exited",
            node=N1,
            job_id=3,
            attempt=1,
            rank=1,
            exited_at=None,
            exit_code=None,
            signal=9,
            log_tail="Killed",
        ),
    ),
    (
        ev.RecoveryDecision(job_id=3, attempt=1, action="wait", reason="no spare", nodes=(N0,)),
        dict(
            kind="recovery_decision",
            job_id=3,
            attempt=1,
            action="wait",
            reason="no spare",
            nodes=[N0],
        ),
    ),
    (
        ev.RecoveryDecision(
            job_id=3, attempt=1, action="requeue", reason="requeued", nodes=(), exclude=(N1,)
        ),
        dict(
            kind="recovery_decision",
            job_id=3,
            attempt=1,
            action="requeue",
            reason="requeued",
            nodes=[],
            exclude=[N1],
        ),
    ),
    (
        ev.JobRequeued(job_id=3, external_id="77", by="slurm", reason="NODE_FAIL"),
        dict(kind="job_requeued", job_id=3, external_id="77", by="slurm", reason="NODE_FAIL"),
    ),
    (
        ev.ExternalError(action="cancel", error="no such job", job_id=3),
        dict(kind="external_error", action="cancel", error="no such job", job_id=3),
    ),
    (
        ev.CheckpointCommitted(
            job_id=3,
            attempt=1,
            node=N0,
            at=21.0,
            step=25,
            tier="scratch",
            scope="node",
            bytes=1024,
            seconds=0.5,
            since_save_s=None,
        ),
        dict(
            kind="checkpoint_committed",
            node=N0,
            job_id=3,
            attempt=1,
            at=21.0,
            step=25,
            tier="scratch",
            scope="node",
            bytes=1024,
            seconds=0.5,
            since_save_s=None,
        ),
    ),
]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db")
    yield s
    s.close()


def raw_rows(store: Store) -> list[tuple[Any, ...]]:
    sql = "SELECT ts, kind, node, job_id, attempt, data FROM events ORDER BY id"
    return [tuple(r) for r in store._conn.execute(sql)]


def test_every_kind_has_a_sample_and_a_unique_kind_string() -> None:
    kinds = [cls.kind for cls in ev.EVENT_TYPES.values()]
    assert len(kinds) == len(set(kinds)) == len(ev.EVENT_TYPES)
    assert {type(e) for e, _ in SAMPLES} == set(ev.EVENT_TYPES.values())
    assert all(kind == cls.kind for kind, cls in ev.EVENT_TYPES.items())
    assert {c.kind for c in ev.NODE_ACTIONS.values()} == {
        f"node_{a}" for a in ("drain", "quarantine", "resume", "replace")
    }


@pytest.mark.parametrize("event,legacy", SAMPLES + VARIANTS, ids=lambda x: type(x).__name__)
def test_append_writes_the_row_add_event_wrote(
    store: Store, event: ev.Event, legacy: dict[str, Any]
) -> None:
    with store.transaction():
        store.append(7.25, event)
        store.add_event(7.25, **legacy)
    typed, old = raw_rows(store)
    assert typed == old  # byte for byte: old databases and their readers see no change


@pytest.mark.parametrize("event,legacy", SAMPLES + VARIANTS, ids=lambda x: type(x).__name__)
def test_every_kind_round_trips(store: Store, event: ev.Event, legacy: dict[str, Any]) -> None:
    with store.transaction():
        row_id = store.append(7.25, event)
    (row,) = store.events()
    assert ev.parse(row) == event
    assert store.typed_events() == [ev.Recorded(row_id, 7.25, event)]
    info = EventInfo(**vars(row))  # what the API hands out parses the same
    assert ev.parse(info) == event and ev.recorded(info).event == event


def test_an_unknown_kind_is_kept_whole_and_never_raises() -> None:
    row = EventRow(5, 1.0, "gpu_melted", "n-0", 3, 1, {"celsius": 900})
    parsed = ev.parse(row)
    assert parsed == ev.UnknownEvent(
        kind="gpu_melted", node="n-0", job_id=3, attempt=1, data={"celsius": 900}
    )
    assert parsed.to_row_data() == {"celsius": 900} and parsed.columns() == ("n-0", 3, 1)


def test_a_row_without_what_its_kind_needs_is_unknown() -> None:
    no_new = EventRow(5, 1.0, "job_state", None, 3, None, {"old": "queued", "new": None})
    assert isinstance(ev.parse(no_new), ev.UnknownEvent)
    bad_state = EventRow(5, 1.0, "node_state", "n-0", None, None, {"old": "idle", "new": "?"})
    assert isinstance(ev.parse(bad_state), ev.UnknownEvent)
    no_job = EventRow(5, 1.0, "cancel_requested", None, None, None, {})
    assert isinstance(ev.parse(no_job), ev.UnknownEvent)
    not_a_dict = EventRow(5, 1.0, "controller_started", None, None, None, [1])  # type: ignore[arg-type]  # a corrupt row
    assert ev.parse(not_a_dict) == ev.ControllerStarted()


def test_an_old_row_missing_optional_keys_reads_with_defaults() -> None:
    row = EventRow(5, 1.0, "attempt_created", None, 3, 1, {"nodes": ["a", "b"]})
    assert ev.parse(row) == ev.AttemptCreated(
        job_id=3,
        attempt=1,
        attempt_id=None,
        nodes=("a", "b"),
        master_addr=None,
        master_port=None,
        reason="",
    )
    assert ev.parse(EventRow(6, 1.0, "controller_started", None, None, None, {})) == (
        ev.ControllerStarted(restarted=False)
    )
    no_old = ev.parse(EventRow(7, 2.0, "job_state", None, 3, None, {"new": "cancelled"}))
    assert no_old == ev.JobStateChanged(job_id=3, old=None, new=JobState.CANCELLED)
    beacon = ev.parse(EventRow(7, 2.0, "first_beacon", None, 3, 1, {"at": 1.5}))
    assert beacon == ev.FirstBeacon(node=None, job_id=3, attempt=1, rank=None, at=1.5, step=None)


def test_malformed_values_read_as_missing() -> None:
    data = {"fault": "crash", "fault_at": "soon", "nodes": None, "rank": True, "reason": 5}
    parsed = ev.parse(EventRow(5, 1.0, "fault_detected", None, 3, 1, data))
    assert parsed == ev.FaultDetected(
        job_id=3, attempt=1, node=None, cause="crash", fault_at=None, reason="5", rank=None
    )
    nan = {"first_beacon_at": math.nan, "last_step": 4.0, "checkpoint_stall_s": math.inf}
    progress = ev.parse(EventRow(6, 1.0, "attempt_progress", None, 3, 1, nan))
    assert isinstance(progress, ev.AttemptProgress)
    assert (progress.first_beacon_at, progress.last_step, progress.checkpoint_stall_s) == (
        None,
        4,
        0.0,
    )
    one = ev.parse(EventRow(7, 1.0, "fault_classified", None, 3, 1, {"nodes": "n-1"}))
    assert isinstance(one, ev.FaultClassified) and one.nodes == ("n-1",)
    listed = {"action": "restart", "replaced": ["n-1"]}  # hand-written: names only
    decision = ev.parse(EventRow(8, 1.0, "recovery_decision", None, 3, 1, listed))
    assert isinstance(decision, ev.RecoveryDecision) and decision.replaced == {"n-1": ""}


# -- every event the code writes is one of these classes ----------------------------------
SRC = Path(trainpod.__file__).parent


def add_event_calls() -> list[str]:
    """Where src/ still calls ``add_event(ts, "kind", **payload)``: ``file:line``."""
    calls: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_event"
            ):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return calls


def test_no_producer_writes_a_kind_string() -> None:
    """Producers build events and ``Store.append`` them; ``add_event`` is for tests only."""
    assert add_event_calls() == []


def test_the_model_package_imports_nothing_of_trainpod_outside_it() -> None:
    for path in (SRC / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                if name == "trainpod" or name.startswith("trainpod."):
                    assert name.startswith("trainpod.model"), f"{path.name} imports {name}"
