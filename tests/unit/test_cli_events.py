"""The CLI reads events by their types: `trainpod events` lines and the demo's narration."""

from __future__ import annotations

from typing import Any

from trainpod.api.models import EventInfo
from trainpod.cli.demo import _say
from trainpod.cli.jobs import event_line
from trainpod.model.events import parse


def info(kind: str, node: str | None = None, attempt: int | None = None, **data: Any) -> EventInfo:
    return EventInfo(id=1, ts=0.0, kind=kind, node=node, job_id=3, attempt=attempt, data=data)


def test_event_lines_show_the_typed_fields_without_log_tails() -> None:
    line = event_line(
        info("fault_detected", "w-1", 1, fault="crash", fault_at=1.0, reason="exit 1", rank=1,
             nodes=["w-1"])
    )  # fmt: skip
    assert line.split(None, 1)[1].split() == [
        "fault_detected", "w-1", "job", "3", "attempt", "1",
        "cause=crash", "fault_at=1.0", "reason=exit", "1", "rank=1", "nodes=w-1",
    ]  # fmt: skip
    exited = event_line(
        info("rank_exited", "w-1", 1, rank=1, exited_at=None, exit_code=1, signal=None,
             log_tail="Traceback ...\nValueError")
    )  # fmt: skip
    assert "exit_code=1" in exited and "log_tail" not in exited and "Traceback" not in exited
    decision = event_line(
        info("recovery_decision", None, 1, action="restart", reason="r", nodes=["w-0", "s-0"],
             replaced={"w-1": "s-0"}, counts=True, shrunk=False)
    )  # fmt: skip
    assert "nodes=w-0,s-0 replaced=w-1->s-0 counts=True" in decision
    state = event_line(info("job_state", old="queued", new="starting", reason=""))
    assert "old=queued new=starting" in state
    unknown = event_line(info("gpu_melted", "w-1", celsius=900))
    assert unknown.endswith("celsius=900") and "gpu_melted" in unknown


def test_the_demo_narrates_the_story_events_and_nothing_else() -> None:
    said = [
        _say(parse(e))
        for e in [
            info("chaos_injected", "w-1", fault="xid79", rank=None, id="c1"),
            info("fault_detected", "w-1", 1, fault="gpu_fault", fault_at=1.0, reason="xid 79",
                 rank=None, nodes=["w-1"]),
            info("recovery_decision", None, 1, action="restart", reason="replaced w-1",
                 nodes=["w-0", "s-0"], replaced={"w-1": "s-0"}, counts=True, shrunk=False),
            info("attempt_created", None, 2, attempt_id=2, nodes=["w-0", "s-0"],
                 master_addr="a", master_port=1, restart_reason="gpu_fault: xid 79"),
            info("first_beacon", "w-0", 2, at=3.0, step=26, rank=0),
            info("deep_check_finished", "w-1", status="ok", reason=""),
            info("node_repaired", "w-1", mode=None),
            info("rank_started", "w-0", 2, rank=0, pid=1, started_at=2.0),
            info("gpu_melted", "w-1"),
        ]
    ]  # fmt: skip
    assert said == [
        "injected xid79 into w-1",
        "detected gpu_fault on w-1: xid 79",
        "decision: restart: replaced w-1",
        "attempt 2 starts on w-0,s-0",
        "attempt 2: first progress beacon (step 26)",
        "w-1: deep health check ok: ",
        "w-1 repaired and back in the pool",
        None,
        None,
    ]
