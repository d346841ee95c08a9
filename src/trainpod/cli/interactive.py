"""Interactive work: ``trainpod alloc`` and ``trainpod shell`` (``trainpod run``: cli/steps.py).

On the embedded backend every node is a local process on this host, so a shell "on a node"
and the ranks of a ``trainpod run`` step are spawned here, by this CLI, from the
environment, cwd and launch orders the controller computes for that node (the same
functions its launch orders use; devices are simulated on a machine without GPUs, and the
shell says so). On Slurm, ``trainpod alloc`` is salloc (:mod:`trainpod.cli.slurm`) and a
shell or a step on a node is srun's to give. See docs/decisions/0014-interactive-allocations.md.

Where this CLI runs as root and the caller maps to a POSIX account (``ShellContext.account``),
the shell (or command) runs as that account: its uid, gid and groups, its HOME, and a clean
environment (the node's and job's variables, nothing of root's), as the job's ranks do
(:mod:`trainpod.agent.accounts`), with a trainpod home of its own holding the caller's token
so that ``trainpod run`` inside acts as the caller (:mod:`trainpod.cli.shellhome`). Elsewhere
it runs as the CLI's own user.

An allocation stands while this CLI renews its lease (:class:`LeaseKeeper`); it is given back
when the shell exits, when the terminal closes (SIGHUP) or the CLI is stopped (SIGTERM,
Ctrl-C while queued), and the controller ends it when the renewals stop (SIGKILL).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import typer

from trainpod.agent.accounts import AccountError, RunAs, run_as
from trainpod.api.models import JobInfo, ShellContext
from trainpod.cli import slurm
from trainpod.cli.context import client_for, resolve_cluster
from trainpod.cli.jobs import default_env, job_spec, parse_env
from trainpod.cli.render import err_console, styled
from trainpod.cli.shellhome import ShellHome, shell_home
from trainpod.client.http import TrainpodClient
from trainpod.errors import Conflict, ControllerUnavailable, Fatal, SpecError
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.spec.job import JobSpec

HOLD_COMMAND = ["python", "-m", "trainpod.agent.hold"]
SHELL_OPT = typer.Option(
    None, "--shell", help="the shell to start (default: $SHELL, else bash), e.g. 'bash -i'"
)
_RELEASE_WAIT_S = 60.0
_POLL_S = 0.25
_STOP_SIGNALS = (signal.SIGHUP, signal.SIGTERM)


class Stopped(Exception):
    """This CLI got SIGHUP or SIGTERM: the allocation is given back."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- trainpod alloc -------------------------------------------------------------------------
def alloc(
    command: list[str] = typer.Argument(
        None, help="Slurm: the job to run in salloc; embedded: run this instead of a shell"
    ),
    nodes: int = typer.Option(1, "--nodes", "-N"),
    procs_per_node: int = typer.Option(None, "--procs-per-node", "-p", help="Slurm only"),
    partition: str = typer.Option(None, "--partition"),
    name: str = typer.Option("", "--name", help="the allocation's name (default: alloc)"),
    spares: int = typer.Option(0, "--spares", help="Slurm only"),
    time_limit: str = typer.Option(None, "--time", help="ends the allocation after this"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    auto_resume: bool = typer.Option(False, "--auto-resume", help="Slurm only"),
    shell: str = SHELL_OPT,
    cluster: str = typer.Option(None, "--cluster", "-c"),
) -> None:
    """Hold nodes as a job of their own and open a shell with its environment on the first
    (like salloc); `trainpod run CMD` inside runs CMD on them. Exiting the shell releases them."""
    paths = resolve_cluster(cluster)
    if ClusterRecord.load(paths).backend == "slurm":
        if not command:
            raise SpecError(
                "on a Slurm cluster `trainpod alloc` runs a job in salloc: "
                "trainpod alloc -N 2 -- python train.py"
            )
        slurm.alloc(
            command=command,
            nodes=nodes,
            procs_per_node=procs_per_node,
            partition=partition,
            spares=spares,
            time_limit=time_limit,
            env=env,
            auto_resume=auto_resume,
            cluster=cluster,
        )
        return
    if spares or auto_resume or procs_per_node is not None:
        raise SpecError(
            "--spares, --auto-resume and --procs-per-node are for Slurm's alloc; an embedded "
            "allocation holds whole nodes (give `trainpod run -p N` the ranks per node)"
        )
    spec = job_spec(
        command=HOLD_COMMAND,
        name=name or "alloc",
        nodes=nodes,
        procs_per_node=1,  # one hold process per node
        partition=partition,
        time_limit=time_limit,
        env={**default_env(), **parse_env(env)},
        workdir=str(Path.cwd()),
        user=getpass.getuser(),
        interactive=True,
    )
    argv = list(command) if command else []
    with client_for(paths.name) as client:
        alloc = EmbeddedAllocation(client, lambda: client_for(paths.name), argv, shell, paths)
        code = alloc.run(spec)
    raise typer.Exit(code)


class LeaseKeeper:
    """Renews the allocation's lease until stopped or until the allocation has ended; then
    calls ``on_end`` with why (the shell is closed: the nodes are gone)."""

    def __init__(
        self,
        connect: Callable[[], TrainpodClient],
        job_id: int,
        on_end: Callable[[str], None],
    ) -> None:
        self._connect = connect
        self._job_id = job_id
        self._on_end = on_end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        every = 1.0
        placed = False
        with self._connect() as client:  # its own connection: the main thread has one
            while not self._stop.is_set():
                try:
                    lease = client.renew_lease(self._job_id)
                    every = lease.renew_every_s
                except Conflict as exc:  # ended or ending: the controller says why
                    if not self._stop.is_set():
                        self._on_end(str(exc).split(": ", 1)[-1])
                    return
                except ControllerUnavailable:
                    every = 1.0  # keep trying: the lease outlives a controller restart
                else:
                    placed = placed or lease.state == "running"
                    if placed and lease.state != "running":
                        # Its nodes were taken (preempted, a node lost): a shell there would
                        # lie, and a requeued allocation would hold nodes nobody uses.
                        self._on_end(f"it is {lease.state.value} again ({lease.reason})")
                        return
                self._stop.wait(every)


class EmbeddedAllocation:
    """One ``trainpod alloc`` on the embedded backend, from submission to release."""

    def __init__(
        self,
        client: TrainpodClient,
        connect: Callable[[], TrainpodClient],
        argv: list[str],
        shell: str | None = None,
        paths: ClusterPaths | None = None,
    ) -> None:
        """``argv``: the command to run instead of a shell ([]: the shell, ``shell`` or the
        default one of whoever it runs as). ``paths``: the cluster, for a shell that runs as
        the caller's account to use trainpod as the caller (:mod:`trainpod.cli.shellhome`)."""
        self._client = client
        self._connect = connect
        self._argv = argv
        self._shell_option = shell
        self._paths = paths
        self._child: subprocess.Popen[bytes] | None = None
        self._ended = ""  # why the allocation ended under the shell, if it did

    def run(self, spec: JobSpec) -> int:
        job = self._client.submit(spec)
        keeper = LeaseKeeper(self._connect, job.id, self._allocation_ended)
        keeper.start()
        code, why = 1, "trainpod alloc ended"
        try:
            with _stop_signals():
                try:
                    ctx = self._wait_placed(job)
                except KeyboardInterrupt:
                    why = "Ctrl-C while it was queued"
                    err_console.print(f"allocation {job.id}: cancelled ({why})")
                    return 130
                code = self._shell(ctx)
                why = f"the shell exited with status {code}"
                if self._ended:
                    err_console.print(f"allocation {job.id} ended: {self._ended}")
                    code = code or 1
        except Stopped as exc:
            why = f"trainpod alloc got {exc} (terminal closed or stopped)"
            code = 128 + exc.signum
            if self._child is not None and self._child.poll() is None:
                self._child.send_signal(signal.SIGHUP)
        finally:
            keeper.stop()
            self._release(job.id, why)
        return code

    def _allocation_ended(self, why: str) -> None:
        self._ended = why
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGHUP)

    def _wait_placed(self, job: JobInfo) -> ShellContext:
        """Show the queue reason and position while it waits; the shell's context once the
        hold processes run."""
        said = ""
        while True:
            job = self._client.job(job.id)
            if job.state.ended:
                raise Fatal(f"allocation {job.id} ended before it started: {job.reason}")
            if job.state == "queued":
                line = f"allocation {job.id} queued: {job.reason or 'waiting'}{self._place(job)}"
            else:
                line = f"allocation {job.id} {job.state.value}"
            if line != said:
                err_console.print(line, soft_wrap=True)
                said = line
            if job.state == "running":
                try:
                    return self._client.shell_context(job_id=job.id)
                except Conflict:
                    pass  # the hold processes are still starting
            time.sleep(_POLL_S)

    @staticmethod
    def _place(job: JobInfo) -> str:
        """Its place in scheduling order and expected start, as the controller gives them."""
        if job.queue_position is None:
            return ""
        start = ""
        if job.estimated_start is not None:
            start = f", expected to start in {max(0.0, job.estimated_start - time.time()):.0f}s"
        return f" (position {job.queue_position}{start})"

    def _shell(self, ctx: ShellContext) -> int:
        nodes = ctx.env.get("TRAINPOD_NODES", ctx.node)
        err_console.print(
            f"allocation {ctx.job_id}: nodes {nodes}; shell on {ctx.node} in {ctx.cwd}\n"
            f"  {ctx.note}\n"
            "  on the embedded backend the nodes are processes on this host: the shell runs "
            "here with the node's environment\n"
            "  `trainpod run CMD` runs CMD on the allocation's nodes; exit releases them",
            soft_wrap=True,
        )
        with shell_for(self._argv, ctx, self._shell_option, self._paths) as child:
            self._child = child
            with _ignored(signal.SIGINT):  # Ctrl-C is the shell's
                return wait_child(child)

    def _release(self, job_id: int, why: str) -> None:
        # A second SIGHUP (or SIGTERM, Ctrl-C) must not stop us before the nodes are back;
        # once the terminal is gone, saying so fails (EIO), which changes nothing.
        with _ignored(signal.SIGHUP), _ignored(signal.SIGTERM), _ignored(signal.SIGINT):
            try:
                self._client.release(job_id, why)
            except Conflict:
                pass  # it had ended already
            deadline = time.monotonic() + _RELEASE_WAIT_S
            job = self._client.job(job_id)
            while not job.state.ended and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                job = self._client.job(job_id)
            with contextlib.suppress(OSError):
                err_console.print(
                    f"allocation {job_id} released: {styled(job.state)} ({why})", soft_wrap=True
                )


# -- trainpod shell -------------------------------------------------------------------------
def shell_cmd(
    target: str = typer.Argument(..., help="a node name, or a job id"),
    node: str = typer.Option(None, "--node", help="for a job: which of its nodes"),
    shell: str = SHELL_OPT,
    cluster: str = typer.Option(None, "--cluster", "-c"),
) -> None:
    """A shell on a node with its scratch dir and devices; for a job, with the job's
    environment too (on its first node, or --node)."""
    paths = resolve_cluster(cluster)
    if ClusterRecord.load(paths).backend == "slurm":
        raise Fatal(
            "on a Slurm cluster a shell on a node is srun's: "
            "srun --jobid SLURM_JOB_ID --overlap --pty -w NODE bash (`trainpod show JOB` "
            "gives the job's Slurm id)"
        )
    job_id = int(target) if target.isdigit() else None
    with client_for(paths.name) as client:
        if job_id is None:
            if node is not None:
                raise SpecError(f"--node is for a job; {target!r} is a node already")
            ctx = client.shell_context(node=target)
        else:
            ctx = client.shell_context(node=node, job_id=job_id)
    what = f"job {ctx.job_id} on {ctx.node}" if ctx.job_id is not None else ctx.node
    err_console.print(f"shell for {what} in {ctx.cwd}\n  {ctx.note}", soft_wrap=True)
    with shell_for([], ctx, shell, paths) as child, _ignored(signal.SIGINT):
        code = wait_child(child)
    raise typer.Exit(code)


def shell_argv(shell: str | None, default: str | None = None) -> list[str]:
    return shlex.split(shell or default or os.environ.get("SHELL") or "bash")


@contextlib.contextmanager
def shell_for(
    argv: list[str], ctx: ShellContext, shell: str | None, paths: ClusterPaths | None
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`spawn`; where it runs as the caller's account, with (given the cluster's
    ``paths``) a trainpod home of its own that acts as the caller, removed on leaving."""
    account = _account(ctx)
    home = shell_home(paths, account) if paths is not None else ShellHome()
    try:
        if home.path is not None:
            err_console.print(f"  trainpod in the shell acts as you ({home.path}, yours alone)")
        yield spawn(argv, ctx, shell, account, home.env)
    finally:
        home.remove()


def spawn(
    argv: list[str],
    ctx: ShellContext,
    shell: str | None = None,
    account: RunAs | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """The command ``argv`` (empty: the shell, ``shell`` or the default one), here, with the
    node's environment and cwd; as ``account`` (the caller's, where this CLI is root: see
    :func:`_account`), with ``extra_env`` too."""
    argv = argv or shell_argv(shell, account.shell if account is not None else None)
    cwd = Path(ctx.cwd)
    if not cwd.is_dir():
        cwd.mkdir(parents=True, exist_ok=True)
        if account is not None:
            account.own(cwd, private=True)  # a job's scratch: the account's alone
    try:
        if account is None:
            return subprocess.Popen(argv, cwd=cwd, env={**os.environ, **ctx.env})
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=account.env({**ctx.env, **(extra_env or {})}),
            user=account.uid,
            group=account.gid,
            extra_groups=list(account.groups),
        )
    except OSError as exc:
        raise SpecError(f"cannot start {argv!r}: {exc}; choose one with --shell") from None


def _account(ctx: ShellContext) -> RunAs | None:
    """Who the shell runs as: the caller's account where this CLI is root, else None (the
    CLI's user). An account missing on this host is refused with the fix."""
    if ctx.account is None or os.geteuid() != 0:
        return None
    try:
        account = run_as(ctx.account)
    except AccountError as exc:
        raise Fatal(f"cannot open the shell: {exc}") from None
    err_console.print(f"  the shell runs as account {account.name} (uid {account.uid})")
    return account


def wait_child(child: subprocess.Popen[bytes]) -> int:
    code = child.wait()
    return 128 - code if code < 0 else code


# -- signals --------------------------------------------------------------------------------
@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGHUP (the terminal closed) and SIGTERM raise :class:`Stopped` in the main thread."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise Stopped(signum)

    old = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _ignored(sig: signal.Signals) -> Iterator[None]:
    old = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, old)
