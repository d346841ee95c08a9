"""``trainpod demo``: the main job, end to end on the embedded local cluster.

Creates (or reuses) the cluster of ``examples/cluster.yaml``, trains the GPT example
across two nodes, follows rank 0's log, then shows the job, its events and where to look.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import trainpod
from trainpod.backends.base import backend_for
from trainpod.cli.cluster import wait_for_nodes
from trainpod.cli.jobs import default_env, follow, print_job
from trainpod.cli.render import console, nodes_table
from trainpod.client.http import TrainpodClient
from trainpod.errors import Fatal, NotFound
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec


def examples_dir() -> Path:
    """The repository's examples/ (trainpod is installed from a checkout)."""
    for base in (Path(trainpod.__file__).resolve().parents[2], Path.cwd()):
        if (base / "examples" / "cluster.yaml").exists():
            return base / "examples"
    raise NotFound(
        "cannot find examples/cluster.yaml; run the demo from a trainpod checkout "
        "(git clone ... && ./scripts/demo)"
    )


def _ensure_cluster(spec_path: Path) -> tuple[ClusterPaths, ClusterRecord]:
    spec = load_cluster_spec(spec_path)
    paths = ClusterPaths.of(spec.name)
    backend = backend_for(spec.backend, paths)
    if paths.record.exists():
        started = backend.start()
        console.print(
            f"reusing cluster [bold]{spec.name}[/]"
            + (f" (started {', '.join(started)})" if started else "")
        )
    else:
        console.print(f"creating cluster [bold]{spec.name}[/] from {spec_path}")
        backend.create(spec, spec_path)
    from trainpod.cli.context import set_current

    set_current(spec.name)
    return paths, ClusterRecord.load(paths)


def run_demo(*, steps: int, delete_after: bool) -> None:
    ex = examples_dir()
    t0 = time.time()
    paths, record = _ensure_cluster(ex / "cluster.yaml")
    with TrainpodClient(record.url, read_secret(paths.admin_token)) as client:
        nodes = wait_for_nodes(client, timeout_s=300)
        console.print(nodes_table(nodes))
        bad = [n for n in nodes if n.state == "failed"]
        if bad:
            raise Fatal(f"node {bad[0].name} failed to set up: {bad[0].reason}")
        console.print(
            "[dim]no GPU here: each node's devices are CPU slots standing in for GPUs "
            "(simulated); ranks talk over Gloo[/]"
            if all((n.facts.get("devices") or {}).get("kind") != "cuda" for n in nodes)
            else "[dim]nodes have real GPUs; ranks talk over NCCL[/]"
        )
        spec = JobSpec(
            command=["python", "gpt/train.py", "--steps", str(steps), "--ckpt-every", "50"],
            name="gpt-demo",
            nodes=2,
            procs_per_node=1,
            env=default_env(),
            workdir=str(ex),
        )
        job = client.submit(spec)
        console.print(
            f"\nsubmitted job [bold]{job.id}[/]: a small GPT on the Python standard library's "
            f"source, DDP across 2 nodes, {steps} steps\n"
        )
        follow(client, job.id, rank=0)
        final = client.job(job.id)
        console.print()
        print_job(final)
        _summary(client, record, final.id, time.time() - t0)
        if final.state != "completed":
            raise Fatal(f"the demo job ended {final.state}: {final.reason}")
    if delete_after:
        backend_for(record.backend, paths).delete(purge=True)
        console.print("demo cluster deleted")


def _summary(client: TrainpodClient, record: ClusterRecord, job_id: int, wall_s: float) -> None:
    events = client.events(job_id=job_id)
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    ckpt_dir = Path(record.checkpoint_uri.removeprefix("file://")) / f"job-{job_id}"
    summary = ckpt_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        console.print(
            f"\n[green]trained {s.get('final_step')} steps[/]: final loss "
            f"{s.get('final_loss', 0):.3f}, val loss {s.get('val_loss', 0):.3f}, "
            f"{s.get('tokens_per_s', 0):.0f} tokens/s across {s.get('world_size')} ranks"
        )
    console.print(f"{len(events)} events recorded for the job: {kinds}")
    console.print(f"demo wall time {wall_s:.0f}s\n")
    console.print("[bold]what to look at next[/]")
    for cmd, what in [
        (f"trainpod show {job_id}", "attempts, ranks, exit codes"),
        (f"trainpod events -j {job_id}", "every state change, timestamped"),
        (f"trainpod logs {job_id} --rank 1", "the other node's rank log"),
        ("trainpod nodes", "node states and health facts"),
        ("trainpod cluster describe", "processes, pids, logs, partitions"),
        (f"ls {ckpt_dir}", "the checkpoints the job wrote"),
        (f"trainpod cluster delete {record.name} --purge", "remove the demo cluster"),
    ]:
        console.print(f"  {cmd:<44} {what}")
