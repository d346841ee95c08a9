"""Job commands: submit, jobs, show, logs, cancel, events."""

from __future__ import annotations

import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pydantic
import typer

from trainpod.api.devices import JobEnergy
from trainpod.api.models import AttemptInfo, EventInfo, JobInfo
from trainpod.backends.local import python_first_path
from trainpod.cli.ckptsummary import checkpoint_lines
from trainpod.cli.context import client_for
from trainpod.cli.render import console, duration, jobs_table, show_value, styled
from trainpod.client.http import TrainpodClient
from trainpod.errors import SpecError
from trainpod.model.events import details, parse
from trainpod.model.states import JobState
from trainpod.spec.job import JobSpec

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")


def parse_env(pairs: list[str], option: str = "--env") -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # A secret's value is not repeated in the message: it may be the whole pair.
            got = "a value without '='" if option != "--env" else repr(pair)
            raise SpecError(f"{option} expects KEY=VALUE; got {got}")
        env[key] = value
    return env


_OPTION = {
    "time_limit": "--time",
    "command": "the command",
    "env": "--env",
    "parallelism": "--tensor-parallel/--pipeline-parallel",
}


def job_spec(**fields: Any) -> JobSpec:
    """The job spec of a command's options, or a :class:`SpecError` that names each option
    that is wrong and says how to fix it (never pydantic's report, never a traceback)."""
    try:
        return JobSpec(**fields)
    except pydantic.ValidationError as exc:
        raise SpecError("; ".join(_problem(e) for e in exc.errors())) from None


def _problem(error: Any) -> str:
    msg = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:  # a check of several options: its message names them
        return msg
    field = str(error["loc"][0])
    option = _OPTION.get(field, "--" + field.replace("_", "-"))
    if msg.startswith(option) or msg.startswith(("argument", "--env")):
        return msg
    if field == "secret_env":  # never echo a secret
        return f"{option}: {msg}"
    return f"{option}: {msg} (got {error.get('input')!r:.80})"


def read_env_file(path: Path) -> dict[str, str]:
    """``--secret-env-file``: KEY=VALUE lines (blank lines and ``#`` comments skipped; the
    value is the rest of the line, as written, no quotes removed)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"--secret-env-file {path}: cannot read it ({exc})") from None
    env: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SpecError(
                f"--secret-env-file {path}: line {number} is not KEY=VALUE; write one "
                "variable a line (blank lines and # comments are skipped)"
            )
        env[key.strip()] = value
    return env


def parallelism_of(tensor: int | None, pipeline: int | None) -> dict[str, int] | None:
    """``--tensor-parallel``/``--pipeline-parallel`` as the spec's ``parallelism`` (None:
    neither given); JobSpec checks the sizes."""
    if tensor is None and pipeline is None:
        return None
    return {
        "tensor": 1 if tensor is None else tensor,
        "pipeline": 1 if pipeline is None else pipeline,
    }


def default_env() -> dict[str, str]:
    """What a job inherits from the submitting shell: PATH, with this Python's bin first.

    So ``python`` in a job is the interpreter trainpod runs in, as with an activated venv.
    """
    env = python_first_path()
    if "VIRTUAL_ENV" in os.environ:
        env["VIRTUAL_ENV"] = os.environ["VIRTUAL_ENV"]
    return env


def submit(
    command: list[str] = typer.Argument(..., help="the command, after --"),
    nodes: int = typer.Option(1, "--nodes", "-N"),
    procs_per_node: int = typer.Option(None, "--procs-per-node", "-p"),
    partition: str = typer.Option(None, "--partition"),
    name: str = typer.Option("", "--name"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    secret_env: list[str] = typer.Option(
        [],
        "--secret-env",
        help="KEY=VALUE for the ranks only, repeatable: kept apart, shown as ***, never listed",
    ),
    secret_env_file: Path = typer.Option(
        None, "--secret-env-file", help="KEY=VALUE lines, each as --secret-env"
    ),
    workdir: Path = typer.Option(None, "--workdir", help="default: the current directory"),
    auto_resume: bool = typer.Option(False, "--auto-resume", help="recover from faults"),
    max_restarts: int = typer.Option(None, "--max-restarts"),
    recovery: str = typer.Option(
        "restart",
        "--recovery",
        help="restart (every rank starts again) or in-process (healthy ranks stay; needs "
        "--auto-resume and a loop run by trainpod.elastic.run)",
    ),
    min_nodes: int = typer.Option(None, "--min-nodes", help="may shrink to this on no spare"),
    tensor_parallel: int = typer.Option(
        None,
        "--tensor-parallel",
        help="Megatron-style TP size: checked to fit in a node, given to the ranks as "
        "TRAINPOD_TP and TRAINPOD_PARALLEL_ARGS",
    ),
    pipeline_parallel: int = typer.Option(
        None, "--pipeline-parallel", help="Megatron-style PP size (TRAINPOD_PP); DP is the rest"
    ),
    hang_timeout_s: float = typer.Option(None, "--hang-timeout-s"),
    startup_timeout_s: float = typer.Option(None, "--startup-timeout-s"),
    spares: int = typer.Option(0, "--spares", help="Slurm: hot spares inside the allocation"),
    time_limit: str = typer.Option(
        None, "--time", help="time limit, Slurm's format (90, 2:00:00, 1-12): helps backfill"
    ),
    priority_class: str = typer.Option(
        None, "--priority-class", help="a priority class of the cluster (default: your team's)"
    ),
    private: bool = typer.Option(False, "--private", help="only you and admins read its logs"),
    nice: int = typer.Option(None, "--nice", help="Slurm: --nice"),
    priority: int = typer.Option(None, "--priority", help="Slurm: --priority (admins)"),
    dependency: str = typer.Option(None, "--dependency", help="Slurm: e.g. afterok:123"),
    exclude: str = typer.Option(None, "--exclude", help="Slurm: nodes never to use (a,b)"),
    preload: list[str] = typer.Option(
        [],
        "--preload",
        help="modules to import once per node for restarts to fork from (a,b; repeatable)",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the launch plan; submit nothing"),
    idempotency_key: str = typer.Option(
        None,
        "--idempotency-key",
        help="run this command again with the same key (and job) to get the job it made, "
        "not a second one; default: a fresh key, reused by this command's own retries",
    ),
    wait: bool = typer.Option(False, "--wait", help="follow rank 0's log until the job ends"),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Submit a job: trainpod submit -N 2 -- python train.py --steps 100"""
    spec = job_spec(
        spares=spares,
        time_limit=time_limit,
        nice=nice,
        priority=priority,
        dependency=dependency,
        exclude=[x for x in (exclude or "").split(",") if x],
        preload=[m.strip() for item in preload for m in item.split(",") if m.strip()],
        command=command,
        name=name,
        nodes=nodes,
        procs_per_node=procs_per_node,
        partition=partition,
        env={**default_env(), **parse_env(env)},
        secret_env={
            **(read_env_file(secret_env_file) if secret_env_file else {}),
            **parse_env(secret_env, "--secret-env"),
        },
        workdir=str((workdir or Path.cwd()).absolute()),
        user=getpass.getuser(),  # the controller makes the caller the owner whatever this says
        priority_class=priority_class,
        private=private,
        auto_resume=auto_resume,
        max_restarts=max_restarts,
        recovery=recovery,  # checked by JobSpec, which names the choices
        min_nodes=min_nodes,
        hang_timeout_s=hang_timeout_s,
        startup_timeout_s=startup_timeout_s,
        parallelism=parallelism_of(tensor_parallel, pipeline_parallel),
    )
    with client_for(cluster) as client:
        if dry_run:
            plan = client.plan(spec)
            if plan.batch_script is not None and not as_json:
                print(plan.batch_script, end="")  # the script as sbatch would get it
                return
            console.print_json(plan.model_dump_json())
            return
        job = client.submit(spec, idempotency_key=idempotency_key)
        if as_json:
            console.print_json(job.model_dump_json())
        else:
            console.print(f"submitted job {job.id} ({job.name})")
        if wait:
            follow(client, job.id, rank=0)
            final = client.job(job.id)
            console.print(f"job {final.id} {styled(final.state)} {final.reason}")
            if final.state != JobState.COMPLETED:
                raise typer.Exit(1)


def jobs(
    all_: bool = typer.Option(False, "--all", "-a", help="include ended jobs"),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """List jobs (like squeue)."""
    with client_for(cluster) as client:
        items = client.jobs(include_ended=all_)
    if as_json:
        console.print_json(json.dumps([j.model_dump(mode="json") for j in items]))
    else:
        console.print(jobs_table(items))


def show(
    job_id: int = typer.Argument(...),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Show a job, its attempts and ranks."""
    with client_for(cluster) as client:
        job = client.job(job_id)
        energy = client.energy(job_id)
        events = [] if as_json else client.events(job_id=job_id)
    if as_json:
        console.print_json(job.model_dump_json())
        return
    print_job(job)
    console.print(f"  energy     {energy_line(energy)}")
    for line in checkpoint_lines(events):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


def energy_line(e: JobEnergy) -> str:
    """kWh and kg CO2e, labelled SIMULATED where simulated devices measured them."""
    sim = " (SIMULATED devices)" if e.simulated else ""
    return (
        f"{e.kwh:.4f} kWh, {e.co2e_kg:.4f} kg CO2e{sim} at {e.g_per_kwh:g} g/kWh "
        f"({e.intensity_source})"
    )


def print_job(job: JobInfo) -> None:
    s = job.spec
    console.print(f"[bold]job {job.id}[/] {job.name}  {styled(job.state)}")
    console.print(f"  command    {' '.join(s.command)}")
    console.print(
        f"  shape      {s.nodes} nodes x {s.procs_per_node} procs, partition {s.partition}"
    )
    if s.parallelism is not None:
        tp, pp = s.parallelism.tensor, s.parallelism.pipeline
        console.print(f"  parallel   TP {tp} x PP {pp} x DP (the rest)")
    console.print(f"  workdir    {s.workdir}")
    if s.auto_resume:
        console.print(f"  recovery   {s.recovery}")
    console.print(f"  runtime    {duration(job.started_at, job.ended_at)}")
    if job.reason:
        console.print(f"  reason     {job.reason}")
    if job.queue_position is not None:
        start = job.estimated_start
        when = time.strftime("%H:%M:%S", time.localtime(start)) if start else "not known yet"
        console.print(f"  queue      position {job.queue_position}, expected start {when}")
    if s.priority_class or s.team:
        console.print(f"  priority   {s.priority_class or '-'} (team {s.team or '-'})")
    for a in job.attempts:
        cause = _cause(a)
        console.print(
            f"  attempt {a.number}: {styled(a.state)}{cause} on {','.join(a.nodes)} "
            f"master {a.master_addr}:{a.master_port}"
        )
        if a.generation:  # recovered in process (ADR 0026/0035)
            how = "confirmed" if a.generation_confirmed else "being formed"
            console.print(f"    generation {a.generation} ({how})")
        if a.lent_by and not a.state.ended:  # backfill past a reservation (ADR 0050)
            jobs = ", ".join(str(j) for j in a.lent_by)
            console.print(
                f"    on nodes reserved by job {jobs}: preempted, with notice, when it can start"
            )
        for r in a.ranks:
            how = f"exit {r.exit_code}" if r.signal is None else f"signal {r.signal}"
            how = how if r.state == "exited" else r.state
            console.print(
                f"    rank {r.rank:<3} {r.node:<12} local {r.local_rank} pid {r.pid} {how}"
            )


def follow(client: TrainpodClient, job_id: int, *, rank: int, attempt: int | None = None) -> None:
    """Print a rank's log as it grows, across attempts, until the job ends."""
    offset, current = 0, attempt
    while True:
        chunk = client.logs(job_id, rank=rank, attempt=current, offset=offset)
        if chunk.attempt and current is None:
            current = chunk.attempt
        if chunk.data:
            sys.stdout.write(chunk.data)
            sys.stdout.flush()
            offset = chunk.offset
            continue
        if chunk.job_ended:
            return
        latest = client.logs(job_id, rank=rank, offset=0).attempt
        if attempt is None and latest and current and latest != current:
            current, offset = latest, 0
            console.print(f"--- attempt {latest} ---")
        time.sleep(0.3)


def logs(
    job_id: int = typer.Argument(...),
    rank: int = typer.Option(0, "--rank", "-r"),
    attempt: int = typer.Option(None, "--attempt", help="default: the latest"),
    follow_: bool = typer.Option(False, "-f", "--follow"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Print a rank's log; -f follows it until the job ends."""
    with client_for(cluster) as client:
        if follow_:
            follow(client, job_id, rank=rank, attempt=attempt)
            return
        offset = 0
        while True:
            chunk = client.logs(job_id, rank=rank, attempt=attempt, offset=offset)
            if not chunk.data:
                return
            sys.stdout.write(chunk.data)
            offset = chunk.offset


def cancel(job_id: int = typer.Argument(...), cluster: str = CLUSTER_OPT) -> None:
    """Cancel a job: queued jobs end at once, running ones are torn down."""
    with client_for(cluster) as client:
        job = client.cancel(job_id)
    console.print(f"job {job.id}: {styled(job.state)}")


def hold(job_id: int = typer.Argument(...), cluster: str = CLUSTER_OPT) -> None:
    """Keep a waiting job in the queue, never started, until `trainpod release`."""
    with client_for(cluster) as client:
        job = client.hold(job_id)
    console.print(f"job {job.id}: {styled(job.state)} ({job.reason})")


def release(job_id: int = typer.Argument(...), cluster: str = CLUSTER_OPT) -> None:
    """Let a held job be scheduled again (its place in the queue is kept)."""
    with client_for(cluster) as client:
        job = client.hold(job_id, release=True)
    console.print(f"job {job.id}: {styled(job.state)}")


def events(
    job: int = typer.Option(None, "--job", "-j"),
    node: str = typer.Option(None, "--node"),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """The event log: every state change of nodes, jobs and attempts."""
    with client_for(cluster) as client:
        items = client.events(job_id=job, node=node)
    if as_json:
        console.print_json(json.dumps([e.model_dump(mode="json") for e in items]))
        return
    for e in items:
        print(event_line(e))


def event_line(e: EventInfo) -> str:
    """One event of ``trainpod events``: when, kind, where, then its typed fields."""
    when = time.strftime("%H:%M:%S", time.localtime(e.ts)) + f".{int(e.ts * 1000) % 1000:03d}"
    who = " ".join(
        x
        for x in (
            e.node or "",
            f"job {e.job_id}" if e.job_id else "",
            f"attempt {e.attempt}" if e.attempt else "",
        )
        if x
    )
    shown = details(parse(e))
    shown.pop("log_tail", None)  # many lines: `trainpod logs` shows them
    data = " ".join(f"{k}={show_value(v)}" for k, v in shown.items())
    return f"{when} {e.kind:<18} {who:<28} {data}"


def goodput(
    job_id: int = typer.Argument(...),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Where a job's wall-clock time went: productive training and lost time by cause."""
    from trainpod.cli.goodput import render
    from trainpod.telemetry.goodput import compute_goodput

    with client_for(cluster) as client:
        report = compute_goodput(client.job(job_id), client.events(job_id=job_id), time.time())
    if as_json:
        console.print_json(json.dumps(report.to_dict()))
    else:
        render(report)


def _cause(a: AttemptInfo) -> str:
    """`` (crash)``, or `` (node_lost; detected as crash)`` once the fault was classified."""
    if a.fault and a.cause and a.fault != a.cause:
        return f" ({a.fault}; detected as {a.cause})"
    return f" ({a.cause})" if a.cause else ""
