"""Admitting a job: the spec checked against the cluster (clear errors for a job that can
never run), resolved (partition, processes per node), and its launch plan (``--dry-run``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.api.models import LaunchPlan
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.controller.launch import launch_order
from trainpod.controller.transitions import Transitions
from trainpod.errors import SpecError
from trainpod.spec.job import JobSpec
from trainpod.spec.parallelism import check_shape
from trainpod.store.secrets import MASKED


@dataclass
class Admission:
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling

    def resolve(self, spec: JobSpec) -> JobSpec:
        """``spec`` with its partition and processes per node; SpecError if it can never run."""
        part = spec.partition or self.cfg.default_partition
        if part not in self.cfg.partitions:
            raise SpecError(
                f"partition {part!r} does not exist on cluster {self.cfg.cluster}; use one of: "
                f"{', '.join(sorted(self.cfg.partitions))}"
            )
        groups = set(self.cfg.partitions[part])
        members = [d for d in self.cfg.nodes if d.group in groups and not d.spare]
        spares = sum(1 for d in self.cfg.nodes if d.group in groups and d.spare)
        self.scheduling.check_spec(spec, part, len(members), spares)
        devices = min((d.devices for d in members), default=0)
        procs = spec.procs_per_node or max(devices, 1)
        if devices and procs > devices:
            raise SpecError(
                f"the job asks for {procs} processes per node but nodes of partition "
                f"{part!r} have {devices} devices; use --procs-per-node {devices} or fewer"
            )
        if spec.parallelism is not None:
            try:
                check_shape(
                    spec.parallelism,
                    nodes=spec.nodes,
                    min_nodes=spec.min_nodes,
                    procs_per_node=procs,
                )
            except ValueError as exc:
                where = f"nodes of partition {part!r}: {procs} processes each"
                raise SpecError(f"{exc} ({where})") from None
        update = {"procs_per_node": procs, "partition": part}
        return spec.model_copy(update={**update, "priority_class": self._priority_class(spec)})

    def _priority_class(self, spec: JobSpec) -> str | None:
        """The job's priority class: as asked, else its team's default, else the cluster's."""
        classes = [c.name for c in self.cfg.priority_classes]
        if spec.priority_class is None:
            return self.cfg.default_priority_class(spec.team or None)
        if spec.priority_class not in classes:
            known = ", ".join(classes) if classes else "none: this cluster declares no classes"
            raise SpecError(
                f"--priority-class {spec.priority_class!r} is not a priority class of "
                f"cluster {self.cfg.cluster} ({known}); use one of them or leave it out"
            )
        return spec.priority_class

    def plan(self, spec: JobSpec) -> LaunchPlan:
        """What a submission would launch if the job were placed now (under the lock)."""
        resolved = self.resolve(spec)
        # A plan is shown: its secret env values masked, as in the job's spec once stored.
        resolved = resolved.model_copy(
            update={"secret_env": dict.fromkeys(resolved.secret_env, MASKED)}
        )
        part = resolved.partition or self.cfg.default_partition
        external = self.scheduling.dry_run(resolved, part)
        if external is not None:
            return external
        groups = set(self.cfg.partitions[part])
        rows = sorted(self.tx.store.nodes(), key=self.tx.node_order)
        pool = [n for n in rows if self.scheduling.slot(n).free and n.group in groups]
        note = ""
        if len(pool) < resolved.nodes:
            note = f"only {len(pool)} nodes are idle now; the job would wait in the queue"
            pool = [n for n in rows if n.group in groups and not n.spare]
        nodes = [n.name for n in pool[: resolved.nodes]]
        addr = self.tx.address(nodes[0])
        orders = {
            name: launch_order(
                self.cfg,
                job_id=0,
                attempt_id=0,
                spec=resolved,
                attempt_number=1,
                nodes=nodes,
                node_index=i,
                procs_per_node=resolved.procs_per_node or 1,
                master_addr=addr,
                master_port=0,
            )
            for i, name in enumerate(nodes)
        }
        return LaunchPlan(job=resolved, partition=part, nodes=nodes, orders=orders, note=note)
