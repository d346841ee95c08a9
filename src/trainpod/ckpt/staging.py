"""The snapshot: copy the training state into reusable staging buffers (the only stall).

Buffers are allocated on the first save and reused while the state keeps its structure,
shapes and dtypes, so a save after the first is a plain memory copy (no page faults). CPU
tensors are copied with ``Tensor.copy_``. CUDA tensors are copied into pinned host buffers
with ``non_blocking=True`` and one device synchronize at the end: that code path is written
for GPUs but has not run on one here (this machine has no GPU). DTensor and ShardedTensor are
staged as CPU copies of their local shards, as ``torch.distributed.checkpoint``'s own stager
does (we use its helpers ``_create_cpu_state_dict`` and ``_copy_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def to_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """Shallow copy with each ``Stateful`` value (``state_dict``/``load_state_dict``) expanded."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _has_cuda(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return bool(obj.device.type == "cuda")
    if isinstance(obj, Mapping):
        return any(_has_cuda(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_cuda(v) for v in obj)
    return False


def _same_layout(a: Any, b: Any) -> bool:
    """Same structure, and every tensor (a DTensor's local shard) has the same shape/dtype."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if hasattr(a, "_local_tensor") != hasattr(b, "_local_tensor"):  # DTensor or not
            return False
        la, lb = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
        return bool(la.shape == lb.shape and la.dtype == lb.dtype)
    if isinstance(a, Mapping):
        return (
            isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(_same_layout(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
        )
    return True


class Stager:
    """Reusable staging buffers. Not thread-safe: one ``stage`` at a time (the Checkpointer
    makes sure the previous snapshot has been written before the buffers are reused)."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._cuda = False
        self.reallocations = 0

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``state`` into the staging buffers and return the staged state dict. Blocking.

        Non-tensor values (ints, strings, bytes) are kept by reference. Raises ``ValueError``
        for values DCP cannot save.
        """
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        sd = to_state_dict(state)
        if self._cache is None or not _same_layout(sd, self._cache):
            self._cuda = _has_cuda(sd)
            self._cache = _create_cpu_state_dict(sd, pin_memory=self._cuda)
            self.reallocations += 1
        with torch.no_grad():
            staged: dict[str, Any] = _copy_state_dict(
                sd, self._cache, non_blocking=self._cuda, type_check=False
            )
        if self._cuda:
            torch.cuda.synchronize()
        return staged

    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        import torch

        total = 0

        def walk(o: Any) -> None:
            nonlocal total
            if isinstance(o, torch.Tensor):
                local = getattr(o, "_local_tensor", o)
                total += local.numel() * local.element_size()
            elif isinstance(o, Mapping):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    walk(v)

        walk(self._cache)
        return total
