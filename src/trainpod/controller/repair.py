"""Node repair: a quarantined node is replaced (or checked in place) and deep-checked back.

A repair replaces the node like a new instance (fresh scratch, lifecycle scripts, a new
agent: the backend's ``replace_node``), or, where nodes cannot be re-provisioned (Slurm),
checks it in place through its live agent. Either way it must pass a deep health check
(burn-in) to rejoin; too many failed repairs retire it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from trainpod.api.models import Heartbeat
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.controller.nodes import lifecycle_failure
from trainpod.controller.transitions import Transitions
from trainpod.model.events import DeepCheckFinished, DeepCheckStarted, NodeRepaired
from trainpod.model.failures import RepairState
from trainpod.model.states import NodeState
from trainpod.store.repo import Store
from trainpod.store.rows import NodeRow

log = logging.getLogger(__name__)

REPAIR_SLACK_S = 120.0  # on top of the deep check's own timeout
Replacer = Callable[[str], None]
"""Replaces a node like a new instance (the backend's ``replace_node``); blocking."""


@dataclass
class NodeRepair:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    replacer: Replacer | None

    def step(self, now: float) -> None:
        """Start requested repairs; fail those that took too long."""
        for node in self.store.nodes_in([NodeState.QUARANTINED, NodeState.REPAIRING]):
            rep = node.repair
            if node.state is NodeState.QUARANTINED and rep.requested:
                if node.job_id is not None:
                    continue  # its attempt is still being torn down
                if self.replacer is not None:
                    self.begin(node, "replace", now)
                elif self.scheduling.checks_in_place and self._agent_alive(node, now):
                    # Slurm nodes cannot be re-provisioned from here: check the node in
                    # place through its live agent; a pass resumes it in Slurm.
                    self.begin(node, "check", now)
            elif node.state is NodeState.REPAIRING:
                started = now if rep.started_at is None else rep.started_at
                limit = started + self.cfg.deep_check_timeout_s + REPAIR_SLACK_S
                if now > limit:
                    self.failed(node, "repair did not finish in time", now)

    def begin(self, node: NodeRow, mode: str, now: float) -> None:
        rep = RepairState(
            mode=mode,
            started_at=now,
            old_agent=node.agent_id if mode == "replace" else None,
            kind=_kind(node.repair),
            nulls=frozenset({"old_agent"}),  # written even when there is none
        )
        self.tx.set_node(
            node, NodeState.REPAIRING, now, reason=f"repairing ({mode})", repair=rep.to_json()
        )
        if mode == "replace":
            replacer = self.replacer
            assert replacer is not None
            threading.Thread(target=_run_replacer, args=(replacer, node.name), daemon=True).start()
        self.tx.wake.bump()

    def on_heartbeat(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        rep = node.repair
        if rep.mode == "replace" and hb.agent_id == rep.old_agent:
            return  # the old instance is still reporting; the new one is not up yet
        if hb.lifecycle.state == "failed":
            self.failed(node, lifecycle_failure(hb.lifecycle.results), now)
            return
        if hb.lifecycle.state != "ok":
            return
        if not rep.deep_check_id:
            check_id = uuid.uuid4().hex[:12]
            rep = replace(rep, deep_check_id=check_id)
            self.store.update_node(node.name, now, repair=rep.to_json())
            self.store.append(now, DeepCheckStarted(node=node.name, check_id=check_id))
            self.tx.wake.bump()
            return
        result = hb.deep_check
        if result is None or result.id != rep.deep_check_id or result.status == "running":
            return
        self.store.append(
            now, DeepCheckFinished(node=node.name, status=result.status, reason=result.reason)
        )
        if result.status == "fault":
            self.failed(node, f"deep check failed: {result.reason}", now)
            return
        done = RepairState().to_json()  # none in progress: {}
        self.tx.set_node(node, NodeState.IDLE, now, reason="", repair=done, repairs=0, job_id=None)
        self.store.append(now, NodeRepaired(node=node.name, mode=rep.mode))
        self.scheduling.resume(node.name, now)
        self.tx.wake.bump()

    def failed(self, node: NodeRow, reason: str, now: float) -> None:
        failures = node.repairs + 1
        if failures >= self.cfg.retire_after:
            self.tx.set_node(
                node,
                NodeState.RETIRED,
                now,
                repairs=failures,
                repair=RepairState().to_json(),
                reason=f"retired after {failures} failed repairs; last: {reason}",
            )
        else:
            again = RepairState(requested=self.cfg.auto_repair, kind=_kind(node.repair), since=now)
            self.tx.set_node(
                node,
                NodeState.QUARANTINED,
                now,
                repairs=failures,
                repair=again.to_json(),
                reason=f"repair {failures} failed: {reason}",
            )
        self.tx.wake.bump()

    def _agent_alive(self, node: NodeRow, now: float) -> bool:
        return (
            node.agent_id is not None
            and node.last_heartbeat is not None
            and now - node.last_heartbeat <= self.cfg.heartbeat_timeout_s
        )


def _kind(repair: RepairState) -> str:
    """The fault kind that took the node out, carried from one repair state to the next
    (``""`` when not known, as before)."""
    return "" if repair.kind is None else repair.kind


def _run_replacer(replacer: Replacer, node: str) -> None:
    try:
        replacer(node)
    except Exception:  # the repair's timeout in NodeRepair.step turns this into a failure
        log.exception("replacing node %s failed", node)
