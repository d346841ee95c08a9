"""The Checkpointer in one process (no process group): tiers, commit, load, interval, beacons."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainpod import beacon
from trainpod.agent.beacons import BeaconServer
from trainpod.ckpt import Checkpointer
from trainpod.ckpt.errors import CheckpointConfigError, CheckpointError
from trainpod.ckpt.layout import young_daly_s
from trainpod.testing.wait import wait_until

TRAINPOD_VARS = [
    "TRAINPOD_CHECKPOINT_URI", "TRAINPOD_CHECKPOINT_DIR", "TRAINPOD_SCRATCH_DIR",
    "TRAINPOD_JOB_SCRATCH_DIR", "TRAINPOD_NODE", "TRAINPOD_NODES", "TRAINPOD_JOB_ID",
    "TRAINPOD_ATTEMPT", "TRAINPOD_CKPT_SOCKET", "TRAINPOD_MTBF_S", "TRAINPOD_BEACON_SOCKET",
    "TRAINPOD_ATTEMPT_ID",
]  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in TRAINPOD_VARS:
        monkeypatch.delenv(var, raising=False)
    beacon.reset()
    yield
    beacon.reset()


def make_state(seed: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    with torch.no_grad():
        model.weight.fill_(seed)
    return {"model": model, "t": torch.arange(10.0) + seed, "extra": {"epoch": int(seed)}}


def checkpointer(root: Path, **kw: Any) -> Checkpointer:
    kw.setdefault("every", 1)
    return Checkpointer(
        dir=root / "durable", memory=root / "shm", scratch_dir=root / "scratch", **kw
    )


def test_save_commits_every_tier_and_a_new_process_loads_the_fastest(tmp_path: Path) -> None:
    events: list[tuple[str, int]] = []
    with checkpointer(tmp_path, on_event=lambda e, s: events.append((e, s))) as ck:
        assert [t.name for t in ck.tiers] == ["memory", "scratch", "durable"]
        assert ck.load_latest(make_state()) is None  # fresh start
        assert ck.last_load is not None and ck.last_load.reasons == ()
        state = make_state(3.0)
        ck.save(3, state)
        assert ck.last_stall_s is not None and ck.last_stall_s > 0
        state["t"].add_(100)  # training goes on: the snapshot is unaffected
        assert ck.wait(30)
        p = ck.progress()
        assert p.committed == {"memory": 3, "scratch": 3, "durable": 3} and p.errors == {}
    assert ("written", 3) in events and events.index(("written", 3)) < events.index(
        ("committed:memory", 3)
    )
    durable = tmp_path / "durable" / "step-0000000003"
    manifest = json.loads((durable / "manifest.json").read_bytes())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert {f["name"] for f in manifest["files"]} == {"__0_0.distcp", ".metadata"}
    assert (tmp_path / "durable" / "latest").read_text() == "3\n"

    # Outside trainpod nobody else would free the RAM: close() removed the memory tier,
    # and the job's dir around it.
    assert not list((tmp_path / "shm").iterdir())
    with checkpointer(tmp_path) as ck2:
        fresh = make_state(0.0)
        assert ck2.load_latest(fresh) == 3
        assert ck2.last_load is not None and ck2.last_load.tier == "scratch"
        assert torch.equal(fresh["model"].weight, torch.full((8, 16), 3.0))
        assert torch.equal(fresh["t"], torch.arange(10.0) + 3)
        assert fresh["extra"] == {"epoch": 3}


def test_a_checkpointer_closed_before_any_save_leaves_nothing_in_memory(tmp_path: Path) -> None:
    """Found in /dev/shm/trainpod after test runs: an empty ``dir-<hash>`` per Checkpointer
    that never saved (the job's dir is made at the start, and close() only removed it
    together with a node's tier)."""
    with checkpointer(tmp_path):
        assert [p.name[:4] for p in (tmp_path / "shm").iterdir()] == ["dir-"]
    assert not list((tmp_path / "shm").iterdir())


def test_a_kept_memory_tier_is_what_the_next_process_loads_first(tmp_path: Path) -> None:
    with checkpointer(tmp_path) as ck:
        ck.save(4, make_state(4.0))
        assert ck.wait(30)
        assert ck.close(release_memory=False)
    assert [p.name for p in (tmp_path / "shm").glob("*/*/step-*")] == ["step-0000000004"]
    with checkpointer(tmp_path) as ck2:
        fresh = make_state(0.0)
        assert ck2.load_latest(fresh) == 4
        assert ck2.last_load is not None and ck2.last_load.tier == "memory"
        assert torch.equal(fresh["model"].weight, torch.full((8, 16), 4.0))
    assert not list((tmp_path / "shm").glob("*/*"))  # the default close released it


def test_leaving_on_an_exception_keeps_the_memory_tier_for_the_restart(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the loop broke"), checkpointer(tmp_path) as ck:
        ck.save(3, make_state(3.0))
        assert ck.wait(30)
        raise RuntimeError("the loop broke")
    assert [p.name for p in (tmp_path / "shm").glob("*/*/step-*")] == ["step-0000000003"]


def test_under_trainpod_the_memory_tier_is_left_to_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_JOB_ID", "7")  # the agent removes it when the job ends
    with checkpointer(tmp_path) as ck:
        ck.save(2, make_state(2.0))
        assert ck.wait(30)
    (node_dir,) = (tmp_path / "shm").glob("job-7-*/*")
    assert [p.name for p in node_dir.glob("step-*")] == ["step-0000000002"]


def test_retention_keeps_k_per_tier(tmp_path: Path) -> None:
    def steps(d: Path) -> list[int]:
        return sorted(int(p.name[5:]) for p in d.glob("step-*"))

    with checkpointer(tmp_path, keep={"memory": 1, "scratch": 2, "durable": 3}) as ck:
        for step in range(1, 6):
            ck.save(step, make_state(step))
            assert ck.wait(30)
        (mem,) = (tmp_path / "shm").glob("*/*")
        kept_in_memory = steps(mem)
    (scr,) = (tmp_path / "scratch").glob("*/*/ckpt")
    assert (kept_in_memory, steps(scr), steps(tmp_path / "durable")) == ([5], [4, 5], [3, 4, 5])


def test_newest_step_wins_and_stale_buffers_are_reused(tmp_path: Path) -> None:
    with checkpointer(tmp_path) as ck:
        state = make_state()
        for step in (1, 2):
            state["t"].fill_(step)
            ck.save(step, state)
        assert ck._stager.reallocations == 1  # same layout: the staging buffers were reused
        state["t"] = torch.zeros(3)  # a new shape: new buffers, not a broadcast copy
        ck.save(3, state)
        assert ck._stager.reallocations == 2
        assert ck.wait(30)
        loaded = make_state()
        loaded["t"] = torch.ones(3)
        assert ck.load_latest(loaded) == 3 and torch.equal(loaded["t"], torch.zeros(3))


def test_due_with_a_fixed_interval_skips_the_step_just_loaded(tmp_path: Path) -> None:
    with checkpointer(tmp_path, every=5) as ck:
        assert [s for s in range(1, 16) if ck.due(s)] == [5, 10, 15]
        ck.save(10, make_state())
        assert ck.wait(30)
    with checkpointer(tmp_path, every=5) as ck2:
        start = ck2.load_latest(make_state())
        assert start == 10 and not ck2.due(10) and ck2.due(15)


def test_auto_interval_is_young_daly_in_steps(tmp_path: Path) -> None:
    with checkpointer(tmp_path, every=None, interval="auto", mtbf_s=3600.0) as ck:
        due = [s for s in range(0, 20) if ck.due(s)]
        assert due[0] == 5  # the first save comes after a few timed steps
        ck.save(5, make_state())
        # The ranks agree on (stall, step time) in the writer; the next save() reads it. Read
        # it once step 5 is written and before step 10 is: the writer agrees again on step 10.
        assert ck.wait(30)
        agreed = ck.costs
        assert agreed is not None and agreed.mtbf_s == 3600.0
        seconds = max(agreed.write_s, max(1.0, young_daly_s(agreed.stall_s, 3600.0)))
        expected = max(1, math.ceil(seconds / agreed.step_s))
        assert ck.interval_steps == expected and ck.interval_s() == seconds
        ck.save(10, make_state())
        assert ck.due(10 + expected) and not ck.due(10 + expected - 1)
        assert ck.wait(30)
    with pytest.raises(CheckpointConfigError):
        Checkpointer(dir=tmp_path, every=3, interval="auto")


def test_stall_and_commits_are_reported_through_beacons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="tpc-", dir="/tmp"))
    srv = BeaconServer(sock_dir / "b.sock")
    monkeypatch.setenv("TRAINPOD_BEACON_SOCKET", str(srv.path))
    monkeypatch.setenv("TRAINPOD_ATTEMPT_ID", "9")
    beacon.reset()
    try:
        with checkpointer(tmp_path) as ck:
            ck.due(4)
            ck.save(4, make_state())
            assert ck.wait(30)

            def durable_seen() -> Any:
                ranks = srv.book.summary(9).ranks
                r = ranks.get(0)
                return r if r and r.metrics.get("checkpoint_durable_step") == 4 else None

            r = wait_until(durable_seen, timeout_s=20, what="durable commit beacon")
            assert r.last_checkpoint_step == 4 and r.checkpoint_stall_s > 0
    finally:
        srv.close()


def test_save_after_close_and_a_config_without_local_tier_fail_clearly(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path)
    assert ck.close() and ck.close()
    with pytest.raises(CheckpointError, match="close"):
        ck.save(1, make_state())
    with pytest.raises(CheckpointConfigError, match="node-local"):
        Checkpointer(dir=tmp_path / "d", memory=False)


def test_importing_trainpod_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, trainpod; assert 'torch' not in sys.modules; trainpod.Checkpointer"
    code += "; import trainpod.ckpt; assert 'fsspec' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_an_object_store_without_its_fsspec_backend_is_a_config_error() -> None:
    pytest.importorskip("fsspec")
    try:
        import s3fs  # type: ignore[import-untyped]  # noqa: F401  # s3fs ships no type hints
    except ImportError:
        with pytest.raises(CheckpointConfigError, match="s3fs"):
            Checkpointer("s3://bucket/ckpt")
    else:
        pytest.skip("s3fs is installed here")


class _StillWriting:
    """An abandoned pipeline whose writer has not ended yet, given steps up to ``highest``."""

    def __init__(self, highest: int) -> None:
        self.alive = True
        self.highest = highest

    def busy(self) -> bool:
        return self.alive

    def may_write(self, step: int) -> bool:
        return self.alive and step <= self.highest


def test_rebind_keeps_the_schedule_and_skips_the_steps_an_old_writer_may_still_write(
    tmp_path: Path,
) -> None:
    events: list[tuple[str, int]] = []
    with checkpointer(tmp_path, every=2, on_event=lambda e, s: events.append((e, s))) as ck:
        ck.save(2, make_state(2.0))
        assert ck.wait(30)
        old = ck._pipe
        ck.rebind()
        assert ck._pipe is not old
        # both of its threads end by themselves (the copier too, not only the writer: a
        # loaded box once saw the copier alive after the writer's join)
        wait_until(lambda: not old.busy(), timeout_s=60, what="the old pipeline's threads")
        assert old.cw.closed is not None  # the old group refuses collectives now
        assert not old.may_write(2)  # it was given step 2, but its threads have ended
        assert not ck.due(2)  # the schedule survived: step 2 is saved already
        assert ck.due(4)
        stuck = _StillWriting(highest=4)  # its group reached step 4, then was re-formed
        ck._abandoned.append(stuck)  # type: ignore[arg-type]
        ck.save(4, make_state(4.0))
        assert ck.wait(30)
        assert ("skipped", 4) in events and ck.progress().committed["memory"] == 2
        # past the old group's steps the saves go on, though its thread is still stuck
        ck.save(6, make_state(6.0))
        assert ck.wait(30)
        assert ck.progress().committed == {"memory": 6, "scratch": 6, "durable": 6}
        assert stuck.alive
    state = make_state()
    with checkpointer(tmp_path) as fresh:
        assert fresh.load_latest(state) == 6
    assert torch.equal(state["t"], torch.arange(10.0) + 6.0)


def test_rebind_after_close_is_refused(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path)
    ck.close()
    with pytest.raises(CheckpointError, match="rebind\\(\\) after close"):
        ck.rebind()


def test_the_node_ring_is_the_listed_one_unless_a_spare_took_a_node_s_place() -> None:
    from trainpod.ckpt.checkpointer import node_ring

    assert node_ring(["b", "b", "a", "a"], ("a", "b")) == ("a", "b")  # as listed
    assert node_ring(["a", "a"], ("a",)) == ("a",)
    # rank 0 was given the list before node b was lost; ranks 2-3 now run on spare s
    assert node_ring(["a", "a", "s", "s"], ("a", "b")) == ("a", "s")
