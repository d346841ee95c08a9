"""Start-up: the store brought in line with the spec, and a grace period for the agents.

Idempotent, so a restarted controller runs it again and loses nothing: nodes the spec
declares are added if missing (never removed: a node's history stays), every agent gets a
fresh heartbeat deadline (it may be beating already), every live allocation a fresh lease,
and the spec's users are made known.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.controller.access import Access
from trainpod.controller.allocations import Allocations
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.model.events import ControllerStarted, NodeDeclared
from trainpod.store.repo import Store


@dataclass
class Startup:
    store: Store
    cfg: ControllerConfig
    scheduling: Scheduling
    allocations: Allocations
    access: Access

    def run(self, now: float) -> None:
        """Under the controller's lock, in one transaction."""
        known = {n.name for n in self.store.nodes()}
        declared = self.cfg.nodes if self.scheduling.declares_nodes else []
        for decl in declared:
            if decl.name not in known:
                self.store.insert_node(
                    decl.name, decl.group, decl.role, decl.spare, decl.devices, now
                )
                self.store.append(now, NodeDeclared(node=decl.name, group=decl.group))
        restarted = self.store.get_meta("started_at") is not None
        self.store.set_meta("started_at", repr(now))
        self.store.touch_heartbeats(now)
        self.allocations.adopt(now)
        self.store.append(now, ControllerStarted(restarted=restarted))
        self.access.seed(self.cfg.users)
