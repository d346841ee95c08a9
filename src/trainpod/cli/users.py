"""``trainpod users add|list|revoke``, ``trainpod login`` and ``trainpod whoami``.

An admin issues a user's token with ``users add``; it is shown once (only its hash is kept
by the controller). ``--save`` writes it where the CLI looks for it, 0600; a user who got
the token some other way stores it with ``trainpod login``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys

import typer
from rich.table import Table

from trainpod.api.models import NewToken
from trainpod.cli.context import client_for, resolve_cluster, save_token, token_file
from trainpod.cli.render import console
from trainpod.errors import SpecError

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")

app = typer.Typer(help="Users and their tokens (admins).", no_args_is_help=True)


@app.command("add")
def add(
    name: str = typer.Argument(..., help="the user's name (a POSIX user name)"),
    team: str = typer.Option(None, "--team", help="their team (users the spec declares: theirs)"),
    role: str = typer.Option("user", "--role", help="user | admin"),
    save: bool = typer.Option(
        False, "--save", help="also store the token for this CLI (as `trainpod login` does)"
    ),
    as_json: bool = typer.Option(False, "--json"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Issue a bearer token for NAME (adding the user if the spec does not declare them).
    The token is shown once."""
    if role not in ("user", "admin"):
        raise SpecError(f"--role {role!r} is not a role; use user or admin")
    with client_for(cluster) as client:
        issued = client.add_user(NewToken(name=name, team=team, role=role))
    if save:
        where = save_token(resolve_cluster(cluster).name, issued.token)
        console.print(f"saved to {where} (0600)", markup=False)
    if as_json:
        console.print_json(json.dumps(issued.model_dump(mode="json")))
        return
    u = issued.user
    console.print(
        f"token {issued.token_id} for {u.name} (team {u.team or '-'}, {u.role}); "
        "shown once, keep it secret:",
        markup=False,
    )
    print(issued.token)
    console.print(
        f"give it to {u.name}: `trainpod login` stores it (or set TRAINPOD_TOKEN)", markup=False
    )


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json"), cluster: str = CLUSTER_OPT) -> None:
    """Every user: team, role, POSIX account and tokens."""
    with client_for(cluster) as client:
        users = client.users()
    if as_json:
        console.print_json(json.dumps([u.model_dump(mode="json") for u in users]))
        return
    table = Table(box=None, header_style="bold")
    for col in ("USER", "TEAM", "ROLE", "ACCOUNT", "FROM", "TOKENS"):
        table.add_column(col)
    for u in users:
        live = [t for t in u.tokens if t.revoked_at is None]
        tokens = ", ".join(f"{t.id} ({_when(t.created_at)})" for t in live) or "-"
        table.add_row(u.name, u.team or "-", u.role, u.account or "-", u.source, tokens)
    console.print(table)


@app.command("revoke")
def revoke(
    name: str = typer.Argument(..., help="the user"),
    token: str = typer.Option(None, "--token", help="one token id (default: all of them)"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Revoke a user's tokens: calls made with them are refused from now on."""
    with client_for(cluster) as client:
        ids = client.revoke(name, token)
    console.print(f"revoked {len(ids)} token(s) of {name}: {', '.join(ids) or '-'}", markup=False)


def login(
    token: str = typer.Option(
        None, "--token", help="the token (default: read from stdin, so it stays off the history)"
    ),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Store your token for a cluster (0600 under $TRAINPOD_HOME/tokens) and check it."""
    paths = resolve_cluster(cluster)
    value = (token if token is not None else sys.stdin.readline()).strip()
    if not value:
        raise SpecError("no token given; pass --token or pipe it on stdin")
    previous = token_file(paths.name).read_text() if token_file(paths.name).exists() else None
    where = save_token(paths.name, value)
    try:
        with client_for(paths.name) as client:
            me = client.whoami()
    except Exception:
        if previous is None:  # keep nothing that does not work
            where.unlink()
        else:
            save_token(paths.name, previous)
        raise
    console.print(f"logged in to {paths.name} as {me.name} ({me.role}); token in {where}")


def whoami(cluster: str = CLUSTER_OPT) -> None:
    """Who this CLI calls the cluster as."""
    with client_for(cluster) as client:
        me = client.whoami()
    console.print(f"{me.name} ({me.role}, team {me.team or '-'})", markup=False)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
