"""An attempt's in-process recovery (ADR 0026), as stored in ``attempts.in_process``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class InProcess:
    """The newest generation of an attempt's process group, and whether it is being formed.

    ``generation`` 0: never recovered in process (the attempt's own group). While
    ``pending``, the ranks in ``replaced`` are being started again on ``master_port``; the
    recovery is confirmed once every rank beacons the generation (ADR 0035), and abandoned
    for a full restart at ``deadline_at`` otherwise."""

    generation: int = 0
    master_port: int | None = None
    master_addr: str | None = None  # the new store's host (rank 0's node; None: the attempt's)
    replaced: tuple[int, ...] = ()
    fault_rank: int | None = None
    fault_at: float | None = None
    started_at: float | None = None
    deadline_at: float | None = None
    pending: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InProcess:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "replaced" in known:
            known["replaced"] = tuple(known["replaced"])
        return cls(**known)
