"""The slurm.conf node and partition lines a cluster spec implies (``trainpod slurm
render-conf``), for admins who build the Slurm cluster from the spec.

Only the lines the spec determines are rendered: ``NodeName`` per compute group (its Slurm
node names, CPUs, memory, GPUs as ``Gres=gpu:N``) and ``PartitionName`` per trainpod
partition (trainpod partitions are Slurm partitions of the same name). The rest of
slurm.conf (controller host, auth, plugins) is the site's.
"""

from __future__ import annotations

from trainpod.slurm.hostlist import compress
from trainpod.spec.cluster import ClusterSpec


def render_conf(spec: ClusterSpec, *, health_program: str | None = None) -> str:
    groups = spec.groups_by_name()
    names: dict[str, list[str]] = {}
    for node, group in spec.node_names():
        names.setdefault(group.name, []).append(node)
    lines = [
        f"# slurm.conf lines for trainpod cluster {spec.name!r} "
        "(rendered by `trainpod slurm render-conf`)",
    ]
    if any(g.devices_per_node for g in spec.instance_groups if g.role == "compute"):
        lines.append("GresTypes=gpu")
    if health_program:
        lines += [
            "# trainpod's node health check drains a faulty node with the reason",
            f"HealthCheckProgram={health_program}",
            "HealthCheckInterval=60",
            "HealthCheckNodeState=ANY",
        ]
    for g in spec.instance_groups:
        if g.role != "compute":
            continue
        words = [f"NodeName={compress(names[g.name])}"]
        if g.slurm is not None and g.slurm.cpus is not None:
            words.append(f"CPUs={g.slurm.cpus}")
        if g.slurm is not None and g.slurm.real_memory_mib is not None:
            words.append(f"RealMemory={g.slurm.real_memory_mib}")
        if g.devices_per_node:
            words.append(f"Gres=gpu:{g.devices_per_node}")
        if g.slurm is not None and g.slurm.features:
            words.append(f"Feature={','.join(g.slurm.features)}")
        words.append("State=UNKNOWN")
        lines.append(f"# group {g.name}: {g.count} node(s)")
        lines.append(" ".join(words))
    for p in spec.effective_partitions():
        nodes = [n for gname in p.groups for n in names.get(gname, []) if gname in groups]
        lines.append(
            f"PartitionName={p.name} Nodes={compress(nodes)} "
            f"Default={'YES' if p.default else 'NO'} MaxTime=INFINITE State=UP"
        )
    return "\n".join(lines) + "\n"
