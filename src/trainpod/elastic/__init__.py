"""In-process recovery for data-parallel training loops (ADR 0026).

``trainpod.elastic.run(train_step, {"model": model, "optim": opt}, steps=N)`` runs the loop;
with ``--recovery in-process`` a peer's fault no longer ends this rank: it re-joins the
replacement in a new process group and goes on from the newest step every rank holds.

The loop (and torch) is imported on first use: the agent and the controller import
:mod:`trainpod.elastic.protocol` only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainpod.elastic.protocol import (
    EXIT_RECOVERY_FAILED,
    BadRecoverMessage,
    Recover,
    RecoverWatch,
    recover_file,
    write_recover,
)

if TYPE_CHECKING:
    from trainpod.elastic.loop import (
        Recovery,
        RecoveryFailed,
        RunResult,
        Stateful,
        is_collective_error,
        run,
    )

_LAZY = {"Recovery", "RecoveryFailed", "RunResult", "Stateful", "is_collective_error", "run"}

__all__ = [
    "EXIT_RECOVERY_FAILED",
    "BadRecoverMessage",
    "Recover",
    "RecoverWatch",
    "Recovery",
    "RecoveryFailed",
    "RunResult",
    "Stateful",
    "is_collective_error",
    "recover_file",
    "run",
    "write_recover",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("trainpod.elastic.loop"), name)
    raise AttributeError(f"module 'trainpod.elastic' has no attribute {name!r}")
