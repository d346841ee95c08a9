"""Collectives on the checkpointer's own Gloo group, or trivial ones outside a distributed run.

Every method is a collective: all ranks must call the same methods in the same order on the
same :class:`Coll`. Each Coll is used by one thread only. Calls block, and raise what
``torch.distributed`` raises (a timeout of the group, a peer gone).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class Coll:
    """A dedicated process group (``dist.new_group(backend="gloo")``) or none (world size 1)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

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

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather(bool(flag)))

    def barrier(self) -> None:
        self.all_gather(None)
