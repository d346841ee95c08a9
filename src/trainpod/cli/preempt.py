"""``trainpod preempt JOB``: stop a running job with a preemption notice and queue it again."""

from __future__ import annotations

import typer

from trainpod.cli.context import client_for
from trainpod.cli.render import console, styled

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")


def preempt(
    job_id: int = typer.Argument(..., help="the running job to preempt"),
    reason: str = typer.Option("", "--reason", "-r", help="why (shown as the job's reason)"),
    grace_s: float = typer.Option(
        None, "--grace-s", min=0, help="notice → teardown (default: the spec's preemption.grace_s)"
    ),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Preempt a running job (admins): its ranks get the notice signal and the grace period
    to save a checkpoint, then it waits in the queue as `preempted` and resumes from it."""
    with client_for(cluster) as client:
        job = client.preempt(job_id, reason, grace_s)
    console.print(f"job {job.id}: {styled(job.state)} ({job.reason})")
