"""The messages between a node's agent and the ranks of an in-process-recovery job (ADR 0026).

No torch here: the agent imports this module to write what the ranks read.

The agent tells every rank of an opted-in job, in its environment:

* ``TRAINPOD_RECOVERY=in-process`` (without it :func:`trainpod.elastic.run` is a plain loop);
* ``TRAINPOD_RECOVER_FILE``: where the node's recover message appears (whole or absent);
* for a rank started as a replacement, ``TRAINPOD_RECOVER_GENERATION`` (the generation it
  joins) with ``MASTER_ADDR``/``MASTER_PORT`` of the new group.

A rank acts on a message of its own attempt (``TRAINPOD_ATTEMPT_ID``) whose ``generation``
is newer than its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_RECOVERY = "TRAINPOD_RECOVERY"
ENV_FILE = "TRAINPOD_RECOVER_FILE"
ENV_GENERATION = "TRAINPOD_RECOVER_GENERATION"
IN_PROCESS = "in-process"
EXIT_RECOVERY_FAILED = 75
"""A rank's exit code when it could not re-join in process (EX_TEMPFAIL): restart it all."""


class BadRecoverMessage(ValueError):
    """A recover file that is not a recover message (named field, what was wrong)."""


@dataclass(frozen=True)
class Recover:
    """Re-form the job's process group: a new generation with the same world and ranks."""

    generation: int
    attempt_id: int
    master_addr: str
    master_port: int
    world_size: int
    replaced: tuple[int, ...] = ()
    """The ranks started fresh (they receive their state from a healthy peer)."""
    deadline_s: float = 60.0
    """How long a rank may take to re-join before it gives up (exit 75)."""

    def __post_init__(self) -> None:
        if self.generation < 1:
            raise BadRecoverMessage(f"generation {self.generation} must be 1 or more")
        if not 0 < self.master_port < 65536:
            raise BadRecoverMessage(f"master_port {self.master_port} is not a TCP port")
        if self.world_size < 1:
            raise BadRecoverMessage(f"world_size {self.world_size} must be 1 or more")
        if not self.master_addr:
            raise BadRecoverMessage("master_addr is empty")
        if self.deadline_s <= 0:
            raise BadRecoverMessage(f"deadline_s {self.deadline_s} must be positive")
        bad = [r for r in self.replaced if not 0 <= r < self.world_size]
        if bad:
            raise BadRecoverMessage(f"replaced ranks {bad} are not in a world of {self.world_size}")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "replaced": list(self.replaced)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Recover:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRecoverMessage(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise BadRecoverMessage(f"expected an object, got {type(raw).__name__}")
        try:
            return cls(
                generation=int(raw["generation"]),
                attempt_id=int(raw["attempt_id"]),
                master_addr=str(raw["master_addr"]),
                master_port=int(raw["master_port"]),
                world_size=int(raw["world_size"]),
                replaced=tuple(int(r) for r in raw.get("replaced", ())),
                deadline_s=float(raw.get("deadline_s", 60.0)),
            )
        except KeyError as exc:
            raise BadRecoverMessage(f"missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, BadRecoverMessage):
                raise
            raise BadRecoverMessage(f"a field has the wrong type: {exc}") from None


def recover_file(job_scratch_dir: str | Path) -> Path:
    """Where a node's ranks of a job find the recover message (the job's scratch dir)."""
    return Path(job_scratch_dir) / "recover.json"


def write_recover(path: Path, message: Recover) -> None:
    """Publish ``message`` at ``path``: whole or absent (tmp + rename), never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(message.to_json())
    tmp.replace(path)


class RecoverWatch:
    """A rank's view of its recover file: :meth:`poll` costs one ``stat`` while it is
    unchanged, and returns a message only when it is newer than ``generation``."""

    def __init__(
        self, path: Path | None, generation: int = 0, attempt_id: int | None = None
    ) -> None:
        self.path = path
        self.generation = generation
        self.attempt_id = attempt_id
        """Only this attempt's messages count: the file outlives its attempt in the job's
        scratch dir, and the next attempt (a full restart) starts again at generation 0."""
        self._seen: tuple[int, int] | None = None
        self._last: Recover | None = None

    def poll(self) -> Recover | None:
        """The newest message if its generation is above :attr:`generation`, else None."""
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_ino)
        if key != self._seen:
            self._seen = key
            try:
                self._last = Recover.from_json(self.path.read_text())
            except FileNotFoundError:
                return None
        last = self._last
        if last is None or (self.attempt_id is not None and last.attempt_id != self.attempt_id):
            return None
        return last if last.generation > self.generation else None
