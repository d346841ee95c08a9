"""trainpod: a self-hosted, self-healing training cluster for large models."""

from __future__ import annotations

from trainpod.beacon import heartbeat, report
from trainpod.ckpt import _trainpod_getattr as __getattr__  # noqa: F401 (trainpod.Checkpointer)
from trainpod.notice import preempted

__version__ = "0.1.0"

__all__ = ["__version__", "heartbeat", "preempted", "report"]
