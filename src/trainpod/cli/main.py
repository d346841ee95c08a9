"""The ``trainpod`` command."""

from __future__ import annotations

import logging

import typer

from trainpod.cli import (
    chaos,
    cluster,
    interactive,
    jobs,
    nodes,
    preempt,
    slurm,
    steps,
    tensorboard,
    top,
    users,
)
from trainpod.cli.render import err_console
from trainpod.errors import Retryable, TrainpodError

app = typer.Typer(
    help="trainpod: a self-hosted, self-healing training cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(cluster.app, name="cluster")
app.add_typer(nodes.app, name="nodes")
app.add_typer(chaos.app, name="chaos")
app.add_typer(slurm.app, name="slurm")
app.add_typer(users.app, name="users")
app.command("login")(users.login)
app.command("whoami")(users.whoami)
app.command("health")(slurm.health)
app.command(
    "alloc",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)(interactive.alloc)  # Slurm: salloc (cli/slurm.py); embedded: hold processes and a shell
app.command("shell")(interactive.shell_cmd)
app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)(steps.run)
app.command(
    "submit",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)(jobs.submit)
app.command("jobs")(jobs.jobs)
app.command("show")(jobs.show)
app.command("logs")(jobs.logs)
app.command("cancel")(jobs.cancel)
app.command("hold")(jobs.hold)
app.command("release")(jobs.release)
app.command("preempt")(preempt.preempt)
app.command("events")(jobs.events)
app.command("goodput")(jobs.goodput)
app.command("tensorboard")(tensorboard.tensorboard)
app.command("top")(top.top)


@app.command("demo")
def demo(
    steps: int = typer.Option(200, "--steps", help="training steps"),
    delete_after: bool = typer.Option(False, "--delete-after", help="delete the demo cluster"),
    fault: str = typer.Option("xid79", "--fault", help="fault to inject halfway; 'none' for none"),
) -> None:
    """Train the GPT example across 2 nodes, pull a GPU halfway, watch it heal and finish."""
    from trainpod.cli.demo import run_demo

    run_demo(steps=steps, delete_after=delete_after, fault=None if fault == "none" else fault)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except TrainpodError as exc:
        err_console.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        raise SystemExit(75 if isinstance(exc, Retryable) else 2) from None


if __name__ == "__main__":
    main()
