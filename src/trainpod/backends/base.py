"""The backend seam: how a cluster's processes come to exist, and a registry of backends.

A backend brings up the controller and the node agents; after that every backend looks
the same to the controller (agents heartbeat and take orders). Backends are registered
by name, the name used in the spec's ``backend:`` key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from trainpod.errors import SpecError
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class ProcessStatus:
    name: str  # "controller" or "agent-<node>"
    pid: int | None
    alive: bool
    log: Path


class Backend(ABC):
    name: ClassVar[str]

    def __init__(self, paths: ClusterPaths) -> None:
        self.paths = paths

    @abstractmethod
    def create(self, spec: ClusterSpec, spec_path: Path) -> ClusterRecord:
        """Create the cluster's state and start its processes. Raises Conflict if it exists."""

    @abstractmethod
    def start(self) -> list[str]:
        """Start whatever of the cluster is not running; return what was started. Idempotent."""

    @abstractmethod
    def stop(self) -> list[str]:
        """Stop the processes this backend started (by pid); return what was stopped."""

    @abstractmethod
    def delete(self, *, purge: bool) -> None:
        """Stop and remove the cluster's state; keep the shared dir unless ``purge``."""

    @abstractmethod
    def replace_node(self, node: str) -> None:
        """Replace a node with a fresh instance (clean scratch, lifecycle scripts again).

        Called by the controller to repair a quarantined node; blocking."""

    @abstractmethod
    def processes(self) -> list[ProcessStatus]:
        """The cluster's processes and whether each is alive."""


_REGISTRY: dict[str, type[Backend]] = {}


def register(cls: type[Backend]) -> type[Backend]:
    _REGISTRY[cls.name] = cls
    return cls


def backend_for(name: str, paths: ClusterPaths) -> Backend:
    _load_builtin()
    try:
        return _REGISTRY[name](paths)
    except KeyError:
        raise SpecError(
            f"backend {name!r} is not available; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def _load_builtin() -> None:
    from trainpod.backends import local, slurm  # noqa: F401  (register themselves)
