"""``trainpod top``'s screen, a pure function of one look at the cluster."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from trainpod.api.models import JobInfo, NodeInfo
from trainpod.cli.top import Frame, screen
from trainpod.model.states import JobState, NodeState
from trainpod.spec.job import JobSpec

NOW = 1_800_000_000.0


def node(i: int, **kw: Any) -> NodeInfo:
    return NodeInfo(
        name=f"n{i}",
        group="workers",
        role="compute",
        spare=False,
        devices=2,
        state=NodeState.IDLE,
        reason="",
        job_id=None,
        address=None,
        agent_pid=None,
        last_heartbeat=None,
        facts=kw.pop("facts", {}),
        **kw,
    )


def job(i: int, state: JobState, **kw: Any) -> JobInfo:
    return JobInfo(
        id=i,
        name=f"job-{i}",
        state=state,
        reason=kw.pop("reason", ""),
        spec=JobSpec(command=["python", "x.py"], nodes=1, user="alice"),
        submitted_at=NOW,
        started_at=None,
        ended_at=None,
        **kw,
    )


def text(frame: Frame, height: int = 60) -> str:
    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(screen(frame, height))
    out = console.export_text()
    console.file.close()
    return out


def test_the_screen_shows_nodes_running_jobs_and_the_queue_in_order() -> None:
    jobs = [
        job(1, JobState.RUNNING, progress={"last_step": 40, "step_time_s": 0.25}),
        job(3, JobState.QUEUED, queue_position=2, reason="waiting for nodes"),
        job(2, JobState.QUEUED, queue_position=1, reason="quota of team a"),
    ]
    warn = {"health": [{"check": "disk", "status": "warn"}]}
    out = text(Frame("c1", NOW, [node(0), node(1, facts=warn)], jobs))
    assert "cluster c1" in out and "n0" in out and "n1" in out and "disk" in out
    assert "\nDEVICES" not in out  # no telemetry: no device table
    running = out.split("JOBS", 1)[1].split("QUEUE", 1)[0]
    assert "job-1" in running and "4.00" in running and "40" in running  # steps/s, step
    queue = out.split("QUEUE", 1)[1]
    assert queue.index("job-2") < queue.index("job-3")  # scheduling order, not id
    assert "quota of team a" in queue


def test_devices_come_from_telemetry_and_long_lists_are_cut_with_a_count() -> None:
    sample = {
        "t": NOW,
        "utilization_pct": 87.0,
        "memory_used_bytes": 2 * 2**30,
        "memory_total_bytes": 16 * 2**30,
        "power_w": 212.0,
        "temperature_c": 61.0,
        "energy_j": 5.0,
    }
    tel = {"n0": [{"index": 0, "name": "sim-gpu", "simulated": True, "samples": [sample]}]}
    out = text(Frame("c", NOW, [node(i) for i in range(40)], [], tel), height=30)
    assert "sim-gpu (simulated)" in out and "87%" in out and "212 W" in out
    assert "2.0/16.0 GiB" in out
    assert "n0" in out and "n39" not in out and "more" in out
