"""The recovery benchmark's parts; run it with ``python benchmarks/recovery.py``."""
