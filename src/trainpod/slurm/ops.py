"""The controller's Slurm operations: submit with ``sbatch``, cancel, requeue, drain, resume.

Slurm owns placement, partitions, priorities and the queue. trainpod submits one batch job
per trainpod job; its script starts an agent on every allocated node (see
:mod:`trainpod.slurm.batch`), and the controller places the ranks on those agents.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainpod.controller.ops import ClusterOps, Observed
from trainpod.slurm.batch import BatchRequest, render
from trainpod.slurm.cli import Slurm, SlurmError
from trainpod.spec.job import JobSpec

log = logging.getLogger(__name__)

REASON_MAX = 120
"""Slurm keeps node reasons short; longer ones are cut."""


@dataclass(frozen=True)
class SlurmSite:
    """What every batch script of this cluster shares."""

    cluster: str
    state_dir: Path
    jobs_dir: Path
    groups: Mapping[str, str]
    """trainpod partition -> the compute group its agents report (devices, lifecycle)."""
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()
    sbatch_options: tuple[str, ...] = ()
    notice_signal: str | None = None
    """Slurm's ``--signal`` for a preemption notice (``USR1``; the spec's ``preemption``)."""
    notice_lead_s: int = 30


class SlurmOps(ClusterOps):
    places_jobs = False

    def __init__(self, slurm: Slurm, site: SlurmSite) -> None:
        self.slurm = slurm
        self.site = site

    def request(self, job_id: int, spec: JobSpec) -> BatchRequest:
        part = spec.partition or next(iter(self.site.groups))
        s = self.site
        agent = (
            s.python,
            "-m",
            "trainpod.agent.main",
            "--state-dir",
            str(s.state_dir),
            "--allocation",
            str(job_id),
            "--group",
            s.groups[part],
            "--log-dir",
            str(s.jobs_dir / str(job_id)),
        )
        return BatchRequest(
            cluster=s.cluster,
            job_id=job_id,
            nodes=spec.nodes,
            spares=spec.spares,
            partition=part,
            output=str(s.jobs_dir / str(job_id) / "slurm-%j.out"),
            agent_argv=agent,
            env=s.env,
            time_limit=spec.time_limit,
            nice=spec.nice,
            dependency=spec.dependency,
            exclude=tuple(spec.exclude),
            priority=spec.priority,
            # salloc (`trainpod alloc`) has no batch shell to signal and never requeues.
            notice_signal=None if spec.interactive else s.notice_signal,
            notice_lead_s=s.notice_lead_s,
            extra=s.sbatch_options,
        )

    def render(self, job_id: int, spec: JobSpec) -> str:
        return render(self.request(job_id, spec))

    def submit(self, job_id: int, spec: JobSpec) -> str:
        (self.site.jobs_dir / str(job_id)).mkdir(parents=True, exist_ok=True)
        return self.slurm.sbatch(self.render(job_id, spec))

    def cancel(self, external: str) -> None:
        if external:
            self.slurm.scancel(external)

    def requeue(self, external: str, exclude: list[str]) -> None:
        """Requeue the Slurm job; once it is pending again, exclude ``exclude`` from it.

        The bad nodes are drained already (so Slurm will not pick them); the exclusion
        keeps them out even if an admin resumes them meanwhile. Runs in the background:
        the job becomes pending only after Slurm has cleaned up the allocation."""
        try:
            self.slurm.requeue(external)
        except SlurmError as exc:
            if "pending" not in str(exc).lower():
                raise
            # Slurm requeued it already (its batch host failed): the same outcome.
            log.info("Slurm job %s is already pending again: %s", external, exc)
        if exclude:
            threading.Thread(
                target=self._exclude, args=(external, exclude), daemon=True, name="tp-exclude"
            ).start()

    def _exclude(self, external: str, exclude: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                job = self.slurm.jobs().get(external)
                if job is not None and job.state == "PENDING":
                    self.slurm.update_job(external, ExcNodeList=",".join(exclude))
                    return
            except SlurmError as exc:
                log.info("excluding %s from job %s: %s", exclude, external, exc)
            time.sleep(0.5)
        log.warning("could not exclude %s from Slurm job %s in %gs", exclude, external, timeout_s)

    def release(self, external: str) -> None:
        self.slurm.release(external)

    def drain(self, node: str, reason: str) -> None:
        text = " ".join(f"trainpod: {reason}".split())[:REASON_MAX]
        self.slurm.drain(node, text)

    def resume(self, node: str) -> None:
        self.slurm.resume(node)

    def observe(self, externals: list[str]) -> Observed:
        jobs = self.slurm.jobs()
        return Observed(
            jobs={e: jobs[e] for e in externals if e in jobs},
            nodes=self.slurm.nodes(),
        )
