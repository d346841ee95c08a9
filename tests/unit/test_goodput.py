"""Goodput accounting from hand-built jobs and event timelines, bucket by bucket."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from rich.console import Console

from trainpod.api.models import AttemptInfo, EventInfo, JobInfo
from trainpod.cli.goodput import fmt_duration, fmt_offset, headline, render
from trainpod.spec.job import JobSpec
from trainpod.telemetry import BUCKETS, GoodputReport, compute_goodput

T0 = 1_000.0  # submit time; the timelines below are in seconds after it
AGENT_TIMES = {"started_at", "at", "fault_at", "first_beacon_at", "last_beacon_at"}
W0, W1, S0 = "workers-0", "workers-1", "spares-0"
Ev = tuple[float, str, int | None, dict[str, Any]]


def ev(t: float, kind: str, attempt: int | None = None, **data: Any) -> Ev:
    return (t, kind, attempt, data)


def make(timeline: list[Ev], **job: Any) -> tuple[JobInfo, list[EventInfo]]:
    """The events in the given order, and the job record as the controller keeps it."""
    events = [
        EventInfo(id=i, ts=T0 + t, kind=k, node=None, job_id=7, attempt=n, data={
            key: T0 + v if key in AGENT_TIMES and isinstance(v, int | float) else v
            for key, v in data.items()})
        for i, (t, k, n, data) in enumerate(timeline, 1)
    ]  # fmt: skip
    attempts: dict[int, AttemptInfo] = {}
    state, ended = "queued", None
    for e in sorted(events, key=lambda e: e.ts):
        new, n = e.data.get("new"), e.attempt
        if e.kind == "attempt_created" and n is not None:
            attempts[n] = AttemptInfo(
                number=n, state="launching", nodes=e.data.get("nodes") or [], created_at=e.ts,
                master_addr="10.0.0.1", master_port=29500, started_at=None, ended_at=None,
                cause="", failure={},
            )  # fmt: skip
        elif e.kind == "attempt_state" and n in attempts and isinstance(new, str):
            done = e.ts if new in ("failed", "succeeded", "cancelled") else None
            attempts[n] = attempts[n].model_copy(update={"state": new, "ended_at": done})
        elif e.kind == "job_state" and isinstance(new, str):
            state, ended = new, e.ts if new in ("completed", "failed", "cancelled") else None
    fields = {
        "id": 7, "name": "train", "state": state, "reason": "", "submitted_at": T0,
        "spec": JobSpec(command=["python", "train.py"]), "started_at": None, "ended_at": ended,
        "attempts": [attempts[n] for n in sorted(attempts)],
    }  # fmt: skip
    return JobInfo(**(fields | job)), events


def check(r: GoodputReport) -> GoodputReport:
    """What holds for any input: never negative, sums to the wall clock, serialises to JSON."""
    assert list(r.buckets) == list(BUCKETS)
    assert all(v >= 0 for v in r.buckets.values()), r.buckets
    assert sum(r.buckets.values()) == pytest.approx(r.wall_s, abs=1e-6)
    assert r.wall_s >= 0 and 0 <= r.goodput <= 1 and 0 <= r.ettr <= 1
    assert list(r.lost_by_cause.values()) == sorted(r.lost_by_cause.values(), reverse=True)
    assert "productive" not in r.lost_by_cause
    json.dumps(r.to_dict())
    return r


def report(timeline: list[Ev], now: float = 10_000.0, **job: Any) -> GoodputReport:
    info, events = make(timeline, **job)
    return check(compute_goodput(info, events, now=T0 + now))


def nonzero(r: GoodputReport) -> dict[str, Any]:
    return {k: pytest.approx(v) for k, v in r.buckets.items() if v > 1e-9}


def start() -> list[Ev]:
    """Submitted at 0, attempt 1 at 2, ranks spawned at 3.0, first beacon (step 0) at 11.5."""
    return [
        ev(0, "job_submitted"),
        ev(2, "attempt_created", 1, nodes=[W0, W1], master_port=29500, restart_reason=""),
        ev(2, "job_state", old="queued", new="starting"),
        ev(3.5, "rank_started", 1, rank=0, pid=100, started_at=3.0),
        ev(3.6, "rank_started", 1, rank=1, pid=101, started_at=3.1),
        ev(12, "first_beacon", 1, at=11.5, step=0),
        ev(12, "job_state", old="starting", new="running"),
    ]


def progress(t: float, n: int, first: int, last: int, fb: float, lb: float, **kw: Any) -> Ev:
    data = {"first_step": first, "last_step": last, "first_beacon_at": fb, "last_beacon_at": lb,
            "step_time_s": 1.0, "steps": last - first + 1, "last_checkpoint_step": None,
            "checkpoint_stall_s": 0.0}  # fmt: skip
    return ev(t, "attempt_progress", n, **(data | kw))


def fault(t: float, n: int, kind: str, at: float, *nodes: str, **kw: Any) -> list[Ev]:
    data = {"fault": kind, "fault_at": at, "reason": f"{kind}!", "nodes": list(nodes)}
    return [
        ev(t, "fault_detected", n, **(data | kw)),
        ev(t, "attempt_state", n, old="running", new="stopping", cause=kind),
        ev(t, "job_state", old="running", new="stopping"),
    ]


def decide(t: float, action: str, *replaced: str, nodes: tuple[str, ...] = (W0, S0)) -> Ev:
    return ev(t, "recovery_decision", 1, action=action, nodes=list(nodes), replaced=list(replaced))


def finish(t: float, n: int, state: str = "succeeded", job: str = "completed") -> list[Ev]:
    return [
        ev(t, "attempt_state", n, old="running", new=state, cause="exit 0"),
        ev(t + 1, "job_state", old="running", new=job),
    ]


def clean(stall: float = 0.0) -> list[Ev]:
    summary = progress(112, 1, 0, 99, 11.5, 110.5, checkpoint_stall_s=stall)
    return [*start(), summary, *finish(112, 1)]


def gpu_fault(decisions: list[Ev], created: float = 53.2) -> list[Ev]:
    """workers-1 fails at 50.0 (last beacon 49.8, step 38); attempt 2 on a spare from step 31."""
    rs = created + 0.8
    return [
        *start(),
        *fault(50.5, 1, "gpu_fault", 50.0, W1),
        *decisions,
        progress(53, 1, 0, 38, 11.5, 49.8, last_checkpoint_step=30),
        ev(53, "attempt_state", 1, old="stopping", new="failed", cause="gpu_fault"),
        ev(53, "job_state", old="stopping", new="recovering"),
        ev(created, "attempt_created", 2, nodes=[W0, S0], restart_reason="gpu_fault"),
        ev(rs + 0.3, "rank_started", 2, rank=0, pid=300, started_at=rs),
        ev(rs + 8.1, "first_beacon", 2, at=rs + 8, step=31),
        progress(rs + 67, 2, 31, 89, rs + 8, rs + 66),
        *finish(rs + 67, 2),
    ]


def test_clean_single_attempt() -> None:
    r = report(clean())
    assert nonzero(r) == {"queued": 2, "startup": 9.5, "productive": 99, "shutdown": 2.5}
    assert r.wall_s == 113 and r.notes == [] and r.state == "completed"
    assert r.goodput == pytest.approx(99 / 113) and r.ettr == pytest.approx(99 / 111)
    assert list(r.lost_by_cause) == ["startup", "shutdown", "queued"]
    (a,) = r.attempts
    assert (a.first_rank_at, a.first_beacon_at, a.last_beacon_at) == (T0 + 3, T0 + 11.5, T0 + 110.5)
    assert (a.first_step, a.last_step, a.state, a.nodes) == (0, 99, "succeeded", [W0, W1])


def test_an_in_process_recovery_is_its_own_lost_time() -> None:
    """Rank 1 killed at 40.0, running again at 46.5 (ADR 0026): the same attempt goes on."""
    done = ev(46.5, "in_process_recovery_done", 1, generation=1, rank=1, duration_s=6.5)
    r = report([*start(), done, *clean()[len(start()) :]])
    assert nonzero(r) == {
        "queued": 2,
        "startup": 9.5,
        "productive": 99 - 6.5,
        "in_process": 6.5,
        "shutdown": 2.5,
    }
    assert r.attempts[0].in_process == [(T0 + 40.0, T0 + 46.5)]
    no_beacons = [e for e in [*start(), done, *clean()[len(start()) :]] if e[1] != "first_beacon"]
    no_beacons = [e for e in no_beacons if e[1] != "attempt_progress"]
    assert nonzero(report(no_beacons))["in_process"] == pytest.approx(6.5)


def test_no_beacons() -> None:
    r = report([e for e in clean() if e[1] not in ("first_beacon", "attempt_progress")])
    assert nonzero(r) == {"queued": 2, "startup": 1, "running_no_beacons": 109, "shutdown": 1}
    assert r.goodput == 0 and any("no progress beacons" in n for n in r.notes)
    assert headline(r) == "job 7: goodput unknown (no progress beacons) over 1m53s wall"


def test_crash_in_job_restart_recomputes_since_checkpoint() -> None:
    r = report([
        *start(),
        *fault(61.2, 1, "crash", 61.0, W1, rank=1),
        decide(61.3, "restart", nodes=(W0, W1)),
        progress(63, 1, 0, 49, 11.5, 60.5, last_checkpoint_step=40),
        ev(63, "attempt_state", 1, old="stopping", new="failed", cause="crash"),
        ev(63.5, "attempt_created", 2, nodes=[W0, W1], restart_reason="crash"),
        ev(64.2, "rank_started", 2, rank=0, pid=200, started_at=64.0),
        ev(70.1, "first_beacon", 2, at=70.0, step=41),  # resumed from the step-40 checkpoint
        progress(130, 2, 41, 99, 70.0, 129.0),
        *finish(130, 2),
    ])  # fmt: skip
    assert nonzero(r) == {
        "queued": 2, "startup": 9.5, "productive": 49 + 50, "recomputed": 0.5 + 9,
        "detection": 0.2, "teardown": 1.8, "restart": 1, "reload": 6, "shutdown": 2,
    }  # fmt: skip
    assert r.notes == [] and r.faults[0].rank == 1
    a1, a2 = r.attempts
    assert (a1.state, a1.fault, a1.recovery, a2.replaced) == ("failed", "crash", "restart", [])


def test_gpu_fault_with_spare_replacement() -> None:
    r = report(gpu_fault([decide(50.6, "restart", W1)]))
    assert nonzero(r) == {
        "queued": 2, "startup": 9.5, "productive": 38.3 + 50, "recomputed": 0.2 + 8,
        "detection": 0.5, "teardown": 2.5, "restart": 1, "reload": 8, "shutdown": 2,
    }  # fmt: skip
    assert r.attempts[1].replaced == [W1] and r.attempts[1].nodes == [W0, S0]
    assert r.faults[0].nodes == [W1] and r.faults[0].fault == "gpu_fault"


def test_waiting_for_spare() -> None:
    r = report(gpu_fault([decide(55, "wait"), decide(80, "restart", W1)], created=80.2))
    assert r.buckets["waiting_for_spare"] == pytest.approx(80.2 - 55)
    assert r.buckets["restart"] == pytest.approx((55 - 53) + 0.8)  # before and after the wait
    assert r.buckets["reload"] == pytest.approx(8) and r.buckets["unaccounted"] == 0
    assert r.attempts[0].waiting_since == T0 + 55 and r.attempts[1].replaced == [W1]
    early = report(gpu_fault([decide(50.6, "wait")], created=90))  # decided during teardown
    assert early.buckets["waiting_for_spare"] == pytest.approx(90 - 53)
    assert early.buckets["teardown"] == pytest.approx(2.5) and early.notes == []
    tl = [e for e in gpu_fault([decide(55, "wait")], created=90) if e[0] <= 60]
    gave_up = report([*tl, ev(70, "job_state", new="cancelled")])  # the wait, not a shutdown
    assert gave_up.buckets["waiting_for_spare"] == pytest.approx(15)
    assert gave_up.buckets["shutdown"] == 0 and gave_up.state == "cancelled"


def test_hang_fault_at_last_beacon_and_the_job_fails() -> None:
    r = report([
        *start(),
        *fault(70, 1, "hang", 40.0, W0, W1),  # no beacon for the 30 s hang timeout
        progress(75, 1, 0, 28, 11.5, 40.0),
        ev(75, "attempt_state", 1, old="stopping", new="failed", cause="hang"),
        decide(75.1, "fail", nodes=()),
        ev(75.5, "job_state", old="stopping", new="failed"),
    ])  # fmt: skip
    expected = {"queued": 2, "startup": 9.5, "productive": 28.5, "detection": 30}
    assert nonzero(r) == expected | {"teardown": 5, "shutdown": 0.5}
    assert r.buckets["recomputed"] == 0 and next(iter(r.lost_by_cause)) == "detection"


def test_checkpoint_stalls() -> None:
    r = report(clean(stall=4.5))
    assert r.buckets["checkpoint_stall"] == pytest.approx(4.5)
    assert r.buckets["productive"] == pytest.approx(99 - 4.5)
    over = report(clean(stall=500.0))  # more than its beaconed time: counted once, and said
    assert over.buckets["checkpoint_stall"] == pytest.approx(99) and over.buckets["productive"] == 0
    assert any("exceed" in n for n in over.notes)


def test_running_queued_and_recovering_jobs_use_now() -> None:
    r = report(start(), now=50)
    assert r.ended_at is None and r.wall_s == pytest.approx(50)
    assert nonzero(r) == {"queued": 2, "startup": 9.5, "productive": 38.5}
    assert any("still running" in n for n in r.notes)
    queued = report([ev(0, "job_submitted")], now=30)
    assert nonzero(queued) == {"queued": 30} and queued.ettr == 0
    tl = gpu_fault([decide(55, "wait")], created=90)
    r = report([e for e in tl if e[0] <= 60], now=70)
    assert r.state == "recovering" and r.buckets["restart"] == pytest.approx(2)
    assert r.buckets["waiting_for_spare"] == pytest.approx(70 - 55)


def test_a_straggler_flag_that_did_not_stop_the_attempt_costs_nothing() -> None:
    flag = ev(50, "fault_detected", 1, fault="straggler", fault_at=49.0, reason="slow", nodes=[W1])
    r = report([*clean(), flag])
    assert r.buckets["detection"] == 0 and r.buckets["productive"] == pytest.approx(99)
    assert [f.fault for f in r.faults] == ["straggler"]


def test_out_of_order_events_give_the_same_answer() -> None:
    tl = clean()
    random.Random(1).shuffle(tl)
    assert report(tl).buckets == report(clean()).buckets


def test_missing_and_malformed_events_are_noted_not_raised() -> None:
    r = report([e for e in clean() if e[1] != "attempt_progress"])  # ended without a summary
    assert r.buckets["running_no_beacons"] == pytest.approx(112 - 11.5)
    assert any("no attempt_progress" in n for n in r.notes)
    bad = [*start(), ev(30, "fault_detected", 1, fault="crash", fault_at="soon", nodes=None)]
    r = report([*bad, *finish(31, 1, "failed", "failed"), ev(40, "first_beacon", None)])
    assert any("without fault_at" in n for n in r.notes) and r.buckets["detection"] == 0
    r = report([*start(), *finish(40, 1, "failed", "failed")])
    assert any("without a fault_detected" in n for n in r.notes)
    r = report(clean(), ended_at=None)  # completed, but the record has no end time
    assert r.wall_s == pytest.approx(113) and any("no end time" in n for n in r.notes)
    r = report(clean(), submitted_at=T0 + 500)  # ends before it was submitted
    assert r.wall_s == 0 and r.goodput == 0 and r.notes


def test_fuzz_dropped_shuffled_and_skewed_events_keep_the_invariants() -> None:
    rng = random.Random(7)
    sources = [clean(2.0), gpu_fault([decide(50.6, "wait")]), start()]

    def skew(v: Any) -> Any:
        return v + rng.uniform(-8, 8) if isinstance(v, float) else v

    for _ in range(300):
        tl = [e for e in rng.choice(sources) if rng.random() > 0.25]
        tl = [(skew(t), k, n, {key: skew(v) for key, v in d.items()}) for t, k, n, d in tl]
        rng.shuffle(tl)
        check(compute_goodput(*make(tl), now=T0 + rng.uniform(-10, 200)))


def test_render_headline_buckets_timeline_and_formats() -> None:
    console = Console(record=True, width=120)
    render(report(clean()), console=console)
    text = console.export_text()
    assert text.splitlines()[0] == "job 7: goodput 87.6% of 1m53s wall; ETTR 89.2%"
    assert "productive" in text and "shutdown" in text and "recomputed" not in text
    render(report(gpu_fault([decide(50.6, "restart", W1)])), console=console)
    text = console.export_text()
    assert "+53.2s  attempt 2 started on workers-0,spares-0 (replaced workers-1 after gpu" in text
    assert "+50.0s  gpu_fault on workers-1: gpu_fault! (detected after 0.5s)" in text
    render(report(start(), now=50), console=console)
    assert "(running, so far)" in console.export_text()
    assert fmt_duration(724) == "12m04s" and fmt_duration(45.24) == "45.2s"
    assert fmt_duration(3723) == "1h02m03s" and fmt_duration(59.97) == "1m00s"
    assert fmt_offset(62.3) == "+1m02.3s" and fmt_offset(3.14) == "+3.1s"


def preempted(last_step: int, saved: int | None) -> list[Ev]:
    """Notice at 50 (steps 0..``last_step``, ``saved`` the newest checkpoint); stopped at 58;
    back in the queue until attempt 2 is created at 100, its first rank at 101."""
    return [
        *start(),
        ev(50, "job_preempted", 1, reason="job 9 needs the nodes"),
        ev(50, "attempt_state", 1, old="running", new="stopping", cause="preempted"),
        ev(50, "job_state", old="running", new="stopping"),
        progress(58, 1, 0, last_step, 11.5, 52.0, last_checkpoint_step=saved),
        ev(58, "attempt_state", 1, old="stopping", new="failed", cause="preempted"),
        ev(58, "job_state", old="stopping", new="preempted"),
        ev(100, "attempt_created", 2, nodes=[W0, W1], restart_reason=""),
        ev(101.2, "rank_started", 2, rank=0, pid=300, started_at=101),
    ]


def test_preemption_is_its_own_bucket_not_a_fault() -> None:
    # Saved at once on the notice (step 40): the resumed attempt starts at 41, nothing redone.
    r = report([
        *preempted(last_step=40, saved=40),
        ev(108.1, "first_beacon", 2, at=108, step=41),
        progress(160, 2, 41, 99, 108, 158),
        *finish(160, 2),
    ])  # fmt: skip
    assert nonzero(r) == {
        "queued": 2, "startup": 9.5, "productive": 40.5 + 50,
        "preemption": (58 - 52) + (101 - 58), "reload": 7, "shutdown": 3,
    }  # fmt: skip
    assert r.faults == [] and r.notes == []
    assert r.attempts[0].preempted_at == T0 + 50 and r.attempts[0].cause == "preempted"


def test_steps_redone_after_a_preemption_are_lost_to_it() -> None:
    # The script ignored the notice: it resumes from its periodic checkpoint at step 30.
    r = report([
        *preempted(last_step=40, saved=30),
        ev(108.1, "first_beacon", 2, at=108, step=31),
        progress(160, 2, 31, 99, 108, 158),
        *finish(160, 2),
    ])  # fmt: skip
    assert r.buckets["preemption"] == pytest.approx(6 + 43 + 10)  # + steps 31..40 redone
    assert r.buckets["recomputed"] == 0 and r.buckets["restart"] == 0
    assert r.buckets["productive"] == pytest.approx(40.5 + 50 - 10)


def test_a_job_waiting_after_its_preemption_counts_the_wait_as_preemption() -> None:
    waiting = [e for e in preempted(last_step=40, saved=40) if e[0] < 100]
    r = report(waiting, now=80)
    assert nonzero(r) == {
        "queued": 2, "startup": 9.5, "productive": 40.5, "preemption": 80 - 52,
    }  # fmt: skip
    assert r.state == "preempted" and r.ended_at is None
