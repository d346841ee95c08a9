"""The Slurm backend: the controller on this (head/login) node, agents inside Slurm jobs.

``cluster create`` checks the Slurm cluster (its partitions and the spec's nodes exist,
via ``scontrol ... --json``) and starts the controller here. No agent runs until a job
does: each trainpod job is a Slurm batch job whose script ``srun``s one agent per
allocated node (see :mod:`trainpod.slurm.batch`). ``SLURM_CONF`` is recorded with the
cluster so every Slurm command the controller runs talks to the same Slurm.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

from trainpod.backends.base import ControllerParts, ProcessStatus, register
from trainpod.backends.local import CONTROLLER, LocalBackend, refuse_plain_http
from trainpod.controller.config import ControllerConfig
from trainpod.errors import Conflict, SpecError
from trainpod.notice import parse_signal
from trainpod.paths import ClusterRecord
from trainpod.slurm.cli import Slurm, SlurmError
from trainpod.slurm.ops import SlurmOps, SlurmSite
from trainpod.slurm.scheduling import slurm_scheduling
from trainpod.spec.cluster import ClusterSpec
from trainpod.spec.loading import load_recorded_spec
from trainpod.store.repo import Store


def slurm_env(spec: ClusterSpec) -> dict[str, str]:
    conf = spec.slurm.conf if spec.slurm is not None else None
    if conf is not None:
        return {"SLURM_CONF": str(conf)}
    if os.environ.get("SLURM_CONF"):
        return {"SLURM_CONF": os.environ["SLURM_CONF"]}
    return {}


def check_slurm(spec: ClusterSpec, slurm: Slurm) -> None:
    """Raise SpecError unless every partition and named node of ``spec`` exists in Slurm."""
    try:
        parts = slurm.partitions()
        nodes = slurm.nodes()
    except SlurmError as exc:
        raise SpecError(f"cannot reach Slurm to check cluster {spec.name!r}: {exc}") from None
    problems = []
    for p in spec.effective_partitions():
        if p.name not in parts:
            problems.append(
                f"partition {p.name!r} does not exist in Slurm (it has: "
                f"{', '.join(sorted(parts)) or 'none'}); rename the partition in the spec or "
                "add it to slurm.conf (`trainpod slurm render-conf -f SPEC`)"
            )
    for g in spec.instance_groups:
        if g.role != "compute":
            continue
        for name, group in spec.node_names():
            if group.name == g.name and g.slurm is not None and name not in nodes:
                problems.append(f"group {g.name}: node {name!r} is not a Slurm node")
    if problems:
        raise SpecError("the Slurm cluster does not match the spec:\n  " + "\n  ".join(problems))


@register
class SlurmBackend(LocalBackend):
    name = "slurm"

    def create(
        self, spec: ClusterSpec, spec_path: Path, *, insecure: bool = False
    ) -> ClusterRecord:
        if self.paths.record.exists():
            raise Conflict(
                f"a cluster named {spec.name!r} already exists ({self.paths.state_dir}); "
                f"`trainpod cluster delete {spec.name}` it or change `name:` in {spec_path}"
            )
        refuse_plain_http(spec.controller, insecure=insecure, source=str(spec_path))
        env = slurm_env(spec)
        check_slurm(spec, Slurm(env))
        self._env = env
        record = super().create(spec, spec_path, insecure=insecure)
        Path(record.shared_dir).mkdir(parents=True, exist_ok=True)
        return record

    def controller_parts(self, record: ClusterRecord, config: ControllerConfig) -> ControllerParts:
        """Slurm places the jobs (sbatch); its nodes cannot be re-provisioned from here."""
        spec = load_recorded_spec(record)
        site = SlurmSite(
            cluster=spec.name,
            state_dir=self.paths.state_dir,
            jobs_dir=self.paths.jobs_dir,
            groups={p: groups[0] for p, groups in config.partitions.items()},
            env=(("PYTHONUNBUFFERED", "1"),),
            sbatch_options=spec.slurm.sbatch_options if spec.slurm else (),
            # Slurm's preemption notice (``--signal=B:USR1@lead``) becomes trainpod's.
            notice_signal=parse_signal(spec.preemption.signal).name.removeprefix("SIG"),
            notice_lead_s=max(1, math.ceil(spec.preemption.grace_s)),
        )
        ops = SlurmOps(Slurm(record.env), site)
        return ControllerParts(scheduling=slurm_scheduling(ops), ops=ops)

    def _wildcard_advertise(self) -> str:
        """Agents run on other nodes: they connect to this machine by its name."""
        return socket.gethostname()

    def _new_record(self, record: ClusterRecord) -> ClusterRecord:
        return record.model_copy(update={"env": getattr(self, "_env", {})})

    def _node_slices(self, record: ClusterRecord) -> dict[str, list[str]]:
        return {}  # agents start inside Slurm jobs, never from here

    def _nodes(self, record: ClusterRecord) -> list[str]:
        return []

    def replace_node(self, node: str) -> None:
        raise Conflict(
            f"{node} is a Slurm node: trainpod cannot re-provision it; it stays drained in "
            "Slurm until it passes the deep check (`trainpod nodes resume` checks it in place)"
        )

    def delete(self, *, purge: bool) -> None:
        """Cancel the cluster's unfinished Slurm jobs, then stop and remove as usual."""
        record = self._record()
        if self.paths.db.exists():
            store = Store.open(self.paths.db)
            try:
                ids = [j.external for j in store.jobs() if j.external and not j.state.ended]
            finally:
                store.close()
            slurm = Slurm(record.env)
            for ext in ids:
                try:
                    slurm.scancel(ext)
                except SlurmError:
                    pass
        super().delete(purge=purge)

    def processes(self) -> list[ProcessStatus]:
        return [p for p in super().processes() if p.name == CONTROLLER]
