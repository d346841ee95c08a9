"""Plain records read from the store. The controller never hands out sqlite rows."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from trainpod.model.failures import Failure, RepairState
from trainpod.model.recovery import InProcess
from trainpod.model.states import AttemptState, JobState, NodeState, RankState

_NO_REPAIR = RepairState()


def _repair(column: str) -> RepairState:
    """A node's ``repair`` column; its usual ``{}`` (none in progress) without decoding."""
    return _NO_REPAIR if column == "{}" else RepairState.from_json(json.loads(column))


@dataclass(frozen=True)
class NodeRow:
    name: str
    group: str
    role: str
    spare: bool
    devices: int
    state: NodeState
    reason: str
    job_id: int | None
    address: str | None
    agent_id: str | None
    agent_pid: int | None
    last_heartbeat: float | None
    facts_json: str  # the agent's last report of its node (JSON text, as stored)
    updated_at: float
    drained: bool = False
    repairs: int = 0  # failed repairs so far
    repair: RepairState = field(default_factory=RepairState)  # the repair in progress, if any
    allocation: int | None = None  # Slurm: the job whose allocation this node's agent serves

    @cached_property
    def facts(self) -> dict[str, Any]:
        """The facts, decoded on first use: most readers of a node (the heartbeat path, the
        scheduler's snapshot of every node, the watchdog) never look at them, and decoding
        a node's ~2 KB of facts and health results each time was most of their cost."""
        decoded: dict[str, Any] = json.loads(self.facts_json)
        return decoded

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> NodeRow:
        return cls(
            name=r["name"],
            group=r["grp"],
            role=r["role"],
            spare=bool(r["spare"]),
            devices=r["devices"],
            state=NodeState(r["state"]),
            reason=r["reason"],
            job_id=r["job_id"],
            address=r["address"],
            agent_id=r["agent_id"],
            agent_pid=r["agent_pid"],
            last_heartbeat=r["last_heartbeat"],
            facts_json=r["facts"],
            updated_at=r["updated_at"],
            drained=bool(r["drained"]),
            repairs=r["repairs"],
            repair=_repair(r["repair"]),
            allocation=r["allocation"],
        )


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    spec: dict[str, Any]
    state: JobState
    reason: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    cancel_requested: bool
    updated_at: float
    external: str = ""  # the job's id in an external scheduler (Slurm), if any
    held_by: str = ""  # who holds it in the queue (`trainpod hold`); empty: not held

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> JobRow:
        return cls(
            id=r["id"],
            name=r["name"],
            spec=json.loads(r["spec"]),
            state=JobState(r["state"]),
            reason=r["reason"],
            submitted_at=r["submitted_at"],
            started_at=r["started_at"],
            ended_at=r["ended_at"],
            cancel_requested=bool(r["cancel_requested"]),
            external=r["external"],
            updated_at=r["updated_at"],
            held_by=r["held_by"],
        )


@dataclass(frozen=True)
class RankRow:
    attempt_id: int
    rank: int
    node: str
    local_rank: int
    state: RankState
    pid: int | None
    exit_code: int | None
    signal: int | None
    started_at: float | None
    ended_at: float | None

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> RankRow:
        return cls(
            attempt_id=r["attempt_id"],
            rank=r["rank"],
            node=r["node"],
            local_rank=r["local_rank"],
            state=RankState(r["state"]),
            pid=r["pid"],
            exit_code=r["exit_code"],
            signal=r["signal"],
            started_at=r["started_at"],
            ended_at=r["ended_at"],
        )

    @property
    def failed(self) -> bool:
        return self.state is RankState.LOST or (
            self.state is RankState.EXITED and (self.exit_code != 0 or self.signal is not None)
        )


@dataclass(frozen=True)
class AttemptRow:
    id: int
    job_id: int
    number: int
    state: AttemptState
    nodes: list[str]
    master_addr: str
    master_port: int
    created_at: float
    started_at: float | None
    ended_at: float | None
    cause: str
    failure: Failure = field(default_factory=Failure)
    restart_reason: str = ""
    in_process: InProcess = field(default_factory=InProcess)
    lent_by: tuple[int, ...] = ()
    """Waiting jobs whose reserved nodes it was started on (ADR 0050)."""

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> AttemptRow:
        return cls(
            id=r["id"],
            job_id=r["job_id"],
            number=r["number"],
            state=AttemptState(r["state"]),
            nodes=json.loads(r["nodes"]),
            master_addr=r["master_addr"],
            master_port=r["master_port"],
            created_at=r["created_at"],
            started_at=r["started_at"],
            ended_at=r["ended_at"],
            cause=r["cause"],
            failure=Failure.from_json(json.loads(r["failure"])),
            restart_reason=r["restart_reason"],
            in_process=InProcess.from_json(json.loads(r["in_process"])),
            lent_by=tuple(int(j) for j in json.loads(r["lent_by"])),
        )


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    kind: str
    node: str | None
    job_id: int | None
    attempt: int | None
    data: dict[str, Any]

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> EventRow:
        return cls(
            id=r["id"],
            ts=r["ts"],
            kind=r["kind"],
            node=r["node"],
            job_id=r["job_id"],
            attempt=r["attempt"],
            data=json.loads(r["data"]),
        )
