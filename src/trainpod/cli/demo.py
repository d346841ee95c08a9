"""``trainpod demo``: the main job, end to end on the embedded local cluster.

Creates (or reuses) the cluster of ``examples/cluster.yaml``, trains the GPT example
across two nodes with ``--auto-resume``, injects a GPU fault (XID 79 on the simulated GPU)
into one node halfway through, and lets the user watch trainpod detect it, quarantine the
node, take the hot spare, resume from the checkpoint and finish; then shows where every
second went (goodput) and what to look at next.

The example checkpoints with ``trainpod.Checkpointer``; its rank 0 log says which step it
resumed from and which tier each rank read (``resuming from step N (tier ...)``), and the
narration explains that line. At the end, the losses of the steps both attempts ran are
compared: a resumed run retraces the uninterrupted one exactly.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

import trainpod
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.backends.base import backend_for
from trainpod.cli.cluster import wait_for_nodes
from trainpod.cli.context import set_current
from trainpod.cli.goodput import render as render_goodput
from trainpod.cli.jobs import default_env, follow, print_job
from trainpod.cli.render import console, nodes_table
from trainpod.client.http import TrainpodClient
from trainpod.errors import Fatal, NotFound, TrainpodError
from trainpod.model.events import (
    AttemptCreated,
    AttemptProgress,
    ChaosInjected,
    DeepCheckFinished,
    Event,
    FaultDetected,
    FirstBeacon,
    NodeRepaired,
    RecoveryDecision,
    parse,
)
from trainpod.model.states import JobState, NodeState
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec
from trainpod.telemetry.goodput import compute_goodput
from trainpod.telemetry.tensorboard import tensorboard_dir

# Who speaks: "[...]" is markup to rich, so the brackets are escaped.
_TRAINPOD = "[bold magenta]\\[trainpod][/]"
_DEMO = "[bold magenta]\\[demo][/]"

# What the GPT example prints on resume (examples/gpt/train.py, describe_load), e.g.
# "resuming from step 100 (tier memory, 0.03 s); continuing at step 101" or
# "resuming from step 100 (tiers rank 0 memory+peer, rank 1 peer+durable; 0.54 s); ...".
_RESUMED = re.compile(r"^resuming from step (?P<step>\d+) \((?P<where>.+)[,;] (?P<s>[\d.]+) s\)")
_FELL_BACK = "  fell back: "
_NOTHING_LOADED = "no checkpoint could be loaded"
_STEP = re.compile(r"^step (?P<step>\d+)/\d+ loss (?P<loss>\S+)")
_TIER_MEANS = {
    "memory": "the node's shared memory (it outlives the killed worker)",
    "scratch": "the node's local disk",
    "peer": "the copy each node pushes to the next node's disk",
    "durable": "the shared checkpoint store",
}


@dataclass
class Resume:
    """What an attempt's rank 0 log says about where it started."""

    step: int | None
    """The checkpoint step loaded; None when it started from scratch."""
    tiers: list[str]
    """The tier(s) each rank read, by rank ("memory+peer": some files from each)."""
    seconds: float
    fell_back: list[str]


def parse_resume(lines: list[str]) -> Resume | None:
    """Where a rank 0 log of the example says it started; None until that is complete (the
    resume line and its fallback reasons, followed by another line)."""
    for i, line in enumerate(lines):
        m = _RESUMED.match(line)
        if not (m or line.startswith(_NOTHING_LOADED) or _STEP.match(line)):
            continue
        start = i + 1 if m or not _STEP.match(line) else i
        rest = lines[start:]
        fell = [ln.removeprefix(_FELL_BACK) for ln in rest if ln.startswith(_FELL_BACK)]
        if len(fell) == len(rest) and start != i:  # the reasons may go on
            return None
        if m is None:
            return Resume(None, [], 0.0, fell)
        where = m.group("where")
        if where.startswith("tier "):
            tiers = [where.removeprefix("tier ")]
        else:  # "tiers rank 0 memory+peer, rank 1 peer+durable"
            tiers = [part.split()[-1] for part in where.removeprefix("tiers ").split(", ")]
        return Resume(int(m.group("step")), tiers, float(m.group("s")), fell)
    return None


def logged_losses(text: str) -> dict[int, str]:
    """step -> loss as printed, from a rank 0 log of the example."""
    return {int(m.group("step")): m.group("loss") for m in map(_STEP.match, text.splitlines()) if m}


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


def _say(event: Event) -> str | None:
    """The events worth a line of their own while the demo runs, and how to say them."""
    match event:
        case ChaosInjected():
            return f"injected {event.fault} into {event.node}"
        case FaultDetected():
            return f"detected {event.cause} on {','.join(event.nodes)}: {event.reason}"
        case RecoveryDecision():
            return f"decision: {event.action}: {event.reason}"
        case AttemptCreated():
            return f"attempt {event.attempt} starts on {','.join(event.nodes)}"
        case FirstBeacon():
            return f"attempt {event.attempt}: first progress beacon (step {event.step})"
        case DeepCheckFinished():
            return f"{event.node}: deep health check {event.status}: {event.reason}"
        case NodeRepaired():
            return f"{event.node} repaired and back in the pool"
    return None


class _Narrator(threading.Thread):
    """Prints the recovery story from the event log and the training log, and injects the
    fault halfway."""

    def __init__(self, client: TrainpodClient, job_id: int, steps: int, fault: str | None):
        super().__init__(daemon=True)
        self._client, self._job, self._steps, self._fault = client, job_id, steps, fault
        self.stop = threading.Event()
        self.injected = False
        self._last_step: dict[int, int] = {}  # attempt -> last step every rank finished
        self._logs: dict[int, tuple[int, str]] = {}  # restarted attempt -> (offset, text)

    def run(self) -> None:
        after = 0
        while not self.stop.wait(0.3):
            try:
                self._maybe_inject()
                for info in self._client.events(after=after):
                    after = info.id
                    e = parse(info)
                    if info.job_id not in (None, self._job) and not isinstance(e, NodeRepaired):
                        continue
                    if isinstance(e, AttemptProgress) and e.last_step is not None:
                        self._last_step[e.attempt] = e.last_step
                    if isinstance(e, AttemptCreated) and e.attempt > 1:
                        self._logs[e.attempt] = (0, "")
                    line = _say(e)
                    if line:
                        _tell(line)
                self._watch_resumes()
            except TrainpodError:
                continue

    def _maybe_inject(self) -> None:
        if self.injected or self._fault is None:
            return
        job = self._client.job(self._job)
        step = (job.progress or {}).get("last_step") or 0
        if job.state != JobState.RUNNING or step < self._steps // 2:
            return
        victim = job.attempts[-1].nodes[-1]
        self.injected = True
        console.print(
            f"\n{_DEMO} halfway (step {step}): pulling the GPU out from under "
            f"{victim} with a simulated XID 79 ('fallen off the bus')\n"
        )
        self._client.chaos(ChaosRequest(node=victim, fault=self._fault))

    def _watch_resumes(self) -> None:
        """Read each restarted attempt's rank 0 log until it says where it resumed from."""
        for attempt, (offset, text) in list(self._logs.items()):
            chunk = self._client.logs(self._job, rank=0, attempt=attempt, offset=offset)
            if chunk.attempt != attempt:  # its log does not exist yet
                continue
            text += chunk.data
            self._logs[attempt] = (chunk.offset, text)
            resume = parse_resume(text.split("\n")[:-1])  # whole lines only
            if resume is None:
                continue
            del self._logs[attempt]
            for line in self._resume_story(attempt, resume):
                _tell(line)

    def _resume_story(self, attempt: int, r: Resume) -> list[str]:
        fell = (
            f"; it fell back {len(r.fell_back)} time(s), first: {r.fell_back[0]}"
            if r.fell_back
            else ""
        )
        if r.step is None:
            return [f"attempt {attempt} found no checkpoint it could load: starting over{fell}"]
        job = self._client.job(self._job)
        ranks = next((a.ranks for a in job.attempts if a.number == attempt), [])
        node = {x.rank: x.node for x in ranks}
        tiers = r.tiers if len(r.tiers) > 1 else [r.tiers[0]] * max(1, len(node))
        who = ", ".join(f"rank {i} on {node.get(i, '?')} from {t}" for i, t in enumerate(tiers))
        lines = [
            f"attempt {attempt} resumed from the step-{r.step} checkpoint in {r.seconds:.2f} s: "
            f"{who}{fell}"
        ]
        used = [t for t in _TIER_MEANS if any(t in x.split("+") for x in tiers)]
        lines.append("  " + "; ".join(f"{t}: {_TIER_MEANS[t]}" for t in used))
        before = self._last_step.get(attempt - 1)
        if before is not None and before > r.step:
            lines.append(
                f"  steps {r.step + 1}-{before}, done by attempt {attempt - 1} after that "
                "checkpoint, are done again"
            )
        return lines


def _tell(line: str) -> None:
    console.print(f"{_TRAINPOD} {escape(line)}", highlight=False)


def _read_log(client: TrainpodClient, job_id: int, attempt: int) -> str:
    text, offset = "", 0
    while True:
        chunk = client.logs(job_id, rank=0, attempt=attempt, offset=offset)
        if not chunk.data or chunk.attempt != attempt:
            return text
        text, offset = text + chunk.data, chunk.offset


def _same_numbers(client: TrainpodClient, job: JobInfo) -> None:
    """Compare the losses logged for the steps that more than one attempt ran."""
    if len(job.attempts) < 2:
        return
    runs = {a.number: logged_losses(_read_log(client, job.id, a.number)) for a in job.attempts}
    final = runs[job.attempts[-1].number]
    pairs = [
        (step, loss, final[step])
        for n, losses in runs.items()
        if n != job.attempts[-1].number
        for step, loss in sorted(losses.items())
        if step in final
    ]
    if not pairs:
        console.print(
            f"{_DEMO} no step was logged by more than one attempt, so none to compare "
            "(for an uninterrupted run's losses: trainpod demo --fault none)"
        )
        return
    same = all(a == b for _, a, b in pairs)
    shown = ", ".join(f"step {s} {a} then {b}" for s, a, b in pairs[:4])
    verdict = (
        "identical: the restored model, optimizer and data position retrace the uninterrupted run"
        if same
        else "DIFFERENT: the resume did not restore everything"
    )
    console.print(f"{_DEMO} steps run twice: {shown}: {verdict}", highlight=False)


def run_demo(*, steps: int, delete_after: bool, fault: str | None = "xid79") -> None:
    ex = examples_dir()
    t0 = time.time()
    paths, record = _ensure_cluster(ex / "cluster.yaml")
    with TrainpodClient.for_record(record, read_secret(paths.admin_token)) as client:
        nodes = wait_for_nodes(client, timeout_s=300)
        console.print(nodes_table(nodes))
        bad = [n for n in nodes if n.state == NodeState.FAILED]
        if bad:
            raise Fatal(f"node {bad[0].name} failed to set up: {bad[0].reason}")
        console.print(
            "[dim]no GPU here: each node's devices are CPU slots standing in for GPUs "
            "(a simulated GPU whose faults can be injected); ranks talk over Gloo[/]"
            if all((n.facts.get("devices") or {}).get("kind") != "cuda" for n in nodes)
            else "[dim]nodes have real GPUs; ranks talk over NCCL[/]"
        )
        spec = JobSpec(
            command=["python", "gpt/train.py", "--steps", str(steps), "--ckpt-every", "auto"],
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
            f"standard library's source, DDP across 2 nodes, {steps} steps, checkpoints at "
            "the interval the costs call for (Young/Daly: sqrt(2 x the save's measured stall "
            "x the failure rate trainpod has seen))\n"
        )
        narrator = _Narrator(client, job.id, steps, fault)
        narrator.start()
        follow(client, job.id, rank=0)
        time.sleep(0.6)  # let the narrator print the last events
        narrator.stop.set()
        final = client.job(job.id)
        _same_numbers(client, final)
        console.print()
        print_job(final)
        console.print()
        render_goodput(compute_goodput(final, client.events(job_id=job.id), time.time()))
        _next_steps(record, final.id, time.time() - t0)
        if final.state != JobState.COMPLETED:
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
    console.print()
    for line in where_to_look(record, job_id):
        console.print(line, soft_wrap=True, highlight=False)


def where_to_look(record: ClusterRecord, job_id: int) -> list[str]:
    """The demo's last lines: the dashboard, the Prometheus endpoint, the job's TensorBoard."""
    logdir = tensorboard_dir(Path(record.shared_dir), job_id)
    return [
        "[bold]where to look[/]",
        f"  dashboard    {record.url}/ui",
        f"  Prometheus   {record.url}/metrics",
        f"  TensorBoard  trainpod tensorboard {job_id}  (loss, step rate, goodput; {logdir})",
    ]
