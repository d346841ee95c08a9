"""Slurm: talking to a real Slurm (JSON output), rendering batch scripts and slurm.conf lines."""
