"""Chaos requests: a fault for a node's agent to inject through a real mechanism.

The request is checked against what runs on the node (a fault aimed at a rank needs one
running there), then queued in the :class:`~trainpod.controller.books.ChaosBook`, from which
the node's next orders carry it; the agent's acknowledgement is taken in by the heartbeat
intake.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from trainpod.api.models import ChaosOrder, ChaosRequest
from trainpod.controller.books import ChaosBook
from trainpod.controller.transitions import Transitions
from trainpod.errors import Conflict
from trainpod.model.events import ChaosInjected
from trainpod.model.states import NodeState, RankState
from trainpod.store.repo import Store

#: faults aimed at one rank: the request may name it, else the node's first running rank
_NEEDS_RANK = {"kill-worker", "hang", "slow"}


@dataclass
class ChaosDesk:
    store: Store
    tx: Transitions
    book: ChaosBook

    def inject(self, req: ChaosRequest, now: float) -> ChaosOrder:
        """Queue ``req`` for its node's agent; :class:`Conflict` if it cannot run there."""
        node = self.tx.node(req.node)
        if node.agent_id is None or node.state in (NodeState.STOPPED, NodeState.RETIRED):
            raise Conflict(f"{node.name} has no running agent to inject {req.fault} with")
        rank = req.rank
        if req.fault in _NEEDS_RANK:
            running = self._running_ranks(node.name)
            if not running:
                raise Conflict(f"{req.fault} needs a running rank on {node.name}; none is")
            if rank is None:
                rank = running[0]
            elif rank not in running:
                raise Conflict(f"rank {rank} is not running on {node.name}: {running}")
        order = ChaosOrder(id=uuid.uuid4().hex[:12], fault=req.fault, rank=rank)
        self.book.add(node.name, order)
        event = ChaosInjected(
            node=node.name, job_id=node.job_id, fault=req.fault, rank=rank, order_id=order.id
        )
        self.store.append(now, event)
        return order

    def _running_ranks(self, node: str) -> list[int]:
        return [
            r.rank
            for a in self.store.active_attempts()
            if node in a.nodes
            for r in self.store.ranks(a.id)
            if r.node == node and r.state is RankState.RUNNING
        ]
