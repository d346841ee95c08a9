"""``trainpod chaos``: inject faults through real mechanisms, once or on a schedule."""

from __future__ import annotations

import random
import time
from typing import get_args

import typer

from trainpod.api.models import ChaosFault, ChaosRequest
from trainpod.cli.context import client_for
from trainpod.cli.render import console
from trainpod.errors import Conflict, SpecError

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")
FAULTS: tuple[str, ...] = get_args(ChaosFault)
FAULT_HELP = (
    "kill-worker (SIGKILL a rank), kill-agent (the node dies with its ranks), hang (SIGSTOP a "
    "rank), xid79 / ecc / thermal (simulated GPU), disk-full (a real ballast file past the "
    "scratch quota), slow (duty-cycle SIGSTOP/SIGCONT: a straggler)"
)

app = typer.Typer(help="Prove that recovery works: inject faults.", no_args_is_help=True)


def _check_fault(fault: str) -> ChaosFault:
    if fault not in FAULTS:
        raise SpecError(f"unknown fault {fault!r}; use one of: {', '.join(FAULTS)}")
    return fault  # type: ignore[return-value]


@app.command()
def inject(
    node: str = typer.Option(..., "--node", "-n"),
    fault: str = typer.Option(..., "--fault", "-f", help=FAULT_HELP),
    rank: int = typer.Option(None, "--rank", help="default: the node's first running rank"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Inject one fault into one node now."""
    with client_for(cluster) as client:
        order = client.chaos(ChaosRequest(node=node, fault=_check_fault(fault), rank=rank))
    where = f" rank {order.rank}" if order.rank is not None else ""
    console.print(f"injected {order.fault} into {node}{where} (order {order.id})")


@app.command()
def run(
    mtbf_s: float = typer.Option(..., "--mtbf-s", help="mean seconds between faults"),
    duration_s: float = typer.Option(..., "--duration-s"),
    seed: int = typer.Option(0, "--seed"),
    faults: str = typer.Option(",".join(FAULTS), "--faults", help="comma-separated"),
    job: int = typer.Option(None, "--job", help="only nodes of this job (default: any job)"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Inject random faults (exponential gaps, seeded) into nodes running jobs."""
    kinds = [_check_fault(f.strip()) for f in faults.split(",") if f.strip()]
    rng = random.Random(seed)
    end = time.monotonic() + duration_s
    injected = 0
    with client_for(cluster) as client:
        while True:
            gap = rng.expovariate(1.0 / mtbf_s)
            if time.monotonic() + gap > end:
                break
            time.sleep(gap)
            busy = [
                n
                for n in client.nodes()
                if n.job_id is not None
                and n.state == "allocated"
                and (job is None or n.job_id == job)
            ]
            if not busy:
                console.print(f"{time.strftime('%H:%M:%S')} no node runs a job; skipped")
                continue
            node = rng.choice(sorted(busy, key=lambda n: n.name))
            fault = rng.choice(kinds)
            try:
                client.chaos(ChaosRequest(node=node.name, fault=fault))
            except Conflict as exc:
                console.print(f"{time.strftime('%H:%M:%S')} {fault} on {node.name}: {exc}")
                continue
            injected += 1
            console.print(
                f"{time.strftime('%H:%M:%S')} injected {fault} into {node.name} (job {node.job_id})"
            )
    console.print(f"chaos run over: {injected} faults in {duration_s:g}s")
