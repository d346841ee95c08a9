"""The agent's persister: the decentralised durable commit of two nodes' parts, the persister
process's protocol, and the agent's hand-off hub (spawn, status, reports, clean-up)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainpod.agent.agent import memory_to_release
from trainpod.agent.persisters import CheckpointHub, scratch_kept_because, sweep_memory_tiers
from trainpod.ckpt import persist
from trainpod.ckpt.fakes import FlakyFileSystem
from trainpod.ckpt.fullness import same_device
from trainpod.ckpt.handoff import AgentLink, PersistStatus, TierConfig
from trainpod.ckpt.manifest import METADATA, FileEntry, Manifest, digest_of
from trainpod.ckpt.parts import part_path
from trainpod.ckpt.persist import Persister
from trainpod.ckpt.persistwire import Request, StatusReport, parse_line, parse_request
from trainpod.ckpt.tiers import FsTier, step_name
from trainpod.testing.wait import wait_until

STEP = 5
NODES = ("n0", "n1")


def _entry(name: str, data: bytes, rank: int | None, node: str) -> FileEntry:
    return FileEntry(name, len(data), digest_of(data), rank, node)


def make_memory(
    root: Path, step: int = STEP, nodes: tuple[str, ...] = NODES, created: float = 1234.5
) -> Manifest:
    """Each node's memory tier holds its rank's file, .metadata and the same manifest."""
    data = {n: f"shard of {n} at {step} ".encode() * 100 for n in nodes}
    meta = f"metadata {step}".encode()
    files = [_entry(f"__{r}_0.distcp", data[n], r, n) for r, n in enumerate(nodes)]
    files.append(_entry(METADATA, meta, None, nodes[0]))
    m = Manifest(step, len(nodes), nodes, tuple(files), "job-x", 1, created=created)
    for r, n in enumerate(nodes):
        d = root / n / step_name(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"__{r}_0.distcp").write_bytes(data[n])
        (d / METADATA).write_bytes(meta)
        (d / "manifest.json").write_bytes(m.to_json())
    return m


def request(root: Path, node: str, step: int = STEP, **cfg: Any) -> Request:
    config = TierConfig(
        node=node, memory=str(root / "mem" / node), durable=str(root / "durable"), **cfg
    )
    return Request(step=step, config=config, job_id=7, attempt_id=3, retry_base_s=0.01)


def persister(root: Path, node: str, events: list[dict[str, Any]]) -> Persister:
    return Persister(node, events.append, staging=root / "staging" / node, poll_s=(0.01, 0.02))


def durable_manifest(root: Path, step: int = STEP) -> Path:
    return root / "durable" / step_name(step) / "manifest.json"


@pytest.mark.parametrize("order", [NODES, tuple(reversed(NODES))])
def test_durable_commits_once_every_nodes_part_is_in_either_order(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    m = make_memory(tmp_path / "mem")
    events: dict[str, list[dict[str, Any]]] = {n: [] for n in NODES}
    p = {n: persister(tmp_path, n, events[n]) for n in NODES}
    first, second = order
    assert p[first].round(request(tmp_path, first)) == "waiting"
    assert not durable_manifest(tmp_path).exists()  # one part is not a checkpoint
    assert p[first].status().done_through is None
    assert p[second].round(request(tmp_path, second)) == "done"
    # The manifest has the bytes of every node's memory manifest.
    assert durable_manifest(tmp_path).read_bytes() == m.to_json()
    assert (tmp_path / "durable" / "latest").read_text() == f"{STEP}\n"
    assert p[first].poll_waiting() and p[first].status().done_through == STEP
    done = [e for e in events[second] if e["event"] == "committed"]
    assert [(e["tier"], e["step"], e["wrote_manifest"]) for e in done] == [("durable", STEP, True)]
    assert done[0]["job_id"] == 7 and done[0]["attempt_id"] == 3
    # .metadata was written by one node only (the one the manifest names).
    names = sorted(p.name for p in (tmp_path / "durable" / step_name(STEP)).iterdir())
    assert names == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "parts"])
    assert not list((tmp_path / "staging").rglob("*.distcp"))  # hard links released


def test_a_missing_part_means_no_manifest(tmp_path: Path) -> None:
    make_memory(tmp_path / "mem")
    p0 = persister(tmp_path, "n0", [])
    assert p0.round(request(tmp_path, "n0")) == "waiting"
    for _ in range(3):
        assert not p0.poll_waiting()
    assert not durable_manifest(tmp_path).exists()
    assert p0.status().waiting_step == STEP


@pytest.mark.parametrize("marker", [b'{"format": "trainpod-ckpt-part/1", "no', b"", "foreign"])
def test_a_torn_or_foreign_part_marker_is_not_a_part(tmp_path: Path, marker: Any) -> None:
    make_memory(tmp_path / "mem")
    durable = FsTier("durable", tmp_path / "durable")
    path = Path(part_path(durable, STEP, "n1"))
    path.parent.mkdir(parents=True)
    if marker == "foreign":  # another attempt's checkpoint of the same step
        body = {"format": "trainpod-ckpt-part/1", "node": "n1", "step": STEP, "manifest": "ab"}
        marker = json.dumps(body).encode()
    path.write_bytes(marker)
    p0 = persister(tmp_path, "n0", [])
    assert p0.round(request(tmp_path, "n0")) == "waiting"
    assert not p0.poll_waiting() and not durable_manifest(tmp_path).exists()
    # The real part arrives: committed.
    assert persister(tmp_path, "n1", []).round(request(tmp_path, "n1")) == "done"
    assert durable_manifest(tmp_path).exists()


def test_a_waiting_node_commits_when_the_last_writer_died_before_the_manifest(
    tmp_path: Path,
) -> None:
    m = make_memory(tmp_path / "mem")
    p0 = persister(tmp_path, "n0", [])
    assert p0.round(request(tmp_path, "n0")) == "waiting"
    # n1 uploaded its part and its marker, then died before writing the manifest.
    from trainpod.ckpt.parts import write_part
    from trainpod.ckpt.tiers import Meter

    durable = FsTier("durable", tmp_path / "durable")
    durable.put(STEP, tmp_path / "mem" / "n1" / step_name(STEP), ["__1_0.distcp"], Meter())
    write_part(durable, m, "n1")
    assert p0.poll_waiting()
    assert durable_manifest(tmp_path).read_bytes() == m.to_json()


def test_node_tiers_commit_locally_and_keep_k(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    p0 = persister(tmp_path, "n0", events)
    for step in (1, 2, 3):
        make_memory(tmp_path / "mem", step=step, nodes=("n0",))
        req = request(tmp_path, "n0", step, scratch=str(tmp_path / "scratch"), keep={"scratch": 2})
        assert p0.round(req) == "done"
    scratch = sorted(p.name for p in (tmp_path / "scratch").iterdir() if p.name.startswith("step"))
    assert scratch == [step_name(2), step_name(3)]
    assert p0.status().committed == {"scratch": 3, "durable": 3}
    commits = [(e["step"], e["tier"]) for e in events if e["event"] == "committed"]
    assert sorted(commits) == [(s, t) for s in (1, 2, 3) for t in ("durable", "scratch")]
    assert [s for s, _ in commits] == sorted(s for s, _ in commits), "step by step"


def test_tiers_on_one_disk_share_a_device_and_a_store_that_is_not_a_path_does_not(
    tmp_path: Path,
) -> None:
    scratch = FsTier("scratch", tmp_path / "scratch" / "not" / "made", node="n0")
    durable = FsTier("durable", tmp_path / "durable")
    shm = FsTier("memory", "/dev/shm/trainpod-none", node="n0")
    flaky = FsTier("durable", "/bucket", fs=FlakyFileSystem())
    assert same_device(scratch, durable)
    assert same_device(shm, durable) == (os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev)
    assert not same_device(scratch, flaky)


def test_scratch_and_durable_on_two_devices_are_copied_at_the_same_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scratch copy waits inside its put for the durable commit: one after the other (as
    on one disk, where that order is better) it would wait for ever (here: fail after 20 s);
    beside each other, both commit."""
    make_memory(tmp_path / "mem", nodes=("n0",))
    put = FsTier.put

    def gated(self: FsTier, step: int, src: Path, names: Any, meter: Any) -> None:
        if self.name == "scratch":
            try:
                wait_until(durable_manifest(tmp_path).exists, timeout_s=20, interval_s=0.01)
            except Exception as exc:  # one after the other: scratch fails, is skipped
                raise OSError(f"durable did not commit while scratch was copied: {exc}") from exc
        put(self, step, src, names, meter)

    monkeypatch.setattr(FsTier, "put", gated)
    monkeypatch.setattr(persist, "same_device", lambda a, b: False)  # as scratch and NFS
    events: list[dict[str, Any]] = []
    p0 = persister(tmp_path, "n0", events)
    req = request(tmp_path, "n0", scratch=str(tmp_path / "scratch"))
    assert p0.round(req) == "done"
    assert p0.status().committed == {"scratch": STEP, "durable": STEP}
    assert [e["tier"] for e in events if e["event"] == "committed"] == ["durable", "scratch"]


def test_an_unreachable_durable_store_is_retried_and_a_full_scratch_skipped(
    tmp_path: Path,
) -> None:
    make_memory(tmp_path / "mem", nodes=("n0",))
    (tmp_path / "durable").write_text("a file where a directory should be")
    events: list[dict[str, Any]] = []
    p0 = persister(tmp_path, "n0", events)
    req = request(tmp_path, "n0", scratch="/proc/no-such-dir/scratch")
    assert p0.round(req) == "retry"
    st = p0.status()
    assert set(st.errors) == {"scratch", "durable"} and st.retry_in_s is not None
    assert {e["tier"] for e in events if e["event"] == "failed"} == {"scratch", "durable"}
    (tmp_path / "durable").unlink()
    assert p0.round(req) == "done"  # scratch is not tried again for this step
    assert p0.status().committed == {"scratch": None, "durable": STEP}


def test_a_later_attempt_that_resumes_from_an_older_step_is_persisted_again(
    tmp_path: Path,
) -> None:
    p0 = persister(tmp_path, "n0", [])
    for step in (1, 2, 3):
        make_memory(tmp_path / "mem", step=step, nodes=("n0",))
        p0.offer(request(tmp_path, "n0", step))
    p0.finish()
    p0.run(finish_timeout_s=30)  # only the newest step is copied
    assert p0.status().done_through == 3 and not durable_manifest(tmp_path, 2).exists()
    again = make_memory(tmp_path / "mem", step=2, nodes=("n0",), created=99.0)
    p0.offer(dataclasses.replace(request(tmp_path, "n0", 2), attempt_id=4))
    p0.run(finish_timeout_s=30)
    assert durable_manifest(tmp_path, 2).read_bytes() == again.to_json()
    assert p0.status().done_through == 2


def test_only_steps_flagged_by_the_workers_go_to_durable_until_the_job_ends(
    tmp_path: Path,
) -> None:
    """Every node uploads the same steps: those the workers flagged together, and the newest
    one when the job ends (each node's own "newest" could differ, and parts never meet)."""
    import threading

    p = {n: persister(tmp_path, n, []) for n in NODES}
    threads = [threading.Thread(target=p[n].run, kwargs={"finish_timeout_s": 30}) for n in NODES]
    for t in threads:
        t.start()
    try:
        for step, durable in ((1, True), (2, False), (3, False)):
            make_memory(tmp_path / "mem", step=step)
            for n in NODES:
                req = request(tmp_path, n, step, scratch=str(tmp_path / "scratch" / n))
                p[n].offer(dataclasses.replace(req, durable=durable))

            def in_scratch(s: int = step) -> bool:
                return all(p[n].status().committed.get("scratch") == s for n in NODES)

            wait_until(in_scratch, timeout_s=30, what=f"step {step} in scratch")
        assert durable_manifest(tmp_path, 1).exists()
        assert not durable_manifest(tmp_path, 3).exists()
        st = p["n0"].status()
        assert st.done_through == 1 and st.flagged == 1 and not st.global_busy
    finally:
        for n in NODES:
            p[n].finish()  # the job ended: the newest step goes everywhere
        for t in threads:
            t.join(60)
    assert durable_manifest(tmp_path, 3).exists() and not durable_manifest(tmp_path, 2).exists()
    # The node whose part came last committed it; the other may have left before seeing it.
    assert max(p[n].status().done_through or -1 for n in NODES) == 3


def test_a_busy_persister_skips_to_the_newest_step_and_counts_the_rest(tmp_path: Path) -> None:
    """Steps 2-5 are committed in memory while the persister is still on step 1: it then
    copies 5 (the newest) to scratch and durable, never 2-4, and says so. The steps are
    not flagged for durable (the workers' persister was busy), yet a node that holds the
    whole checkpoint takes the newest one whenever it is free."""
    events: list[dict[str, Any]] = []
    in_round, release = threading.Event(), threading.Event()

    def emit(msg: dict[str, Any]) -> None:
        events.append(msg)
        if msg.get("event") == "committed" and msg["step"] == 1 and msg["tier"] == "scratch":
            in_round.set()  # the persister's own thread, in the middle of step 1's round
            assert release.wait(30)

    p0 = Persister("n0", emit, staging=tmp_path / "staging" / "n0", poll_s=(0.01, 0.02))
    scratch = str(tmp_path / "scratch")
    for step in range(1, 6):
        make_memory(tmp_path / "mem", step=step, nodes=("n0",))
    runner = threading.Thread(target=p0.run, kwargs={"finish_timeout_s": 30})
    p0.offer(request(tmp_path, "n0", 1, scratch=scratch))
    runner.start()
    try:
        assert in_round.wait(30)
        for step in range(2, 6):
            p0.offer(
                dataclasses.replace(request(tmp_path, "n0", step, scratch=scratch), durable=False)
            )
    finally:
        release.set()
    wait_until(lambda: p0.status().done_through == 5, timeout_s=30, what="step 5 persisted")
    p0.finish()
    runner.join(30)
    done = [(e["tier"], e["step"], e["skipped"]) for e in events if e["event"] == "committed"]
    # one device here: durable first, then scratch (ADR 0051)
    assert done == [
        ("durable", 1, 0), ("scratch", 1, 0), ("durable", 5, 3), ("scratch", 5, 3)
    ]  # fmt: skip
    assert durable_manifest(tmp_path, 5).exists()
    assert not any(durable_manifest(tmp_path, s).exists() for s in (2, 3, 4))
    st = p0.status()
    assert st.steps_skipped == {"scratch": 3, "durable": 3}
    assert st.committed == {"scratch": 5, "durable": 5}


def test_a_two_node_job_still_uploads_only_flagged_steps(tmp_path: Path) -> None:
    """Without the workers' flag, nodes might each take a different "newest" step: a node
    that holds only its part leaves unflagged steps to the flag (0009)."""
    make_memory(tmp_path / "mem", step=1)
    p0 = persister(tmp_path, "n0", [])
    assert p0.round(request(tmp_path, "n0", 1)) == "waiting"
    make_memory(tmp_path / "mem", step=2)
    p0.offer(dataclasses.replace(request(tmp_path, "n0", 2), durable=False))
    assert p0.status().flagged == 1


# -- the wire ------------------------------------------------------------------------------
BUSY = PersistStatus(
    received=4, flagged=3, done_through=2, global_busy=True,
    committed={"scratch": 4, "durable": None}, errors={"durable": "step 3: OSError: no route"},
    copying_step=3, copying_tier="durable", bytes_done=10, bytes_total=30, rate_bps=2.5,
    retry_in_s=None, waiting_step=None, pid=42,
)  # fmt: skip


def test_a_status_reads_back_the_same_at_the_agent_and_at_the_worker() -> None:
    line = json.dumps({"event": "status", "status": BUSY.to_dict()})
    at_agent = parse_line(line)  # pydantic, over the dataclass
    assert isinstance(at_agent, StatusReport) and at_agent.status == BUSY
    at_worker = PersistStatus.from_dict(json.loads(json.dumps(at_agent.status.to_dict())))
    assert at_worker == BUSY  # plain Python: the worker does not import pydantic
    assert PersistStatus.from_dict({}) == PersistStatus()  # the agent's "none yet"
    assert PersistStatus.from_dict({**BUSY.to_dict(), "new_field": 1}) == BUSY
    assert PersistStatus.from_dict({"rate_bps": 3}).rate_bps == 3.0


def test_the_workers_status_parser_checks_every_field() -> None:
    from trainpod.ckpt import handoff

    names = {f.name for f in dataclasses.fields(PersistStatus)}
    assert set(handoff._STATUS_RULES) == names
    wrong: list[tuple[str, object]] = [
        ("done_through", "2"), ("global_busy", 1), ("bytes_done", True),
        ("committed", {"durable": "3"}), ("errors", {"x": 1}), ("rate_bps", None),
    ]  # fmt: skip
    for key, bad in wrong:
        with pytest.raises(ValueError, match=key):
            PersistStatus.from_dict({**BUSY.to_dict(), key: bad})


def test_the_workers_side_of_the_wire_does_not_import_pydantic() -> None:
    code = (
        "import sys, trainpod.ckpt.checkpointer, trainpod.ckpt.pipeline, trainpod.ckpt.handoff;"
        "print(sorted(m for m in ('pydantic', 'trainpod.ckpt.persist', 'trainpod.ckpt.persistwire')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_malformed_hand_off_is_refused_with_the_field_that_is_wrong(tmp_path: Path) -> None:
    tiers = request(tmp_path, "n0").config.to_dict()
    good = {"op": "persist", "v": 1, "step": 3, "job_id": 7, "attempt_id": None, "stall_s": 0.5,
            "bytes": 10, "durable": False, "tiers": tiers}  # fmt: skip
    req = parse_request(json.dumps(good))
    assert (req.step, req.job_id, req.durable, req.stall_s, req.nbytes) == (3, 7, False, 0.5, 10)
    assert req.config == request(tmp_path, "n0").config
    cases: list[tuple[dict[str, object], str]] = [
        ({"step": -1}, "non-negative"),
        ({"step": True}, "step"),
        ({"retry_base_s": 0}, "positive"),
        ({"tiers": None}, "tiers"),
        ({"tiers": {**tiers, "node": ""}}, "node"),
        ({"tiers": {**tiers, "keep": {"durable": 1.5}}}, "keep"),
        ({"tiers": {**tiers, "peer_holder": "n1"}}, "peer_roots"),
    ]
    for bad, why in cases:
        with pytest.raises(ValueError, match=why):
            parse_request(json.dumps({**good, **bad}))


# -- the process and the hub ------------------------------------------------------------
def _run_persister(tmp_path: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    done = subprocess.run(
        [sys.executable, "-m", "trainpod.ckpt.persist", "--job-key", "job-x", "--node", "n0",
         "--staging", str(tmp_path / "mem" / ".persist-n0"), "--finish-timeout-s", "30"],
        input=stdin, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_persister_process_finishes_the_newest_step_on_eof(tmp_path: Path) -> None:
    for step in (1, 2):
        make_memory(tmp_path / "mem", step=step, nodes=("n0",))
    reqs = []
    for step in (1, 2):
        req = request(tmp_path, "n0", step)
        reqs.append({"op": "persist", "step": step, "tiers": req.config.to_dict(), "job_id": 7})
    out = _run_persister(tmp_path, reqs)
    assert "started" in [o["event"] for o in out] and out[-1]["event"] == "exited"
    assert out[-1]["status"]["done_through"] == 2
    assert durable_manifest(tmp_path, 2).exists()
    assert not (tmp_path / "mem" / ".persist-n0").exists()


@pytest.fixture
def shm_job() -> Iterator[str]:
    key = f"job-t{uuid.uuid4().hex[:8]}"
    yield key
    shutil.rmtree(Path("/dev/shm/trainpod") / key, ignore_errors=True)


def test_the_hub_persists_reports_and_cleans_up_when_the_job_ends(
    tmp_path: Path, shm_job: str
) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    shm = Path("/dev/shm/trainpod") / shm_job
    m = make_memory(shm, nodes=("n0",))
    sock = Path(tempfile.mkdtemp(prefix="tph-", dir="/tmp")) / "c.sock"
    hub = CheckpointHub(sock, log_dir=tmp_path / "logs", state_file=tmp_path / "state.json")
    try:
        link = AgentLink(str(sock))
        assert link.status(shm_job, "n0") == PersistStatus()  # none yet
        config = TierConfig(node="n0", memory=str(shm / "n0"), durable=str(tmp_path / "durable"))
        msg = {"op": "persist", "job_key": shm_job, "node": "n0", "step": STEP, "job_id": 7,
               "attempt_id": 3, "stall_s": 0.25, "bytes": m.total_bytes(),
               "tiers": config.to_dict()}  # fmt: skip
        assert link.request(msg) == {"ok": True}
        assert link.request(msg) == {"ok": True}  # idempotent

        def persisted() -> bool:
            st = link.status(shm_job, "n0")
            return st is not None and st.done_through == STEP

        wait_until(
            persisted,
            timeout_s=30,
            what="the persister to commit the step",
        )
        reports = hub.reports()
        saved = [r for r in reports if r.saved]
        assert len(saved) == 1 and saved[0].stall_s == 0.25 and saved[0].tier == "memory"
        committed = [r for r in reports if r.ok and not r.saved]
        assert [(r.tier, r.scope, r.step, r.job_id) for r in committed] == [
            ("durable", "job", STEP, 7)
        ]
        hub.delivered(reports)
        assert hub.reports() == []
        assert hub.uploads()[0].committed == {"durable": STEP}
        assert json.loads((tmp_path / "state.json").read_text()) == {"7": [str(shm / "n0")]}
        hub.retain({8})  # job 7 ended
        assert hub.wait_idle(30)
        assert not shm.exists()
        assert json.loads((tmp_path / "state.json").read_text()) == {}
        refused = link.request(msg)  # a late hand-off of an ended job starts nothing
        assert refused is not None and not refused["ok"]
    finally:
        hub.close()
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_a_restarted_agent_cleans_up_after_the_jobs_its_predecessor_knew(
    tmp_path: Path, shm_job: str
) -> None:
    shm = Path("/dev/shm/trainpod") / shm_job
    make_memory(shm, nodes=("n0",))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"7": [str(shm / "n0")], "9": ["/etc"]}))
    sock = Path(tempfile.mkdtemp(prefix="tph-", dir="/tmp")) / "c.sock"
    hub = CheckpointHub(sock, log_dir=tmp_path / "logs", state_file=state)
    try:
        hub.retain({9})
        assert not shm.exists() and Path("/etc").is_dir()
        assert json.loads(state.read_text()) == {"9": ["/etc"]}
        hub.retain(set())
        assert Path("/etc").is_dir()  # never removes anything outside a memory tier
    finally:
        hub.close()
        shutil.rmtree(sock.parent, ignore_errors=True)
    assert os.path.exists("/etc")


@pytest.mark.parametrize(
    ("allocation", "preempted", "removes"),
    [
        # Slurm ends the allocation (time limit, scancel, a requeue, the job's end): the
        # node goes back to Slurm, and no agent of the cluster may ever come back to it.
        ({"allocation": 3, "allocation_round": 0}, False, {3}),
        # Slurm preempts it: the requeued job may land here again and load from memory.
        ({"allocation": 3, "allocation_round": 1}, True, set()),
        # Outside Slurm: a restarted agent finds them; orders say when their jobs end.
        ({}, False, set()),
    ],
)
def test_an_allocations_agent_takes_its_jobs_memory_tier_with_it_unless_preempted(
    allocation: dict[str, int], preempted: bool, removes: set[int]
) -> None:
    assert memory_to_release(allocation, preempted) == removes


def test_an_ending_allocation_removes_its_own_jobs_tier_and_keeps_a_preempted_ones(
    tmp_path: Path, shm_job: str
) -> None:
    """Job 2's agent ends on a node where preempted job 1 waits for its next allocation
    (both known from the node's state file; job 2 made only its job dir, as a
    Checkpointer does before its first save, and never handed a step over)."""
    one, two = Path("/dev/shm/trainpod") / shm_job, Path("/dev/shm/trainpod") / f"{shm_job}b"
    make_memory(one, nodes=("n0",))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"1": [str(one / "n0")]}))
    sock = Path(tempfile.mkdtemp(prefix="tph-", dir="/tmp")) / "c.sock"
    hub = CheckpointHub(sock, log_dir=tmp_path / "logs", state_file=state)
    try:
        hub.retain({1, 2})
        two.mkdir(mode=0o700)
        hub.expect(2, two / "n0")
        hub.expect(2, Path("/etc/n0"))  # never outside a memory base
        assert json.loads(state.read_text()) == {"1": [str(one / "n0")], "2": [str(two / "n0")]}
        hub.end({2})
        assert hub.wait_idle(30)
        assert not two.exists() and (one / "n0").is_dir()
        assert json.loads(state.read_text()) == {"1": [str(one / "n0")]}
    finally:
        hub.close()
        shutil.rmtree(sock.parent, ignore_errors=True)
        shutil.rmtree(two, ignore_errors=True)


def test_cluster_delete_sweeps_the_memory_tiers_an_agents_state_file_still_lists(
    tmp_path: Path, shm_job: str
) -> None:
    shm = Path("/dev/shm/trainpod") / shm_job
    make_memory(shm, nodes=("n0", "n1"))
    (shm / ".persist-n0").mkdir()
    (shm / ".persist-n0.lock").touch()
    elsewhere = tmp_path / "trainpod" / shm_job / "n0"  # the right shape, not a memory base
    elsewhere.mkdir(parents=True)
    state = tmp_path / "checkpoints.json"
    listed = [str(shm / "n0"), str(shm / "gone"), str(elsewhere), "/etc", str(shm)]
    state.write_text(json.dumps({"7": listed}))
    assert sweep_memory_tiers(state) == [shm / "n0"]
    assert not (shm / "n0").exists() and not (shm / ".persist-n0").exists()
    assert not (shm / ".persist-n0.lock").exists()
    assert (shm / "n1").is_dir()  # another node's share: not listed here
    assert elsewhere.is_dir() and Path("/etc").is_dir()
    assert sweep_memory_tiers(state) == []  # idempotent
    assert sweep_memory_tiers(tmp_path / "none.json") == []


# -- the worker's side: a Checkpointer that hands its copies to the agent ------------------
@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CheckpointHub]:
    for var in [v for v in os.environ if v.startswith("TRAINPOD_")]:
        monkeypatch.delenv(var)
    sock = Path(tempfile.mkdtemp(prefix="tph-", dir="/tmp")) / "c.sock"
    h = CheckpointHub(sock, log_dir=tmp_path / "logs", nice=0)
    monkeypatch.setenv("TRAINPOD_CKPT_SOCKET", str(sock))
    yield h
    h.close()
    shutil.rmtree(sock.parent, ignore_errors=True)


def test_a_checkpointer_under_an_agent_only_writes_memory_and_reads_back_the_rest(
    tmp_path: Path, hub: CheckpointHub
) -> None:
    import torch

    from trainpod.ckpt import Checkpointer

    def make(**kw: Any) -> Checkpointer:
        return Checkpointer(
            tmp_path / "durable", memory=tmp_path / "shm", scratch_dir=tmp_path / "scratch", **kw
        )

    with make(every=1, retry_base_s=0.05) as ck:
        assert ck.agent is not None and ck._pipe.copies == []  # no copier in this process
        for step in (1, 2):
            ck.save(step, {"w": torch.full((64,), float(step))})
        assert ck.wait(30)
        p = ck.progress()
        assert p.committed == {"memory": 2, "scratch": 2, "durable": 2} and p.errors == {}
    assert (tmp_path / "durable" / step_name(2) / "manifest.json").exists()
    with make(agent=False) as ck2:  # any process reads what the agent wrote
        state = {"w": torch.zeros(64)}
        shutil.rmtree(tmp_path / "shm")
        assert ck2.load_latest(state) == 2 and ck2.last_load is not None
        assert ck2.last_load.tier == "scratch" and float(state["w"][0]) == 2.0


def test_without_an_answering_agent_the_copies_run_in_process(
    tmp_path: Path, hub: CheckpointHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainpod.ckpt import Checkpointer
    from trainpod.ckpt.errors import CheckpointConfigError

    monkeypatch.setenv("TRAINPOD_CKPT_SOCKET", str(tmp_path / "nobody.sock"))
    with Checkpointer(tmp_path / "durable", memory=tmp_path / "shm") as ck:
        assert ck.agent is None and [t.name for t in ck._pipe.copies] == ["durable"]
    with pytest.raises(CheckpointConfigError, match="does not answer"):
        Checkpointer(tmp_path / "durable", memory=tmp_path / "shm", agent=True)


def test_a_step_written_into_scratch_is_copied_on_from_there(tmp_path: Path) -> None:
    # memory was full (docs/decisions/0036): the worker wrote and committed step 5 in scratch
    make_memory(tmp_path / "scratch", nodes=("n0",))
    events: list[dict[str, Any]] = []
    p0 = persister(tmp_path, "n0", events)
    req = request(tmp_path, "n0", scratch=str(tmp_path / "scratch" / "n0"))
    assert p0.round(dataclasses.replace(req, source="scratch")) == "done"
    assert durable_manifest(tmp_path).exists()
    assert p0.status().committed == {"scratch": STEP, "durable": STEP}
    assert [e["tier"] for e in events if e["event"] == "committed"] == ["durable"]
    bad = dataclasses.replace(req, step=STEP + 1, source="peer")
    p0.round(bad)
    assert any(e.get("tier") == "config" and "'peer'" in e["reason"] for e in events), events


def test_reports_a_dead_agent_missed_are_handed_to_the_next_one(tmp_path: Path) -> None:
    from trainpod.ckpt.persist import _Out, journal_of, replay

    journal = journal_of(tmp_path / ".persist-n0", "n0")
    out = _Out(journal)
    out.broken = True  # the agent was killed: its end of the pipe is gone
    out({"event": "status", "status": {}})  # not kept: the next persister has its own
    out({"event": "committed", "tier": "durable", "step": 2, "job_id": 7})
    out({"event": "failed", "tier": "scratch", "step": 2, "job_id": 7, "reason": "gone"})
    with journal.open("a") as f:
        f.write('{"event": "commi')  # torn by the persister's own death
    got: list[dict[str, Any]] = []
    assert replay(journal, got.append) == 2
    assert [(m["event"], m["tier"]) for m in got] == [
        ("committed", "durable"),
        ("failed", "scratch"),
    ]
    assert not journal.exists() and replay(journal, got.append) == 0


@pytest.mark.parametrize("durable_works", [True, False])
def test_an_ended_jobs_scratch_copies_go_once_the_durable_store_holds_them(
    tmp_path: Path, shm_job: str, durable_works: bool
) -> None:
    """A node's scratch dir must not fill with the copies of jobs that ended (a disk-full
    health fault, later): they go with the memory tier, but only where the durable store
    holds their newest step; else they are the newest copy there is, and stay."""
    shm = Path("/dev/shm/trainpod") / shm_job
    m = make_memory(shm, nodes=("n0",))
    node_scratch = tmp_path / "scratch" / "n0"
    job_dir = node_scratch / "job-7"
    (job_dir / "ckpt-peer").mkdir(parents=True)  # the copies it holds for a peer
    (job_dir / "notes.txt").write_text("a shell's file")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    durable = tmp_path / "durable" if durable_works else blocker / "durable"
    sock = Path(tempfile.mkdtemp(prefix="tph-", dir="/tmp")) / "c.sock"
    hub = CheckpointHub(
        sock, log_dir=tmp_path / "logs", scratch_root=node_scratch, finish_timeout_s=1.0
    )
    try:
        link = AgentLink(str(sock))
        config = TierConfig(
            node="n0", memory=str(shm / "n0"), scratch=str(job_dir / "ckpt"), durable=str(durable)
        )
        msg = {"op": "persist", "job_key": shm_job, "node": "n0", "step": STEP, "job_id": 7,
               "attempt_id": 3, "stall_s": 0.1, "bytes": m.total_bytes(),
               "tiers": config.to_dict()}  # fmt: skip
        assert link.request(msg) == {"ok": True}

        def settled() -> bool:
            st = link.status(shm_job, "n0")
            if st is None or st.committed.get("scratch") != STEP:
                return False
            return st.committed.get("durable") == STEP or "durable" in st.errors

        wait_until(settled, timeout_s=30, what="the scratch copy and the durable outcome")
        assert (job_dir / "ckpt" / step_name(STEP)).is_dir()
        hub.retain({8})  # job 7 ended
        assert hub.wait_idle(30)
        assert not shm.exists()
        if durable_works:
            assert not (job_dir / "ckpt").exists() and not (job_dir / "ckpt-peer").exists()
            assert (job_dir / "notes.txt").read_text() == "a shell's file"
        else:
            assert (job_dir / "ckpt" / step_name(STEP) / "manifest.json").is_file()
    finally:
        hub.close()
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_what_keeps_an_ended_jobs_scratch_copies() -> None:
    def why(committed: dict[str, int | None], saved: int = 9, primary: bool = False) -> str | None:
        return scratch_kept_because(
            PersistStatus(committed=committed), saved, primary_is_scratch=primary
        )

    assert why({"scratch": 9, "durable": 9}) is None
    assert why({"scratch": 8, "durable": 9}) is None  # durable skipped ahead of scratch
    assert why({}) is None  # scratch never committed a step: nothing of value there
    assert why({"scratch": 9, "durable": 6}) == "they hold step 9, the durable store only step 6"
    assert "no step of it" in str(why({"scratch": 9}))
    # Scratch is the primary tier (no memory tier): the newest step handed over is in it.
    assert why({"durable": 6}, saved=9, primary=True) is not None
    assert why({"durable": 9}, saved=9, primary=True) is None
