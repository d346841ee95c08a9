"""Who places jobs: trainpod itself (the embedded backend) or an external scheduler.

:class:`Scheduling` is the one seam where the two differ; the controller holds one
instance and never asks which it is. :class:`EmbeddedScheduling` is trainpod's own
placement (FIFO gangs over the spec's nodes); Slurm's lives in
:mod:`trainpod.slurm.scheduling`. Every method runs under the controller's lock, inside
its store transaction.
"""

from __future__ import annotations

from trainpod.api.models import Heartbeat, LaunchPlan
from trainpod.controller.config import ControllerConfig
from trainpod.controller.ops import Observed
from trainpod.controller.sharing import sharing_policy
from trainpod.controller.transitions import Transitions
from trainpod.errors import SpecError
from trainpod.model.states import NodeState
from trainpod.scheduler.base import NodeSlot, Scheduler
from trainpod.scheduler.shared import SharedScheduler
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow


class Scheduling:
    """The embedded answers; an external scheduler overrides what it does differently."""

    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        tx: Transitions,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.store = store
        self.cfg = config
        self.tx = tx
        self.scheduler = scheduler or SharedScheduler(sharing_policy(config))

    #: the spec's nodes exist from the start (an external scheduler's appear with agents)
    declares_nodes = True
    #: a quarantined node can be checked in place through its live agent (no re-provision)
    checks_in_place = False
    #: trainpod stops a job that runs past its --time (an external scheduler does that itself)
    enforces_time_limits = True

    # -- submission -------------------------------------------------------------------------
    def check_spec(self, spec: JobSpec, part: str, members: int, spares: int) -> None:
        """Refuse a job that can never run here (``members``: the partition's nodes)."""
        slurm_only = spec.slurm_only()
        if slurm_only:
            raise SpecError(
                f"{', '.join(slurm_only)} only apply on a Slurm cluster; cluster "
                f"{self.cfg.cluster} uses the {self.cfg.backend} backend (its hot spares are "
                "the spec's spare groups); remove them"
            )
        if spec.nodes > members:
            raise SpecError(
                f"the job asks for {spec.nodes} nodes but partition {part!r} has "
                f"{members} schedulable nodes ({spares} hot spares are held back for "
                f"recovery); ask for --nodes {members} or fewer"
            )

    def submitted(self, job_id: int, spec: JobSpec, now: float) -> None:
        """The job was queued (inside the submit transaction)."""

    def dry_run(self, spec: JobSpec, part: str) -> LaunchPlan | None:
        """The external scheduler's plan for ``spec``; None: trainpod plans it."""
        return None

    def cancelled(self, job: JobRow, now: float) -> None:
        """The job's cancel was requested."""

    # -- nodes ------------------------------------------------------------------------------
    def unknown_node(self, hb: Heartbeat, now: float) -> NodeRow | None:
        """A heartbeat from a node the store does not know: declare it, or None."""
        return None

    def heartbeat(self, node: NodeRow, hb: Heartbeat, now: float) -> NodeRow:
        """Allocation bookkeeping of an agent's beat; returns the node as it is now."""
        return node

    def leave_code(self, row: NodeRow | None) -> int | None:
        """The exit code an agent must leave with (its job is over), or None to stay."""
        return None

    def slot(self, node: NodeRow) -> NodeSlot:
        """The node as the scheduler sees it."""
        free = (
            node.state is NodeState.IDLE
            and not node.spare
            and node.role == "compute"
            and not node.drained
        )
        return NodeSlot(node.name, node.group, free, node.allocation)

    def allocation_gone(self, node: NodeRow, now: float) -> bool:
        """A silent node whose allocation ended (not a fault); True if handled."""
        return False

    def recovery_pool(self, job_id: int, rows: list[NodeRow]) -> list[NodeRow]:
        """The nodes recovery may give ``job_id``: all of them here."""
        return rows

    def drain(self, node: str, reason: str, now: float) -> None:
        """Tell the external scheduler a node is out of service."""

    def resume(self, node: str, now: float) -> None:
        """Tell the external scheduler a node is back."""

    # -- recovery ---------------------------------------------------------------------------
    def requeue(self, job: JobRow, attempt: AttemptRow, bad: list[str], now: float) -> str | None:
        """No spare is left: requeue the job elsewhere if this scheduler can (returns the
        reason), else None (the job waits for a spare here)."""
        return None

    # -- the external scheduler's view ------------------------------------------------------
    def external_ids(self, now: float) -> list[str]:
        return []

    def observe(self, obs: Observed, now: float) -> list[tuple[NodeRow, str]]:
        """Apply one look at the external scheduler; the nodes it reports down, and why."""
        return []


EmbeddedScheduling = Scheduling
