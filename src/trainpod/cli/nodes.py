"""``trainpod nodes``: list nodes; drain, quarantine, resume or replace one."""

from __future__ import annotations

import json

import typer

from trainpod.api.models import NodeAction
from trainpod.cli.context import client_for
from trainpod.cli.render import console, nodes_table, styled

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")
REASON_OPT = typer.Option(..., "--reason", "-r", help="why (recorded on the node)")

app = typer.Typer(help="List nodes and take them in or out of service.")


@app.callback(invoke_without_command=True)
def nodes(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="full reasons and facts"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """List the cluster's nodes: state, health, job and why any is not idle."""
    if ctx.invoked_subcommand is not None:
        return
    with client_for(cluster) as client:
        items = client.nodes()
    if as_json:
        console.print_json(json.dumps([n.model_dump(mode="json") for n in items]))
        return
    console.print(nodes_table(items))
    for n in items:
        health = [h for h in n.facts.get("health", []) if h.get("status") != "ok"]
        if n.state in ("failed", "quarantined", "retired", "repairing") or (verbose and n.reason):
            console.print(f"\n[bold]{n.name}[/] {styled(n.state)}: {n.reason}")
        for h in health:
            console.print(
                f"  {n.name} health {h['check']}: {h['status']}: {h['reason']}", markup=False
            )
        if verbose:
            facts = {k: v for k, v in n.facts.items() if k not in ("lifecycle", "health")}
            console.print(f"  {n.name} facts: {json.dumps(facts)}", markup=False)


def _act(name: str, action: str, reason: str, cluster: str | None) -> None:
    with client_for(cluster) as client:
        node = client.node_action(name, NodeAction(action=action, reason=reason))
    console.print(
        f"{node.name}: {styled(node.state)}{' (drained)' if node.drained else ''} {node.reason}"
    )


@app.command()
def drain(name: str, reason: str = REASON_OPT, cluster: str = CLUSTER_OPT) -> None:
    """No new work lands on the node; what runs there keeps running."""
    _act(name, "drain", reason, cluster)


@app.command()
def quarantine(name: str, reason: str = REASON_OPT, cluster: str = CLUSTER_OPT) -> None:
    """Take the node out of service now (its job recovers elsewhere); held until resumed."""
    _act(name, "quarantine", reason, cluster)


@app.command()
def resume(name: str, reason: str = REASON_OPT, cluster: str = CLUSTER_OPT) -> None:
    """Undrain; a quarantined or retired node is deep-checked before it rejoins."""
    _act(name, "resume", reason, cluster)


@app.command()
def replace(name: str, reason: str = REASON_OPT, cluster: str = CLUSTER_OPT) -> None:
    """Replace the node with a fresh instance (clean scratch, lifecycle, deep check)."""
    _act(name, "replace", reason, cluster)
