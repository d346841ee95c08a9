"""``trainpod demo``: the main job, end to end on the embedded local cluster.

Creates (or reuses) the cluster of ``examples/cluster.yaml``, trains the GPT example
across two nodes with ``--auto-resume``, injects a GPU fault (XID 79 on the simulated GPU)
into one node halfway through, and lets the user watch trainpod detect it, quarantine the
node, take the hot spare, resume from the checkpoint and finish; then shows where every
second went (goodput) and what to look at next.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import trainpod
from trainpod.api.models import ChaosRequest, EventInfo
from trainpod.backends.base import backend_for
from trainpod.cli.cluster import wait_for_nodes
from trainpod.cli.context import set_current
from trainpod.cli.goodput import render as render_goodput
from trainpod.cli.jobs import default_env, follow, print_job
from trainpod.cli.render import console, nodes_table
from trainpod.client.http import TrainpodClient
from trainpod.errors import Fatal, NotFound, TrainpodError
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec
from trainpod.telemetry.goodput import compute_goodput

# Events worth a line of their own while the demo runs, and how to say them.
_STORY = {
    "chaos_injected": "injected {fault} into {node}",
    "fault_detected": "detected {fault} on {nodes}: {reason}",
    "recovery_decision": "decision: {action}: {reason}",
    "attempt_created": "attempt {attempt} starts on {nodes}",
    "first_beacon": "attempt {attempt}: first step ({step}) done",
    "deep_check_finished": "{node}: deep health check {status}: {reason}",
    "node_repaired": "{node} repaired and back in the pool",
}


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
    set_current(spec.name)
    return paths, ClusterRecord.load(paths)


def _say(e: EventInfo) -> str | None:
    template = _STORY.get(e.kind)
    if template is None:
        return None
    data = {"node": e.node, "attempt": e.attempt, **e.data}
    if isinstance(data.get("nodes"), list):
        data["nodes"] = ",".join(str(n) for n in data["nodes"])
    try:
        return template.format(**data)
    except (KeyError, IndexError):
        return f"{e.kind} {e.data}"


class _Narrator(threading.Thread):
    """Prints the recovery story from the event log, and injects the fault halfway."""

    def __init__(self, client: TrainpodClient, job_id: int, steps: int, fault: str | None):
        super().__init__(daemon=True)
        self._client, self._job, self._steps, self._fault = client, job_id, steps, fault
        self.stop = threading.Event()
        self.injected = False

    def run(self) -> None:
        after = 0
        while not self.stop.wait(0.3):
            try:
                self._maybe_inject()
                for e in self._client.events(after=after):
                    after = e.id
                    if e.job_id not in (None, self._job) and e.kind != "node_repaired":
                        continue
                    line = _say(e)
                    if line:
                        console.print(f"[bold magenta][trainpod][/] {line}", highlight=False)
            except TrainpodError:
                continue

    def _maybe_inject(self) -> None:
        if self.injected or self._fault is None:
            return
        job = self._client.job(self._job)
        step = (job.progress or {}).get("last_step") or 0
        if job.state != "running" or step < self._steps // 2:
            return
        victim = job.attempts[-1].nodes[-1]
        self.injected = True
        console.print(
            f"\n[bold magenta][demo][/] halfway (step {step}): pulling the GPU out from under "
            f"{victim} with a simulated XID 79 ('fallen off the bus')\n"
        )
        self._client.chaos(ChaosRequest(node=victim, fault=self._fault))


def run_demo(*, steps: int, delete_after: bool, fault: str | None = "xid79") -> None:
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
            "(a simulated GPU whose faults can be injected); ranks talk over Gloo[/]"
            if all((n.facts.get("devices") or {}).get("kind") != "cuda" for n in nodes)
            else "[dim]nodes have real GPUs; ranks talk over NCCL[/]"
        )
        spec = JobSpec(
            command=["python", "gpt/train.py", "--steps", str(steps), "--ckpt-every", "25"],
            name="gpt-demo",
            nodes=2,
            procs_per_node=1,
            env=default_env(),
            workdir=str(ex),
            auto_resume=True,
        )
        job = client.submit(spec)
        console.print(
            f"\nsubmitted job [bold]{job.id}[/] with --auto-resume: a small GPT on the Python "
            f"standard library's source, DDP across 2 nodes, {steps} steps, a checkpoint "
            "every 25\n"
        )
        narrator = _Narrator(client, job.id, steps, fault)
        narrator.start()
        follow(client, job.id, rank=0)
        time.sleep(0.6)  # let the narrator print the last events
        narrator.stop.set()
        final = client.job(job.id)
        console.print()
        print_job(final)
        console.print()
        render_goodput(compute_goodput(final, client.events(job_id=job.id), time.time()))
        _next_steps(record, final.id, time.time() - t0)
        if final.state != "completed":
            raise Fatal(f"the demo job ended {final.state}: {final.reason}")
    if delete_after:
        backend_for(record.backend, paths).delete(purge=True)
        console.print("demo cluster deleted")


def _next_steps(record: ClusterRecord, job_id: int, wall_s: float) -> None:
    ckpt_dir = Path(record.checkpoint_uri.removeprefix("file://")) / f"job-{job_id}"
    console.print(f"\ndemo wall time {wall_s:.0f}s\n")
    console.print("[bold]what to look at next[/]")
    for cmd, what in [
        (f"trainpod events -j {job_id}", "the whole story, timestamped"),
        (f"trainpod goodput {job_id} --json", "the breakdown above, for machines"),
        (f"trainpod show {job_id}", "attempts, ranks, exit codes"),
        ("trainpod nodes", "the repaired node is back; health facts"),
        (f"trainpod logs {job_id} --rank 1 --attempt 1", "the other rank, first attempt"),
        ("trainpod chaos inject -n workers-0 -f hang", "try another fault"),
        (f"trainpod cluster delete {record.name} --purge", "remove the demo cluster"),
    ]:
        console.print(f"  {cmd:<42} {what}", soft_wrap=True)
    console.print(f"  checkpoints: {ckpt_dir}", soft_wrap=True)
