"""``trainpod health --slurm``: the agent's node checks as Slurm's ``HealthCheckProgram``.

Runs the GPU (NVML, or the simulated GPU where there is none), disk and memory checks once
and, with ``drain``, drains the node in Slurm with the reason on a fault: slurmd ignores the
program's exit code, so draining is the program's own job (as with LBNL's NHC). Checks
that need the controller (clock skew, reachability) are left out: a controller outage must
never drain the whole cluster.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trainpod.agent.checks import build_checks
from trainpod.agent.facts import detect_gpus
from trainpod.agent.health.base import Status, run_checks
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.slurm.cli import Slurm

_STANDALONE = {"gpu", "disk", "memory"}


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


def check_node(node: str, record: ClusterRecord | None, *, drain: bool) -> Report:
    from trainpod.spec.loading import load_recorded_spec

    gpus = detect_gpus()
    env: dict[str, str] = {}
    if record is not None:
        spec = load_recorded_spec(record)
        groups = dict(spec.node_names())
        compute = [g for g in spec.instance_groups if g.role == "compute"]
        group = groups.get(node) or compute[0]
        devices = group.devices_per_node
        paths = ClusterPaths.of(record.name)
        gpu_state = None if gpus else paths.node_dir(node) / "simgpu.json"
        scratch = Path(record.scratch_root) / node
        shared = Path(record.shared_dir)
        quota, min_free = spec.storage.node_scratch_quota_gib, spec.storage.min_free_gib
        max_temp = spec.health.max_temperature_c
        env = record.env
    else:
        devices, gpu_state = len(gpus), None
        scratch = shared = Path(tempfile.gettempdir())
        quota, min_free, max_temp = None, 0.5, 85.0
    scratch.mkdir(parents=True, exist_ok=True)
    checks = build_checks(
        devices=devices,
        gpus=gpus,
        gpu_state=gpu_state,
        scratch=scratch,
        shared=shared,
        quota_gib=quota,
        min_free_gib=min_free,
        max_temperature_c=max_temp,
        controller=("127.0.0.1", 1),
        reference=lambda: None,
    )
    checks = [c for c in checks if c.name in _STANDALONE]
    report = Report()
    for r in run_checks(checks):
        sim = " (simulated GPU)" if r.simulated else ""
        report.lines.append(f"{node} {r.check}: {r.status.value}{sim}: {r.reason}")
        if r.status is Status.FAULT:
            report.faults.append(f"{r.check}: {r.reason}")
    if report.faults and drain:
        reason = "trainpod health: " + "; ".join(report.faults)
        Slurm(env).drain(node, " ".join(reason.split())[:120])
        report.lines.append(f"{node}: drained in Slurm ({reason})")
    return report
