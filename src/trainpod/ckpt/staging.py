"""The snapshot: copy the training state into reusable staging buffers (the only stall).

Buffers are allocated on the first save and reused while the state keeps its structure,
shapes and dtypes, so a save after the first is a plain memory copy (no page faults). CPU
tensors are copied with ``Tensor.copy_``. CUDA tensors are copied into pinned host buffers
with ``non_blocking=True`` and one device synchronize at the end: that code path is written
for GPUs but has not run on one here (this machine has no GPU). DTensor and ShardedTensor are
staged as CPU copies of their local shards, as ``torch.distributed.checkpoint``'s own stager
does (we use its helpers ``_create_cpu_state_dict`` and ``_copy_state_dict``).

When every tensor is a CPU tensor (or a DTensor with a CPU local shard) and the memory tier
has a framed file ready for the state's layout (:mod:`trainpod.ckpt.inplace`, ADR 0053),
:meth:`Stager.stage_framed` copies into that file instead: the same copy, but its
destination is already the checkpoint's bytes, so the writer has nothing left to write.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainpod.ckpt.inplace import FramedFile, FramedSource, Spec


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


_OPAQUE = object()
"""What :func:`_leaves` yields for a tuple holding a tensor: DCP does not walk tuples (it
pickles them whole, tensors and all), so such a state is not staged into files."""


def _leaves(sd: Any) -> Iterator[Any]:
    """The tensors of a state dict, where DCP's planner finds them (in mappings and lists,
    ``torch.distributed.checkpoint._traverse``), in the order :func:`_rebuild` visits them;
    :data:`_OPAQUE` for a tuple holding one."""
    import torch

    if isinstance(sd, torch.Tensor):
        yield sd
    elif isinstance(sd, Mapping):
        for v in sd.values():
            yield from _leaves(v)
    elif isinstance(sd, list):
        for v in sd:
            yield from _leaves(v)
    elif isinstance(sd, tuple) and _has_tensor(sd):
        yield _OPAQUE


def _has_tensor(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _rebuild(sd: Any, leaf: Callable[[Any], Any]) -> Any:
    """``sd``'s mappings and lists with each tensor :func:`_leaves` finds replaced by
    ``leaf`` of it, every other value kept as it is."""
    import torch

    if isinstance(sd, torch.Tensor):
        return leaf(sd)
    if isinstance(sd, Mapping):
        return {k: _rebuild(v, leaf) for k, v in sd.items()}
    if isinstance(sd, list) and _has_tensor(sd):
        return [_rebuild(v, leaf) for v in sd]
    return sd


def count_tensors(sd: Any) -> int:
    """How many tensors ``sd`` holds where DCP's planner finds them (its tensor items)."""
    return sum(1 for t in _leaves(sd) if t is not _OPAQUE)


def _dtensor_type() -> type[Any] | None:
    """``DTensor`` if its module is loaded (no DTensor exists before it is; importing it
    costs seconds, which a state without one must not pay)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def _placeable(t: Any) -> Any:
    """The tensor a framed file holds for ``t`` (itself, or a DTensor's local shard), or
    None when it cannot hold it."""
    import torch

    dtensor = _dtensor_type()
    local = t._local_tensor if dtensor is not None and isinstance(t, dtensor) else t
    if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.device.type != "cpu":
        return None
    if local.layout != torch.strided or local.is_quantized:
        return None
    return local


def plain_specs(sd: Any) -> list[Spec] | None:
    """(dtype, shape) of each tensor of ``sd`` (a DTensor's local shard) when every one is
    a CPU tensor in a mapping or list (what a framed file holds); None when any is not (a
    ShardedTensor shard, a CUDA or sparse tensor, one in a tuple: they stage as before), or
    there is none."""
    specs: list[Spec] = []
    for t in _leaves(sd):
        local = None if t is _OPAQUE else _placeable(t)
        if local is None:
            return None
        specs.append((local.dtype, tuple(local.shape)))
    return specs or None


_PIECE = 4 << 20
"""Bytes copied into a framed file between two advances of its checksum's mark."""


def _flat(t: Any) -> bool:
    """A plain contiguous CPU tensor (not a DTensor): copied piece by piece."""
    import torch

    return type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous()


def _into(t: Any, view: Any) -> Any:
    """Copy ``t`` into ``view`` (None: a copy of its own) and return the staged tensor: the
    view, or a DTensor over it with ``t``'s mesh, placements, shape and strides."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        if view is None:  # no elements: nothing to place
            return t.detach().clone()
        return view.copy_(t)
    local = t._local_tensor
    staged = local.detach().clone() if view is None else view.copy_(local)
    return dtensor.from_local(
        staged, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


class Stager:
    """Reusable staging buffers. Not thread-safe: one ``stage`` at a time (the Checkpointer
    makes sure the previous snapshot has been written before the buffers are reused)."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._cuda = False
        self._nbytes = 0
        self.reallocations = 0

    def stage_framed(
        self, state: Mapping[str, Any], source: FramedSource | None
    ) -> tuple[dict[str, Any], FramedFile | None]:
        """Like :meth:`stage`, but into a framed file of ``source`` when it has one ready for
        this state's layout (ADR 0053): the copy is then the memory tier's write, and the
        file is the snapshot's alone (returned with it; the next save takes another).
        Otherwise into the staging buffers, and ``source`` is asked for a file for the next
        save."""
        import torch

        sd = to_state_dict(state)
        specs = plain_specs(sd) if source is not None else None
        if source is None or specs is None:
            return self._stage(sd), None
        framed = source.take(specs)
        if framed is None:
            source.want(specs)
            return self._stage(sd), None
        try:
            views = framed.tensors()
        except Exception as exc:  # a dtype torch.frombuffer does not take, say
            source.discard(framed)
            source.turn_off(f"a framed file's tensors cannot be made: {exc}")
            return self._stage(sd), None
        count = itertools.count()

        def fill(t: Any) -> Any:
            i = next(count)
            view = views[i]
            if view is not None and _flat(t) and view.nbytes > _PIECE:
                # in pieces, so that the checksum reads each while it is in the cache
                src, dst = t.view(-1), view.view(-1)
                step = _PIECE // t.element_size()
                for at in range(0, dst.numel(), step):
                    dst[at : at + step].copy_(src[at : at + step])
                    framed.filled(i, min(at + step, dst.numel()) * t.element_size())
                framed.filled(i)
                return view
            out = _into(t, view)
            framed.filled(i)  # its checksum follows the copy (ADR 0054)
            return out

        try:
            with torch.no_grad():
                staged: dict[str, Any] = _rebuild(sd, fill)
            framed.filled()
        except BaseException:
            source.discard(framed)
            raise
        self._nbytes = framed.layout.nbytes
        return staged, framed

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``state`` into the staging buffers and return the staged state dict. Blocking.

        Non-tensor values (ints, strings, bytes) are kept by reference. Raises ``ValueError``
        for values DCP cannot save.
        """
        return self._stage(to_state_dict(state))

    def _stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

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
        self._nbytes = self._cache_nbytes()
        return staged

    def nbytes(self) -> int:
        """Bytes of tensors the last stage copied (what the snapshot's files need, about)."""
        return self._nbytes

    def _cache_nbytes(self) -> int:
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
