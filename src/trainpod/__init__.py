"""trainpod: a self-hosted, self-healing training cluster for large models."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
