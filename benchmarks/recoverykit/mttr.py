"""Part 1 of the recovery benchmark: detect, tear down, restart, first step, per fault class."""

from __future__ import annotations

import itertools
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recoverykit.common import (
    MAIN_GROUPS,
    POOL_TIMEOUT_S,
    RECOVERY_TIMEOUT_S,
    SLOW_WATCH_S,
    SPLIT,
    START_TIMEOUT_S,
    WARM_S,
    JobEnded,
    JobWatch,
    StepLine,
    _count,
    _diff,
    all_idle,
    end_job,
    gen_first_step,
    median,
    node_of_rank,
    read_progress,
    split_start,
    steps_spec,
    summary,
    wait_until,
)
from trainpod.api.models import ChaosFault, ChaosRequest
from trainpod.client.http import TrainpodClient
from trainpod.errors import TrainpodError


# -- 1. MTTR per fault class ------------------------------------------------------------------
@dataclass(frozen=True)
class FaultClass:
    name: str
    fault: ChaosFault
    expect: str  # the fault kind fault_detected should say
    node_fault: bool  # the node is replaced: needs a free node, then a repair


CLASSES = (
    FaultClass("crash", "kill-worker", "crash", False),
    FaultClass("hang", "hang", "hang", False),
    FaultClass("gpu_fault", "xid79", "gpu_fault", True),
    FaultClass("node_lost", "kill-agent", "node_lost", True),
    FaultClass("node_fault", "disk-full", "node_fault", True),
)
ALL_CLASSES = (*(fc.name for fc in CLASSES), "slow")
NEEDS_RANK = frozenset({"kill-worker", "hang", "slow"})
PHASES = (
    ("inject_to_detect_s", "det(inj)"),
    ("fault_to_detect_s", "det(est)"),
    ("inject_to_node_out_s", "node out"),
    ("teardown_s", "teardown"),
    ("restart_s", "restart"),
    ("to_first_beacon_s", "->beacon"),
    ("total_s", "total"),
    ("inject_to_first_step_s", "->1st step"),
    ("repair_s", "repair"),
)


@dataclass
class Injection:
    fault: str
    node: str
    attempt: int  # the attempt the fault hit
    new_attempt: int | None = None  # the attempt that beaconed next
    detected_as: str | None = None  # fault_detected's kind
    classified_as: str | None = None  # the final kind (fault_classified, when it differs)
    ok: bool = False  # recovered: a later attempt sent a progress beacon
    label_ok: bool = False  # classified as the expected kind
    decision_counts: bool | None = None  # the restart counted against max_restarts
    replaced: dict[str, str] = field(default_factory=dict)
    decision: str = ""
    reason: str = ""
    injected_at: float | None = None  # chaos_injected's ts
    fault_at: float | None = None
    detected_at: float | None = None
    failed_at: float | None = None
    rank_started_at: float | None = None
    first_beacon_at: float | None = None
    first_step_at: float | None = None  # progress file, the new generation
    split: dict[str, float | None] = field(default_factory=dict)  # SPLIT, from injected_at
    inject_to_detect_s: float | None = None
    fault_to_detect_s: float | None = None
    teardown_s: float | None = None
    restart_s: float | None = None
    to_first_beacon_s: float | None = None
    total_s: float | None = None
    inject_to_first_step_s: float | None = None
    repair_s: float | None = None  # fault_detected -> node_repaired of the faulty node
    node_out_at: float | None = None  # the node at fault turned suspect or quarantined
    inject_to_node_out_s: float | None = None
    pool_wait_s: float | None = None  # waited before injecting for the pool to be idle
    error: str = ""


def measure(watch: JobWatch, inj: Injection, order_id: str, ckpt: Path) -> None:
    """Fill in ``inj`` from the job's events and the progress file."""
    a, b = inj.attempt, inj.new_attempt
    if (e := watch.find("chaos_injected", id=order_id)) is not None:
        inj.injected_at = e.ts
    if (e := watch.find("fault_detected", attempt=a)) is not None:
        inj.detected_at = e.ts
        inj.fault_at = float(e.data["fault_at"]) if e.data.get("fault_at") is not None else None
        inj.detected_as = str(e.data.get("fault"))
        inj.reason = str(e.data.get("reason", ""))[:300]
    inj.classified_as = inj.detected_as
    if (e := watch.find("fault_classified", attempt=a)) is not None:
        inj.classified_as = str(e.data.get("fault"))
    if (e := watch.find("attempt_state", attempt=a, new="failed")) is not None:
        inj.failed_at = e.ts
    if (e := watch.find("recovery_decision", attempt=a)) is not None:
        inj.decision = str(e.data.get("action"))
        inj.decision_counts = bool(e.data.get("counts"))
        inj.replaced = dict(e.data.get("replaced") or {})
    if b is not None:
        starts = [float(e.data.get("started_at") or e.ts) for e in watch.all("rank_started", b)]
        inj.rank_started_at = min(starts, default=None)
        if (e := watch.find("first_beacon", attempt=b)) is not None:
            inj.first_beacon_at = float(e.data.get("at") or e.ts)
        lines = read_progress(ckpt)
        inj.first_step_at = gen_first_step(lines, b - 1)
        inj.split = split_start(lines, b - 1, inj.injected_at)
    inj.inject_to_detect_s = _diff(inj.detected_at, inj.injected_at)
    inj.fault_to_detect_s = _diff(inj.detected_at, inj.fault_at)
    inj.teardown_s = _diff(inj.failed_at, inj.detected_at)
    inj.restart_s = _diff(inj.rank_started_at, inj.failed_at)
    inj.to_first_beacon_s = _diff(inj.first_beacon_at, inj.rank_started_at)
    inj.total_s = _diff(inj.first_beacon_at, inj.injected_at)
    inj.inject_to_first_step_s = _diff(inj.first_step_at, inj.injected_at)


def add_repair_times(client: TrainpodClient, samples: list[Injection], after_id: int) -> None:
    """fault_detected -> node_repaired of the node at fault, for node faults."""
    repaired = [e for e in client.events(after=after_id) if e.kind == "node_repaired"]
    for s in samples:
        if s.detected_at is None:
            continue
        e = next((e for e in repaired if e.node == s.node and e.ts > s.detected_at), None)
        s.repair_s = _diff(e.ts if e else None, s.detected_at)


def inject(client: TrainpodClient, fc: FaultClass, node: str) -> str:
    """Inject ``fc`` into ``node`` (rank 1 where the fault needs a rank); the order's id."""
    rank = 1 if fc.fault in NEEDS_RANK else None
    return client.chaos(ChaosRequest(node=node, fault=fc.fault, rank=rank)).id


def run_class(
    client: TrainpodClient,
    fc: FaultClass,
    repeats: int,
    workdir: Path,
    *,
    nodes: int = 2,
    procs: int = 1,
    partition: str = "main",
    label: str = "",
    env: dict[str, str] | None = None,
) -> tuple[list[Injection], list[str]]:
    """One job of steps.py; ``repeats`` injections of ``fc``, each until the next attempt
    beacons. Returns the injections and the errors that stopped the class early."""
    label = label or fc.name
    ckpt = workdir / f"steps-{label}"
    start_id = _last_event_id(client)
    spec = steps_spec(
        f"recovery-{label}", ckpt, workdir, nodes=nodes, procs=procs, partition=partition, env=env
    )
    job = client.submit(spec)
    watch = JobWatch(client, job.id)
    samples: list[Injection] = []
    errors: list[str] = []
    try:
        watch.wait_beacon_after(0, START_TIMEOUT_S)
        for _ in range(repeats):
            pool_wait = 0.0
            if fc.node_fault:
                t0 = time.monotonic()
                held = frozenset(client.job(job.id).attempts[-1].nodes)
                wait_until(
                    lambda h=held: all_idle(client, MAIN_GROUPS, h),  # type: ignore[misc]
                    POOL_TIMEOUT_S,
                    "the repaired nodes to be idle again",
                )
                pool_wait = time.monotonic() - t0
            time.sleep(WARM_S)
            node, attempt = node_of_rank(client, job.id, rank=1)
            inj = Injection(fault=fc.fault, node=node, attempt=attempt, pool_wait_s=pool_wait)
            samples.append(inj)
            watch.poll()
            mark = watch.events[-1].id if watch.events else 0
            order_id = inject(client, fc, node)
            try:
                beacon = watch.wait_beacon_after(attempt, RECOVERY_TIMEOUT_S)
            except (TimeoutError, JobEnded) as exc:
                inj.error = str(exc)
                watch.poll()
                measure(watch, inj, order_id, ckpt)
                break
            inj.new_attempt = beacon.attempt
            measure(watch, inj, order_id, ckpt)
            out = [
                e
                for e in client.events(node=node, after=mark)
                if e.kind == "node_state" and e.data.get("new") in ("suspect", "quarantined")
            ]
            inj.node_out_at = out[0].ts if out else None
            inj.inject_to_node_out_s = _diff(inj.node_out_at, inj.injected_at)
            inj.ok = True
            inj.label_ok = inj.classified_as == fc.expect
    except (TimeoutError, JobEnded, TrainpodError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        end_job(client, job.id)
    if fc.node_fault:
        # The last repair: the next class needs every node back.
        try:
            wait_until(lambda: all_idle(client, MAIN_GROUPS), POOL_TIMEOUT_S, "every node idle")
        except TimeoutError as exc:
            errors.append(str(exc))
        add_repair_times(client, samples, start_id)
    return samples, errors


def _last_event_id(client: TrainpodClient) -> int:
    """The id of the newest event (the events API has no 'newest first'; one page per call)."""
    last = 0
    while batch := client.events(after=last, limit=500):
        last = batch[-1].id
    return last


def class_results(fc: FaultClass, samples: list[Injection], errors: list[str]) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    labels = _count(str(s.detected_as) for s in ok)
    classified = _count(str(s.classified_as) for s in ok)
    stats = {
        key: summary([v for s in ok if (v := getattr(s, key)) is not None]) for key, _ in PHASES
    }
    for key, _ in SPLIT:
        stats[key] = summary([v for s in ok if (v := s.split.get(key)) is not None])
    return {
        "fault": fc.fault,
        "expect": fc.expect,
        "injections": len(samples),
        "recovered": len(ok),
        "detected_as": labels,
        "classified_as": classified,
        "counted_against_max_restarts": sum(1 for s in ok if s.decision_counts),
        "errors": [s.error for s in samples if s.error] + errors,
        "summary": stats,
        "samples": [asdict(s) for s in samples],
    }


@dataclass
class SlowObservation:
    node: str = ""
    step_s_before: float | None = None  # median seconds per step, before the injection
    step_s_after: float | None = None  # after it (the job's pace: every rank waits)
    straggler_events: int = 0
    fault_events: list[str] = field(default_factory=list)
    watched_s: float = SLOW_WATCH_S
    note: str = (
        "2 ranks: trainpod's find_stragglers judges a rank only against >= 2 peers "
        "(min_peers=2), so a 2-rank job can never have a straggler; and in a job that "
        "all-reduces every step every rank runs at the slow rank's pace"
    )
    error: str = ""


def _step_time(lines: list[StepLine], rank: int, t0: float, t1: float) -> float | None:
    ts = sorted(x.t for x in lines if x.rank == rank and x.step >= 0 and t0 <= x.t <= t1)
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    return median(gaps) if gaps else None


def observe_slow(client: TrainpodClient, workdir: Path) -> SlowObservation:
    """Inject ``slow`` into rank 1 of a 2-rank job; record the pace and any detection."""
    ckpt = workdir / "steps-slow"
    job = client.submit(steps_spec("recovery-slow", ckpt, workdir))
    watch = JobWatch(client, job.id)
    obs = SlowObservation()
    try:
        watch.wait_beacon_after(0, START_TIMEOUT_S)
        time.sleep(2 * WARM_S)
        obs.node, _ = node_of_rank(client, job.id, rank=1)
        t_inj = time.time()
        client.chaos(ChaosRequest(node=obs.node, fault="slow", rank=1))
        time.sleep(SLOW_WATCH_S)
        watch.poll()
        lines = read_progress(ckpt)
        obs.step_s_before = _step_time(lines, 1, t_inj - 2 * WARM_S, t_inj)
        obs.step_s_after = _step_time(lines, 1, t_inj + 1.0, t_inj + SLOW_WATCH_S)
        obs.straggler_events = len(watch.all("straggler_detected"))
        obs.fault_events = [str(e.data.get("fault")) for e in watch.all("fault_detected")]
    except (TimeoutError, JobEnded) as exc:
        obs.error = str(exc)
    finally:
        end_job(client, job.id)
    return obs


REPLAY_WATCH_S = 45.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def check_kill_agent_replay(client: TrainpodClient, node: str = "duo-0") -> dict[str, Any]:
    """Chaos kill-agent into an idle node: is the order executed again by the agent that the
    repair starts (the dead agent never reported it done)? Watches up to REPLAY_WATCH_S."""
    start_id = _last_event_id(client)
    t0 = time.time()
    order = client.chaos(ChaosRequest(node=node, fault="kill-agent"))
    out: dict[str, Any] = {"node": node, "order": order.id, "replayed": None}

    def probe() -> bool:
        events = client.events(node=node, after=start_id)
        out["events"] = [
            {
                "t_s": round(e.ts - t0, 3),
                "kind": e.kind,
                **{k: v for k, v in e.data.items() if k in ("new", "reason", "agent_pid", "mode")},
            }
            for e in events
        ]
        if any(e.kind == "node_repaired" for e in events):
            out["replayed"] = False
            return True
        new = [int(e.data["agent_pid"]) for e in events if e.kind == "agent_registered"]
        dead = [pid for pid in new if not _alive(pid)]
        out["new_agents"], out["dead_new_agents"] = new, dead
        if dead:
            out["replayed"] = True
            return True
        return False

    with suppress(TimeoutError):
        wait_until(probe, REPLAY_WATCH_S, "the kill-agent replay check")
    state = next(n for n in client.nodes() if n.name == node)
    out["node_state_after_s"] = round(time.time() - t0, 1)
    out["node_state"] = f"{state.state}: {state.reason}"
    return out
