"""``trainpod cluster ...``: validate, create, list, describe, start, stop, delete, backup,
restore."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from trainpod.api.models import NodeInfo
from trainpod.backends.base import backend_for
from trainpod.cli.context import client_for, cluster_names, resolve_cluster, set_current
from trainpod.cli.render import console, nodes_table
from trainpod.client.http import TrainpodClient
from trainpod.errors import ControllerUnavailable, Fatal
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.spec.loading import load_cluster_spec
from trainpod.spec.tls import plain_http_problem
from trainpod.store import backup as db_backup

app = typer.Typer(help="Create and manage clusters.", no_args_is_help=True)

SPEC_OPT = typer.Option(..., "-f", "--file", help="cluster spec (YAML)", exists=False)
_SETTLED = {"idle", "failed", "allocated", "suspect", "quarantined", "retired"}


@app.command()
def validate(file: Path = SPEC_OPT) -> None:
    """Check a cluster spec without creating anything."""
    spec = load_cluster_spec(file)
    nodes = spec.node_names()
    console.print(
        f"[green]ok[/]: {file} describes cluster [bold]{spec.name}[/] "
        f"({spec.backend}) with {len(nodes)} nodes: {', '.join(n for n, _ in nodes)}"
    )
    why = plain_http_problem(spec.controller.host, spec.controller.tls, insecure=False)
    if why is not None:
        console.print(f"[yellow]note[/]: `cluster create` will refuse it: {why}")


def wait_for_nodes(client: TrainpodClient, timeout_s: float) -> list[NodeInfo]:
    """Poll until every node has left provisioning/setting_up, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    shown: dict[str, str] = {}
    while True:
        nodes = client.nodes()
        for n in nodes:
            if shown.get(n.name) != n.state:
                shown[n.name] = n.state
                console.print(f"  {n.name:<14} {n.state}")
        if all(n.state in _SETTLED for n in nodes) or time.monotonic() > deadline:
            return nodes
        time.sleep(0.2)


@app.command()
def create(
    file: Path = SPEC_OPT,
    wait: bool = typer.Option(True, help="wait for nodes to finish their lifecycle scripts"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="how long to wait for nodes"),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        help="serve plain HTTP even on a non-loopback controller.host (no controller.tls)",
    ),
) -> None:
    """Create a cluster from a spec and start its controller and node agents."""
    spec = load_cluster_spec(file)
    paths = ClusterPaths.of(spec.name)
    backend = backend_for(spec.backend, paths)
    record = backend.create(spec, file.absolute(), insecure=insecure)
    if record.insecure:
        console.print(
            f"[yellow]warning[/]: --insecure: the controller serves plain HTTP on "
            f"{record.host}, which is not loopback; tokens cross the network in clear text"
        )
    set_current(spec.name)
    console.print(f"cluster [bold]{spec.name}[/] created; controller at {record.url}")
    console.print(f"  state dir: {paths.state_dir}\n  shared dir: {record.shared_dir}")
    if spec.backend == "slurm":
        console.print("  Slurm places the jobs; agents start inside each job's allocation")
        return
    if not wait:
        return
    with TrainpodClient.for_record(record, paths.admin_token.read_text().strip()) as client:
        nodes = wait_for_nodes(client, timeout_s)
    failed = [n for n in nodes if n.state == "failed"]
    for n in failed:
        console.print(f"[red]node {n.name} failed[/]: {n.reason}")
    if failed:
        raise Fatal(f"{len(failed)} node(s) failed to set up; see `trainpod cluster describe`")
    console.print("[green]ready[/]")


@app.command("list")
def list_() -> None:
    """List the clusters on this machine."""
    for name in cluster_names():
        paths = ClusterPaths.of(name)
        record = ClusterRecord.load(paths)
        procs = backend_for(record.backend, paths).processes()
        up = sum(p.alive for p in procs)
        console.print(f"{name:<20} {record.backend:<6} {record.url:<24} {up}/{len(procs)} up")


def transport(record: ClusterRecord) -> str:
    """How clients reach the controller: HTTPS and what it is verified against, or HTTP."""
    if record.ca_file is not None:
        return f"https (bound to {record.host}; clients verify against {record.ca_file})"
    if record.insecure:
        return f"[red]plain HTTP on {record.host}, not loopback (created with --insecure)[/]"
    return f"plain HTTP on loopback ({record.host})"


@app.command()
def describe(
    name: str = typer.Argument(None, help="cluster name (default: the current one)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show a cluster's processes, nodes and why any node failed."""
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    procs = backend_for(record.backend, paths).processes()
    try:
        with client_for(paths.name) as client:
            info, nodes = client.cluster(), client.nodes()
    except ControllerUnavailable:
        info, nodes = None, []
    if as_json:
        doc = {
            "record": record.model_dump(mode="json"),
            "processes": [{"name": p.name, "pid": p.pid, "alive": p.alive} for p in procs],
            "cluster": info.model_dump(mode="json") if info else None,
            "nodes": [n.model_dump(mode="json") for n in nodes],
        }
        console.print_json(json.dumps(doc))
        return
    console.print(f"[bold]{record.name}[/] ({record.backend}) controller {record.url}")
    console.print(f"  transport   {transport(record)}")
    console.print(f"  state dir   {paths.state_dir}")
    console.print(f"  shared dir  {record.shared_dir}")
    console.print(f"  scratch     {record.scratch_root}")
    console.print(f"  checkpoints {record.checkpoint_uri}")
    for p in procs:
        mark = "[green]up[/]" if p.alive else "[red]down[/]"
        console.print(f"  {p.name:<22} {mark} pid {p.pid or '-'}  log {p.log}")
    if info is None:
        console.print("[yellow]controller unreachable[/]: `trainpod cluster start` restarts it")
        return
    console.print(f"  partitions  {info.partitions}")
    if info.step_failures_in_a_row:
        console.print(
            f"[red]the reconcile loop is failing[/] ({info.step_failures_in_a_row} steps in a "
            f"row, backing off): {info.last_step_error}\n  see the controller's log above"
        )
    elif info.step_failures:
        console.print(
            f"  reconcile   {info.step_failures} failed steps since start, recovered; "
            f"last: {info.last_step_error}"
        )
    console.print(nodes_table(nodes))
    for n in nodes:
        if n.state == "failed":
            console.print(f"\n[red]{n.name} failed[/]: {n.reason}")


@app.command()
def start(name: str = typer.Argument(None)) -> None:
    """Start whatever of a stopped cluster is not running (state is kept)."""
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    started = backend_for(record.backend, paths).start()
    console.print(f"started: {', '.join(started) or 'nothing (all running)'}")


@app.command()
def stop(name: str = typer.Argument(None)) -> None:
    """Stop the cluster's processes (running jobs' workers are stopped too)."""
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    stopped = backend_for(record.backend, paths).stop()
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@app.command()
def delete(
    name: str = typer.Argument(..., help="cluster name"),
    purge: bool = typer.Option(False, help="also delete the shared dir"),
) -> None:
    """Stop a cluster and remove its state; the shared dir stays unless --purge."""
    paths = ClusterPaths.of(name)
    record = ClusterRecord.load(paths)
    backend_for(record.backend, paths).delete(purge=purge)
    kept = "" if purge else f"; shared dir kept at {record.shared_dir}"
    console.print(f"cluster {name} deleted{kept}")


@app.command()
def backup(
    name: str = typer.Argument(None, help="cluster name (default: the current one)"),
    to: Path | None = typer.Option(
        None, "--to", help="the backup file (default: the state dir's backups/)"
    ),
) -> None:
    """Copy the cluster's database with SQLite's online backup API (safe while it runs)."""
    paths = resolve_cluster(name)
    dest = to.absolute() if to is not None else db_backup.default_backup_path(paths.backups)
    db_backup.backup(paths.db, dest)
    version = db_backup.check(dest).schema_version
    console.print(f"backed up {paths.db} to {dest} (integrity ok, schema version {version})")


@app.command()
def restore(
    name: str = typer.Argument(None, help="cluster name (default: the current one)"),
    from_: Path | None = typer.Option(
        None, "--from", help="the backup to restore (default: the newest in backups/)"
    ),
) -> None:
    """Replace the cluster's database with a checked backup; the controller must be down."""
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    up = [p for p in backend_for(record.backend, paths).processes() if p.alive]
    controller = next((p for p in up if p.name == "controller"), None)
    if controller is not None:
        raise Fatal(
            f"the controller of {paths.name} is running (pid {controller.pid}): a database "
            f"cannot be replaced under it; `trainpod cluster stop {paths.name}` first"
        )
    source = from_.absolute() if from_ is not None else db_backup.newest_backup(paths.backups)
    if source is None:
        raise Fatal(
            f"no backup in {paths.backups}; name one with --from PATH "
            f"(`trainpod cluster backup {paths.name}` makes them)"
        )
    result = db_backup.restore(source, paths.db)
    console.print(
        f"restored {paths.db} from {source} (integrity ok, schema version "
        f"{result.schema_version}); `trainpod cluster start {paths.name}` starts the controller"
    )
