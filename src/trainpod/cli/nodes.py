"""``trainpod nodes``: the nodes, their state, health facts and why any is not idle."""

from __future__ import annotations

import json

import typer

from trainpod.cli.context import client_for
from trainpod.cli.render import console, nodes_table

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")


def nodes(
    as_json: bool = typer.Option(False, "--json"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="full reasons and facts"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """List the cluster's nodes."""
    with client_for(cluster) as client:
        items = client.nodes()
    if as_json:
        console.print_json(json.dumps([n.model_dump(mode="json") for n in items]))
        return
    console.print(nodes_table(items))
    for n in items:
        if n.state == "failed" or (verbose and n.reason):
            console.print(f"\n[bold]{n.name}[/] {n.state}: {n.reason}", markup=True)
        if verbose:
            facts = {k: v for k, v in n.facts.items() if k != "lifecycle"}
            console.print(f"  {n.name} facts: {json.dumps(facts)}", markup=False)
