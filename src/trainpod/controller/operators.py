"""Actions on nodes from outside: an operator's drain, quarantine, resume or replace, each
with a reason, and what an external scheduler (Slurm) says of its nodes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainpod.api.models import NodeAction
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.ops import Observed
from trainpod.controller.policy import FaultKind
from trainpod.controller.repair import NodeRepair
from trainpod.controller.transitions import HEALTHY_NODE_STATES, Transitions
from trainpod.errors import Conflict
from trainpod.model.events import NODE_ACTIONS
from trainpod.model.states import NodeState
from trainpod.store.repo import Store
from trainpod.store.rows import NodeRow


@dataclass
class Operators:
    store: Store
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    repair: NodeRepair

    def act(self, node: NodeRow, action: NodeAction, now: float) -> None:
        why = f"operator: {action.reason}"
        self.store.append(now, NODE_ACTIONS[action.action](node=node.name, reason=action.reason))
        if action.action == "drain":
            self.store.update_node(node.name, now, drained=True, reason=f"drained ({why})")
            self.scheduling.drain(node.name, why, now)
        elif action.action == "quarantine":
            self.executor.quarantine(node, why, FaultKind.QUARANTINED, now, repair=False)
        elif action.action == "replace":
            self._replace(node, why, now)
        else:
            self._resume(node, now)

    def observed(self, obs: Observed, now: float) -> None:
        """Apply one look at the external scheduler: ended jobs and pending reasons go to
        :class:`Scheduling`; the nodes it reports DOWN are quarantined as lost."""
        for node, reason in self.scheduling.observe(obs, now):
            self.executor.quarantine(
                self.tx.node(node.name),
                reason,
                FaultKind.NODE_LOST,
                now,
                repair=self.tx.cfg.auto_repair,
            )

    def _replace(self, node: NodeRow, why: str, now: float) -> None:
        if self.repair.replacer is None:
            raise Conflict(f"the {self.tx.cfg.backend} backend cannot replace nodes")
        self.executor.quarantine(node, why, FaultKind.QUARANTINED, now, repair=True)
        node = self.tx.node(node.name)
        if node.state is NodeState.QUARANTINED:
            rep = replace(node.repair, requested=True)
            self.store.update_node(node.name, now, repair=rep.to_json(), reason=why)

    def _resume(self, node: NodeRow, now: float) -> None:
        self.store.update_node(node.name, now, drained=False)
        node = self.tx.node(node.name)
        if node.state in (NodeState.QUARANTINED, NodeState.RETIRED):
            self.repair.begin(node, "check", now)
        elif node.state is NodeState.FAILED:
            if self.repair.replacer is None:
                raise Conflict(
                    f"{node.name} failed its lifecycle scripts; fix them and restart the node"
                )
            self.repair.begin(node, "replace", now)
        elif node.state in HEALTHY_NODE_STATES:
            self.store.update_node(node.name, now, reason="")
            self.scheduling.resume(node.name, now)
