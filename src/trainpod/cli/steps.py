"""``trainpod run CMD``: a step inside an allocation, as srun is inside salloc.

The controller plans the step (one launch order per node of the allocation, the torchrun
contract, a rendezvous port of its own; controller/allocations.py) and nothing is queued:
the allocation holds the nodes. On the embedded backend every node is a local process on
this host, so this CLI starts the ranks itself from those orders, streams their output and
exits with their status (docs/decisions/0014-interactive-allocations.md says why, and what
agent-launched steps would take).

As torchrun's launcher does, this CLI hosts the step's rendezvous store (a c10d ``TCPStore``
at ``MASTER_ADDR:MASTER_PORT``) and keeps it until every rank has ended, so the ranks may end
in any order: a rank still tearing down never finds the store gone because rank 0 left first
(ADR 0028; the agents do the same for jobs). The store opens in a thread while the ranks
start (importing torch takes seconds; a c10d client retries until the store is there); if it
cannot open, the step stops with the reason. A step of one rank gets none (its rank hosts
its own, if it makes one): nothing there can leave before another.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO

import typer

from trainpod.agent.rdzvstore import tcp_store
from trainpod.api.models import LaunchOrder, StepRequest
from trainpod.cli.context import client_for
from trainpod.cli.jobs import default_env, parse_env
from trainpod.cli.render import err_console
from trainpod.errors import SpecError

ALLOCATION_ENV = "TRAINPOD_ALLOCATION"  # set in an allocation's shell (controller/allocations.py)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)  # each stops every rank


def run(
    command: list[str] = typer.Argument(..., help="the command, after --"),
    procs_per_node: int = typer.Option(
        None, "--procs-per-node", "-p", help="ranks per node (default: its device count)"
    ),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    job: int = typer.Option(None, "--job", help=f"the allocation (default: ${ALLOCATION_ENV})"),
    cluster: str = typer.Option(None, "--cluster", "-c"),
) -> None:
    """Inside an allocation: run CMD as ranks on its nodes (the torchrun contract), stream
    their output and exit with their status, without queueing again (srun in salloc)."""
    job_id = job if job is not None else _allocation_from_env()
    req = StepRequest(
        command=command,
        procs_per_node=procs_per_node,
        env={**default_env(), **parse_env(env)},
        workdir=str(Path.cwd()),
    )
    with client_for(cluster) as client:
        plan = client.start_step(job_id, req)
        orders = [plan.orders[n] for n in plan.nodes]
        code = Step(orders).run()
        client.end_step(job_id, plan.step, code)
    raise typer.Exit(code)


def _allocation_from_env() -> int:
    value = os.environ.get(ALLOCATION_ENV, "")
    if not value.isdigit():
        raise SpecError(
            "trainpod run works inside an allocation: run it in the shell `trainpod alloc` "
            f"opens (it sets {ALLOCATION_ENV}), or pass --job ALLOCATION"
        )
    return int(value)


class StoreHost:
    """The step's rendezvous store, opened in a thread and kept until :meth:`close`."""

    def __init__(self, addr: str, port: int) -> None:
        self.addr, self.port = addr, port
        self.error = ""
        """Why the store could not open (empty while it opens or once open)."""
        self._store: object | None = None
        self._thread = threading.Thread(target=self._open, name="step-store", daemon=True)

    def open_soon(self) -> None:
        self._thread.start()

    def _open(self) -> None:
        try:
            self._store = tcp_store(self.addr, self.port)
        except Exception as exc:  # a taken port, an address not this host's, no torch
            self.error = f"{exc} (the step's rendezvous store); its ranks cannot meet"

    def close(self) -> None:
        self._thread.join(timeout=60)
        self._store = None  # the server stops with its last reference


class Step:
    """The ranks of one step, spawned here (every embedded node is on this host): their
    output streamed to ours and to the step's rank logs; the first to fail stops the rest,
    as torchrun does; SIGINT, SIGTERM and SIGHUP stop them all."""

    GRACE_S = 5.0

    def __init__(self, orders: list[LaunchOrder]) -> None:
        self._orders = orders
        first = orders[0].env if orders else {}
        # One rank meets nobody: it hosts its own store if it makes one, and a quick step
        # (`trainpod run -- nvidia-smi`) does not wait for this CLI to import torch.
        world = sum(len(o.ranks) for o in orders)
        asked = first.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in first
        self._hosting = asked and world > 1
        self._store = (
            StoreHost(first["MASTER_ADDR"], int(first["MASTER_PORT"])) if self._hosting else None
        )
        self._procs: list[subprocess.Popen[bytes]] = []
        self._where: list[str] = []  # "rank R on NODE", by process
        self._out = threading.Lock()

    def run(self) -> int:
        stop: list[int] = []

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            stop.append(signum)

        old = {
            s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
        }
        readers: list[threading.Thread] = []
        if self._store is not None:
            self._store.open_soon()
        try:
            for order in self._orders:
                Path(order.log_dir).mkdir(parents=True, exist_ok=True)
                for slot in order.ranks:
                    proc = self._spawn(order, slot.rank, slot.local_rank)
                    log = Path(order.log_dir) / f"rank-{slot.rank}.log"
                    t = threading.Thread(target=self._copy, args=(proc.stdout, log), daemon=True)
                    t.start()
                    readers.append(t)
            code = self._wait(stop)
        finally:
            self._stop_all()
            if self._store is not None:
                self._store.close()  # after every rank: none finds it gone while tearing down
            for t in readers:
                t.join(timeout=5)
            for s, handler in old.items():
                signal.signal(s, handler)
        return code

    def _spawn(self, order: LaunchOrder, rank: int, local_rank: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, **order.env}
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), ROLE_RANK=str(rank))
        env["TORCHELASTIC_USE_AGENT_STORE"] = str(self._hosting)
        env.setdefault("PYTHONUNBUFFERED", "1")
        Path(env["TRAINPOD_JOB_SCRATCH_DIR"]).mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.Popen(
                order.argv,
                cwd=order.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped as one, like the agent's
            )
        except OSError as exc:
            raise SpecError(f"cannot start {order.argv!r} in {order.workdir}: {exc}") from None
        self._procs.append(proc)
        self._where.append(f"rank {rank} on {env.get('TRAINPOD_NODE', '?')}")
        return proc

    def _copy(self, stream: IO[bytes] | None, log: Path) -> None:
        assert stream is not None
        with log.open("ab") as f:
            for line in iter(stream.readline, b""):
                f.write(line)
                with self._out:
                    sys.stdout.buffer.write(line)
                    sys.stdout.buffer.flush()

    def _wait(self, stop: list[int]) -> int:
        """The step's status: the first failing rank's (128+N for signal N), else 0."""
        while True:
            if stop:
                return 128 + stop[0]
            if self._store is not None and self._store.error:
                err_console.print(f"trainpod run: {self._store.error}")
                return 1
            codes = [p.poll() for p in self._procs]
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                i, code = failed[0]
                how = f"signal {-code}" if code < 0 else f"code {code}"
                err_console.print(f"trainpod run: {self._where[i]} exited with {how}")
                return 128 - code if code < 0 else code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)

    def _stop_all(self) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()


def _killpg(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
