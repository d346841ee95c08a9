"""Collectives on the checkpointer's own Gloo group, or trivial ones outside a distributed run.

Every method is a collective: all ranks must call the same methods in the same order on the
same :class:`Coll`. Each Coll is used by one thread only. Calls block, and raise what
``torch.distributed`` raises (a timeout of the group, a peer gone).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class CollClosed(RuntimeError):
    """A collective on a :class:`Coll` that was closed (its process group was re-formed)."""


class Coll:
    """A dedicated process group (``dist.new_group(backend="gloo")``) or none (world size 1)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.closed: str | None = None
        """Why this Coll may not be used any more (see :meth:`close`)."""

    def close(self, why: str) -> None:
        """Refuse every later call (it raises :class:`CollClosed` with ``why``) and drop the
        group: a group whose process group was re-formed must not be mistaken for a trivial
        one, and once nothing holds it its sockets close, so peers blocked on it fail at
        once. A call already in progress is not interrupted (Gloo cannot abort one): it ends
        when its peers answer, leave, or the group's timeout runs out."""
        self.closed = why
        self.group = None

    @classmethod
    def create(cls, timeout_s: float) -> Coll:
        """A new Gloo group spanning every rank, or a trivial Coll when not distributed.

        Collective when ``torch.distributed`` is initialized: every rank must call it at the
        same point (``new_group`` is).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(group, dist.get_rank(), dist.get_world_size())

    def bound(self) -> Any:
        """The group, for a call that takes one (DCP's ``process_group``; None: not
        distributed). Raises :class:`CollClosed` once closed, so a caller racing
        :meth:`close` never passes None (DCP's "not distributed") for a closed group."""
        group = self.group
        if self.closed is not None:
            raise CollClosed(self.closed)
        return group

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        # The group first, then the flag (close() sets them the other way round): a call
        # racing close() uses the old group or raises, never ``group=None`` (the default
        # group, the new generation's) nor the trivial path.
        group = self.bound()
        if group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather(bool(flag)))

    def barrier(self) -> None:
        self.all_gather(None)
