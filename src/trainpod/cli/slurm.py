"""Slurm commands: ``trainpod slurm render-conf``, ``trainpod health``, ``trainpod alloc``."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import typer

from trainpod.cli.context import client_for, resolve_cluster
from trainpod.cli.jobs import default_env, follow, job_spec, parse_env
from trainpod.cli.render import console, styled
from trainpod.errors import Fatal
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.slurm.conf import render_conf
from trainpod.spec.loading import load_cluster_spec

app = typer.Typer(help="Slurm helpers.", no_args_is_help=True)

# sbatch options salloc does not take (the batch output file and requeueing).
_BATCH_ONLY = ("--output", "--open-mode", "--requeue")


@app.command("render-conf")
def render_conf_cmd(
    file: Path = typer.Option(..., "-f", "--file", help="cluster spec (YAML)"),
    health_program: str = typer.Option(
        None, "--health-program", help="also render HealthCheckProgram= with this path"
    ),
) -> None:
    """Print the slurm.conf node and partition lines the spec implies."""
    print(render_conf(load_cluster_spec(file), health_program=health_program), end="")


def health(
    slurm: bool = typer.Option(False, "--slurm", help="drain this node in Slurm on a fault"),
    node: str = typer.Option(None, "--node", help="default: $SLURMD_NODENAME, else hostname"),
    cluster: str = typer.Option(None, "--cluster", "-c", help="cluster whose settings apply"),
) -> None:
    """Run the agent's health checks once on this node (Slurm's HealthCheckProgram)."""
    from trainpod.slurm.health import check_node

    name = node or os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    record = None
    if cluster or os.environ.get("TRAINPOD_CLUSTER"):
        record = ClusterRecord.load(ClusterPaths.of(cluster or os.environ["TRAINPOD_CLUSTER"]))
    report = check_node(name, record, drain=slurm)
    for line in report.lines:
        print(line)
    if report.faults:
        raise typer.Exit(1)


def alloc(
    command: list[str] = typer.Argument(..., help="the command, after --"),
    nodes: int = typer.Option(1, "--nodes", "-N"),
    procs_per_node: int = typer.Option(None, "--procs-per-node", "-p"),
    partition: str = typer.Option(None, "--partition"),
    spares: int = typer.Option(0, "--spares"),
    time_limit: str = typer.Option(None, "--time"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    auto_resume: bool = typer.Option(False, "--auto-resume"),
    cluster: str = typer.Option(None, "--cluster", "-c"),
) -> None:
    """Run a job in an interactive Slurm allocation (salloc) with trainpod's agents;
    rank 0's output follows here, Ctrl-C cancels."""
    if shutil.which("salloc") is None:
        raise Fatal("salloc is not installed here; run `trainpod alloc` on a Slurm login node")
    spec = job_spec(
        command=command,
        nodes=nodes,
        procs_per_node=procs_per_node,
        partition=partition,
        spares=spares,
        time_limit=time_limit,
        env={**default_env(), **parse_env(env)},
        workdir=str(Path.cwd()),
        user=getpass.getuser(),
        auto_resume=auto_resume,
        interactive=True,
    )
    paths = resolve_cluster(cluster)
    record = ClusterRecord.load(paths)
    with client_for(paths.name) as client:
        job = client.submit(spec)
        script = paths.jobs_dir / str(job.id) / "alloc.sh"
        opts = [
            line.split(None, 1)[1]
            for line in script.read_text().splitlines()
            if line.startswith("#SBATCH ") and not line.split(None, 1)[1].startswith(_BATCH_ONLY)
        ]
        log = script.with_name("salloc.out")
        console.print(f"job {job.id}: salloc {' '.join(opts)}  (agents log to {log})")
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["salloc", *opts, "bash", str(script)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **record.env},
                start_new_session=True,
            )
        try:
            follow(client, job.id, rank=0)
        except KeyboardInterrupt:
            client.cancel(job.id)
        final = client.job(job.id)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        console.print(f"job {final.id} {styled(final.state)} {final.reason}")
        if final.state != "completed":
            raise typer.Exit(1)
