"""The backend seam: how a cluster's processes come to exist, and a registry of backends.

A backend brings up the controller and the node agents; after that every backend looks
the same to the controller (agents heartbeat and take orders). Backends are registered
by name, the name used in the spec's ``backend:`` key.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from trainpod.errors import SpecError
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.spec.cluster import ClusterSpec

if TYPE_CHECKING:  # the CLI imports backends; only the controller process needs these
    from trainpod.controller.config import ControllerConfig
    from trainpod.controller.core import SchedulingFactory
    from trainpod.controller.ops import ClusterOps
    from trainpod.controller.repair import Replacer


@dataclass(frozen=True)
class ProcessStatus:
    name: str  # "controller" or "agent-<node>"
    pid: int | None
    alive: bool
    log: Path


@dataclass(frozen=True)
class ControllerParts:
    """What a backend gives the controller process (constructor injection)."""

    scheduling: SchedulingFactory | None = None  # who places jobs: None = trainpod itself
    replacer: Replacer | None = None  # replaces a node like a new instance; None: cannot
    ops: ClusterOps | None = None  # the external scheduler the daemon looks at, if any


class Backend(ABC):
    name: ClassVar[str]

    def __init__(self, paths: ClusterPaths) -> None:
        self.paths = paths

    @abstractmethod
    def create(
        self, spec: ClusterSpec, spec_path: Path, *, insecure: bool = False
    ) -> ClusterRecord:
        """Create the cluster's state and start its processes. Raises Conflict if it exists,
        SpecError if the controller would serve plain HTTP off loopback without ``insecure``
        (ADR 0040)."""

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

    @abstractmethod
    def controller_parts(self, record: ClusterRecord, config: ControllerConfig) -> ControllerParts:
        """The collaborators the controller process needs from this backend."""


_BUILTIN = {"local": "trainpod.backends.local", "slurm": "trainpod.backends.slurm"}
"""Backends that ship with trainpod: name -> module, imported only when asked for."""
_REGISTRY: dict[str, type[Backend]] = {}


def register(cls: type[Backend]) -> type[Backend]:
    _REGISTRY[cls.name] = cls
    return cls


def backend_for(name: str, paths: ClusterPaths) -> Backend:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])  # registers itself
    try:
        return _REGISTRY[name](paths)
    except KeyError:
        known = sorted({*_REGISTRY, *_BUILTIN})
        raise SpecError(
            f"backend {name!r} is not available; available: {', '.join(known)}"
        ) from None
