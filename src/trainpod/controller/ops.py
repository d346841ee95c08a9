"""What the controller asks of an external scheduler, behind one small seam.

The embedded backend places jobs itself and needs none of it (:class:`NoOps`). On Slurm
(:class:`trainpod.slurm.ops.SlurmOps`) the controller submits each job with ``sbatch`` and
leaves placement, partitions and priorities to Slurm; it drains and resumes nodes there and
requeues a job that has no spare left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainpod.spec.job import JobSpec


@dataclass(frozen=True)
class ExternalJob:
    """A job as the external scheduler sees it."""

    id: str
    state: str  # Slurm's job_state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...
    reason: str = ""  # why it is pending (Priority, Resources, Dependency, ...)
    nodes: tuple[str, ...] = ()
    restarts: int = 0

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


@dataclass(frozen=True)
class ExternalNode:
    name: str
    state: str  # IDLE, ALLOCATED, MIXED, DOWN, ...
    flags: frozenset[str] = field(default_factory=frozenset)  # DRAIN, NOT_RESPONDING, ...
    reason: str = ""

    @property
    def down(self) -> bool:
        return self.state == "DOWN" or "NOT_RESPONDING" in self.flags


@dataclass(frozen=True)
class Observed:
    """One look at the external scheduler: our jobs by external id, and every node."""

    jobs: dict[str, ExternalJob]
    nodes: dict[str, ExternalNode]


class ClusterOps:
    """The embedded backend's answers: the controller places jobs; nothing is external."""

    places_jobs = True

    def render(self, job_id: int, spec: JobSpec) -> str | None:
        """What would be submitted for ``spec`` (the batch script), or None."""
        return None

    def submit(self, job_id: int, spec: JobSpec) -> str:
        """Hand the job to the external scheduler; its id there ("" when none)."""
        return ""

    def cancel(self, external: str) -> None:
        pass

    def requeue(self, external: str, exclude: list[str]) -> None:
        pass

    def release(self, external: str) -> None:
        """Release a job the external scheduler holds."""

    def drain(self, node: str, reason: str) -> None:
        pass

    def resume(self, node: str) -> None:
        pass

    def observe(self, externals: list[str]) -> Observed | None:
        """The external state of ``externals`` and the nodes; None when nothing is external."""
        return None


NoOps = ClusterOps
