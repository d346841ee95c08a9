"""The Checkpointer across real Gloo processes (forked ranks on this machine).

* resharding: DTensor Shard(0) state saved by 4 ranks on 2 nodes, loaded by 2 ranks on 1 node
  from the durable tier (the node-local tiers do not hold every shard: recorded as reasons);
  replicated state is written once (DCP's planner dedups it).
* a save killed between the shard writes and the manifest is never loaded;
* an in-job restart finds the shared-memory snapshot of the killed attempt.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # distribute_tensor imports it (~4 s): once here, not in each forked rank
import torch.distributed.checkpoint
import torch.distributed.tensor

import trainpod.ckpt.checkpointer  # noqa: F401  (the same: the ranks are forked)

pytestmark = pytest.mark.integration

ROWS, COLS, REP = 16, 6, 4096
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Callable[..., None], world: int, *args: Any, expect_exit: int = 0) -> None:
    """Fork ``world`` ranks running ``fn(rank, world, port, *args)``; check their exit codes."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [expect_exit] * world, f"rank exit codes {codes}"


def _rank_main(fn: Callable[..., None], rank: int, world: int, port: int, *args: Any) -> None:
    import torch.distributed as dist

    # A forked child whose parent (this pytest process) has run an op in parallel hangs in
    # its first parallel op: OpenMP's thread pool does not survive fork. One thread here
    # avoids the pool (seen when a unit test with large tensors ran first in one session).
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, port, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("TRAINPOD_"):
            monkeypatch.delenv(var)


def _dtensor_state(world: int, full: torch.Tensor, rep: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "rep": rep, "step": 0}


def _save_sharded(rank: int, world: int, port: int, root: str) -> None:
    from trainpod.ckpt import Checkpointer

    os.environ.update(TRAINPOD_NODE=f"n{rank // 2}", TRAINPOD_NODES="n0,n1")
    state = _dtensor_state(world, FULL, torch.linspace(0, 1, REP))
    ck = Checkpointer(f"{root}/durable", memory=f"{root}/shm", scratch_dir=f"{root}/scratch")
    assert [t.name for t in ck.tiers] == ["memory", "scratch", "peer", "durable"]
    assert ck.load_latest(state) is None
    state["step"] = 7
    ck.save(7, state)
    assert ck.wait(60)
    assert ck.progress().committed == {"memory": 7, "scratch": 7, "peer": 7, "durable": 7}
    assert ck.close(release_memory=False)  # a restart follows, as in a job's next attempt


def _load_resharded(rank: int, world: int, port: int, root: str) -> None:
    from trainpod.ckpt import Checkpointer

    os.environ.update(TRAINPOD_NODE="n0", TRAINPOD_NODES="n0")  # the job shrank to one node
    state = _dtensor_state(world, torch.zeros(ROWS, COLS), torch.zeros(REP))
    with Checkpointer(f"{root}/durable", memory=f"{root}/shm", scratch_dir=f"{root}/scratch") as ck:
        assert ck.load_latest(state) == 7
        assert ck.last_load is not None
        # Rows that ranks 2-3 wrote on node n1 are not in n0's memory: read from durable.
        assert ck.last_load.tier in ("memory", "memory+durable"), ck.last_load
        assert rank == 0 or ck.last_load.tier == "memory+durable", ck.last_load
        assert state["w"].to_local().shape == (ROWS // world, COLS)
        assert torch.equal(state["w"].full_tensor(), FULL)
        assert torch.equal(state["rep"], torch.linspace(0, 1, REP)) and state["step"] == 7


def test_save_at_world_4_load_at_world_2_reshards_from_durable(tmp_path: Path) -> None:
    run_ranks(_save_sharded, 4, str(tmp_path))
    durable = tmp_path / "durable" / "step-0000000007"
    manifest = json.loads((durable / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["nodes"] == ["n0", "n1"]
    by_rank = {f["rank"]: f["node"] for f in manifest["files"] if f["rank"] is not None}
    assert by_rank == {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    # DCP's planner writes the replicated tensor once (by one rank), not once per rank.
    metadata = pickle.loads((durable / ".metadata").read_bytes())
    assert [k.fqn for k in metadata.storage_data].count("rep") == 1
    data = sum(p.stat().st_size for p in durable.glob("*.distcp"))
    assert data < 2 * (REP * 4 + ROWS * COLS * 4), data  # 4 copies would be > 64 KiB
    # Each node's part also sits on the other node's scratch (the peer tier).
    for holder, origin in (("n1", "n0"), ("n0", "n1")):
        peer = tmp_path / "scratch" / holder
        assert list(peer.glob(f"*/ckpt-peer/{origin}/step-0000000007/manifest.json"))

    run_ranks(_load_resharded, 2, str(tmp_path))


def _flat_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), value), "b": torch.arange(8.0) * value, "step": int(value)}


def _kill_self(when: str, step: int) -> Callable[[str, int], None]:
    def hook(event: str, s: int) -> None:
        if event == when and s == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _save_then_die(rank: int, world: int, port: int, root: str, when: str) -> None:
    from trainpod.ckpt import Checkpointer

    ck = Checkpointer(
        f"{root}/durable", scratch_dir=f"{root}/scratch", on_event=_kill_self(when, 20)
    )
    ck.save(10, _flat_state(10.0))
    assert ck.wait(60)
    ck.save(20, _flat_state(20.0))  # the hook kills this rank in the background
    ck.wait(60)
    raise AssertionError("the hook should have killed this rank")


def _restart(rank: int, world: int, port: int, root: str, expect: str) -> None:
    from trainpod.ckpt import Checkpointer

    state = _flat_state(0.0)
    with Checkpointer(f"{root}/durable", scratch_dir=f"{root}/scratch") as ck:
        step = ck.load_latest(state)
        assert ck.last_load is not None
        got = {"step": step, "tier": ck.last_load.tier, "reasons": list(ck.last_load.reasons)}
        Path(f"{root}/{expect}-{rank}.json").write_text(json.dumps(got))
        assert torch.equal(state["w"], torch.full((64, 64), float(step or 0)))
        assert state["step"] == step


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A unique job id: the real /dev/shm/trainpod/job-<id>-* memory tier, removed afterwards."""
    job_id = f"t{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TRAINPOD_JOB_ID", job_id)
    monkeypatch.setenv("TRAINPOD_NODE", "n0")
    yield job_id
    for d in Path("/dev/shm/trainpod").glob(f"job-{job_id}-*"):
        shutil.rmtree(d, ignore_errors=True)


def test_save_killed_before_its_manifest_is_never_loaded(tmp_path: Path, job: str) -> None:
    run_ranks(_save_then_die, 2, str(tmp_path), "written", expect_exit=-signal.SIGKILL)
    run_ranks(_restart, 2, str(tmp_path), "torn")
    got = json.loads((tmp_path / "torn-0.json").read_text())
    assert (got["step"], got["tier"]) == (10, "memory")
    assert any("step 20 in memory" in r and "no manifest" in r for r in got["reasons"]), got
    assert not (tmp_path / "durable" / "step-0000000020").exists()


def test_in_job_restart_loads_the_killed_attempts_memory_snapshot(tmp_path: Path, job: str) -> None:
    run_ranks(_save_then_die, 2, str(tmp_path), "committed:memory", expect_exit=-signal.SIGKILL)
    from trainpod.ckpt.layout import resolve

    memory = resolve(f"{tmp_path}/durable").memory
    assert memory is not None and str(memory).startswith("/dev/shm/trainpod/")
    assert (memory / "step-0000000020" / "manifest.json").exists()
    run_ranks(_restart, 2, str(tmp_path), "restart")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"restart-{rank}.json").read_text())
        assert (got["step"], got["tier"]) == (20, "memory"), got


def _ddp(rank: int, world: int, port: int, root: str, nodes: str, phase: str) -> None:
    from trainpod.ckpt import Checkpointer

    ring = nodes.split(",")
    os.environ.update(TRAINPOD_NODE=ring[rank // 2], TRAINPOD_NODES=nodes)
    ck = Checkpointer(f"{root}/durable", memory=f"{root}/shm", scratch_dir=f"{root}/scratch")
    if phase == "save":
        ck.save(5, _flat_state(5.0))  # replicated: DCP writes each tensor on one rank only
        assert ck.wait(60) and ck.progress().committed["peer"] == 5
    else:
        state = _flat_state(0.0)
        assert ck.load_latest(state) == 5 and state["step"] == 5
        assert torch.equal(state["w"], torch.full((64, 64), 5.0))
        assert ck.last_load is not None and ck.last_load.tier is not None
        Path(f"{root}/{phase}-{rank}.json").write_text(json.dumps(ck.last_load.tier))
    assert ck.close(release_memory=False)  # another restart follows


def test_multi_node_restarts_read_other_nodes_parts_from_peer_copies(tmp_path: Path) -> None:
    run_ranks(_ddp, 4, str(tmp_path), "n0,n1", "save")
    # In-job restart on the same nodes: every file is on the node already (its own memory,
    # or the peer copy of the other node's part kept on its scratch); durable is not read.
    run_ranks(_ddp, 4, str(tmp_path), "n0,n1", "same")
    same = [json.loads((tmp_path / f"same-{r}.json").read_text()) for r in range(4)]
    assert set(same) <= {"memory", "memory+peer"} and "memory+peer" in same, same
    # Node n1 is lost and n2 takes its ranks: n1's part comes from its copy on n0.
    for tier in ("shm", "scratch"):
        for d in (tmp_path / tier).rglob("n1"):
            if d.is_dir() and "ckpt-peer" not in d.parts:
                shutil.rmtree(d)
    run_ranks(_ddp, 4, str(tmp_path), "n0,n2", "replaced")
    replaced = [json.loads((tmp_path / f"replaced-{r}.json").read_text()) for r in range(4)]
    assert replaced[0] == replaced[1] == "memory+peer", replaced
    assert replaced[2] == replaced[3] == "peer+durable", replaced  # n0's copy was on n1


def _agree_on_notice(rank: int, world: int, port: int, root: Path) -> None:
    import torch.distributed as dist

    from trainpod.notice import ENV_FILE, NoticeWatcher

    w = NoticeWatcher({ENV_FILE: str(root / f"notice-{rank}.json")})
    assert not w.preempted(sync=True)
    if rank == 0:  # only rank 0's node has had its notice
        (root / "notice-0.json").write_text("{}")
    dist.barrier()
    assert w.preempted() is (rank == 0)
    assert w.preempted(sync=True)  # every rank agrees, so all stop at this step
    assert w.preempted()  # and stays stopped: later calls agree without another notice


def test_ranks_agree_on_a_notice_only_one_of_them_has_seen(tmp_path: Path) -> None:
    run_ranks(_agree_on_notice, 2, tmp_path)


def _one_node_full(rank: int, world: int, port: int, root: str, tiny: str) -> None:
    from trainpod.ckpt import Checkpointer

    node = f"n{rank}"  # two nodes, one rank each; only n1's memory tier is the full tmpfs
    os.environ.update(TRAINPOD_NODE=node, TRAINPOD_NODES="n0,n1")
    memory = tiny if rank == 1 else f"{root}/shm"
    big = {"w": torch.full((512 * 1024,), 1.0), "step": 1}  # 2 MiB, replicated
    with Checkpointer(f"{root}/durable", memory=memory, scratch_dir=f"{root}/scratch") as ck:
        ck.save(1, big)
        assert ck.wait(60)
        p = ck.progress()
        # every rank moved to scratch together: a step is in one tier on every node
        assert p.committed["memory"] is None and p.committed["scratch"] == 1, p
        assert ("memory" in p.errors) == (rank == 1), p.errors
        state = {"w": torch.zeros(512 * 1024), "step": 0}
        assert ck.load_latest(state) == 1 and float(state["w"][0]) == 1.0
        assert ck.last_load is not None and (ck.last_load.tier or "").startswith("scratch")
        ck.close(60, release_memory=False)


def test_one_nodes_full_memory_tier_sends_every_rank_to_scratch(tmp_path: Path, job: str) -> None:
    from trainpod.testing.tmpfs import TmpfsUnavailable, tmpfs

    try:
        with tmpfs(tmp_path / "tiny", "1m") as tiny:
            run_ranks(_one_node_full, 2, str(tmp_path), str(tiny))
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


def _framed(rank: int, world: int, port: int, root: str, kind: str) -> None:
    """Three saves on two ranks of one node: each rank's own tensors (``sharded``, names of
    its own as a hand-sharded optimizer has), a DTensor sharded by rows (``dtensor``, as
    FSDP's state is), or the same tensors on both (``replicated``)."""
    import trainpod.ckpt.pipeline
    from trainpod.ckpt import Checkpointer
    from trainpod.testing.wait import wait_until

    # However slow the leader's low-priority prune on a busy machine, rank 1 waits for it
    trainpod.ckpt.pipeline.SALVAGE_WAIT_S = 20.0
    os.environ.update(TRAINPOD_NODE="n0", TRAINPOD_NODES="n0")
    mesh = None
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def state(v: float) -> dict[str, Any]:
        if kind == "sharded":
            return {f"w{rank}": torch.full((300, 7), v + rank), "step": int(v)}
        if kind == "dtensor":
            from torch.distributed.tensor import Shard, distribute_tensor

            return {"w": distribute_tensor(FULL * v, mesh, [Shard(0)]), "step": int(v)}
        return _flat_state(v)

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    with Checkpointer(f"{root}/durable", memory=f"{root}/shm", every=1, agent=False) as ck:
        source = ck._pipe.framed
        assert source is not None
        prepared = source.prepared
        for step in (1, 2, 3):
            if step > 1 and kind != "replicated":  # the file for this save is made after the last
                wait_until(lambda: list(prepared.glob(f"framed-{rank}-*")), what="a framed file")
            ck.save(step, state(float(step)))
            assert ck.wait(60)
        Path(f"{root}/{kind}-{rank}.json").write_text(json.dumps(source.off))
        back = state(0.0)
        assert ck.load_latest(back) == 3
        want = state(3.0)
        assert all(torch.equal(local(back[k]), local(want[k])) for k in want if k != "step")
        assert ck.close(60, release_memory=False)


@pytest.mark.parametrize("kind", ["sharded", "dtensor"])
def test_two_ranks_stage_their_own_tensors_into_files_of_their_own(
    tmp_path: Path, kind: str
) -> None:
    run_ranks(_framed, 2, str(tmp_path), kind)
    (step3,) = (tmp_path / "shm").glob("*/*/step-0000000003")
    assert {"__0_m.distcp", "__1_m.distcp"} <= {p.name for p in step3.iterdir()}
    manifest = json.loads((step3 / "manifest.json").read_text())
    assert {f["name"] for f in manifest["files"]} >= {"__0_m.distcp", "__1_m.distcp"}
    assert [json.loads((tmp_path / f"{kind}-{r}.json").read_text()) for r in (0, 1)] == [None] * 2


def test_replicated_tensors_turn_staging_into_files_off(tmp_path: Path) -> None:
    """DCP writes a replicated tensor on one rank: a file of every rank's copy would hold
    copies nobody reads, so a rank whose plan lost tensors to another goes on staging as
    before (a rank that writes all it staged may stay on)."""
    run_ranks(_framed, 2, str(tmp_path), "replicated")
    offs = [json.loads((tmp_path / f"replicated-{r}.json").read_text()) for r in (0, 1)]
    assert any(offs) and all(o is None or "replicated tensor" in o for o in offs), offs
    for step in (2, 3):
        (d,) = (tmp_path / "shm").glob(f"*/*/step-{step:010d}")
        for r, off in enumerate(offs):
            assert not (off and (d / f"__{r}_m.distcp").exists())
        data = sum(p.stat().st_size for p in d.glob("*.distcp"))
        assert data < 64 * 64 * 4 * 2, data  # one copy of the state, not two
    for r, off in enumerate(offs):
        assert not (off and list((tmp_path / "shm").glob(f"*/*/.prepared/framed-{r}-*")))


def _files_over_on_one_node(rank: int, world: int, port: int, root: str) -> None:
    import trainpod.ckpt.pipeline
    from trainpod.ckpt import Checkpointer
    from trainpod.testing.wait import wait_until

    # However slow the leader's low-priority prune on a busy machine, rank 1 waits for it
    trainpod.ckpt.pipeline.SALVAGE_WAIT_S = 20.0
    os.environ.update(TRAINPOD_NODE="n0", TRAINPOD_NODES="n0")
    mem = Path(root) / "shm"
    ck = Checkpointer(f"{root}/durable", memory=str(mem), every=1, agent=False, keep={"memory": 1})
    inode: dict[int, int] = {}
    for step in range(1, 8):
        if step > 1:  # the preparer's file for this save, so that it is staged into one
            wait_until(
                lambda: next(iter(mem.glob(f"*/n0/.prepared/framed-{rank}-*")), None),
                interval_s=0.01,
                what=f"rank {rank}'s framed file for step {step}",
            )
        ck.save(step, {f"w{rank}": torch.full((256, 1024), float(10 * step + rank)), "step": step})
        assert ck.wait(60)
        (f,) = mem.glob(f"*/n0/step-{step:010d}/__{rank}_m.distcp") if step > 1 else (None,)
        if f is not None:
            inode[step] = f.stat().st_ino
    assert ck.close(60, release_memory=False)
    # From the fourth save on each rank's file is the one of the step that left memory, the
    # leader's (which prunes) and the other rank's (which waits for the leader's prune).
    reused = [s for s in range(4, 8) if inode[s] == inode[s - 2]]
    assert reused == [4, 5, 6, 7], (rank, inode)


def test_ranks_sharing_a_node_each_write_over_their_file_of_the_step_that_left_memory(
    tmp_path: Path,
) -> None:
    run_ranks(_files_over_on_one_node, 2, str(tmp_path))
    back = {"w0": torch.zeros(256, 1024), "w1": torch.zeros(256, 1024), "step": 0}
    dcp_dir = next(tmp_path.glob("shm/*/n0/step-0000000007"))
    torch.distributed.checkpoint.load(
        back, storage_reader=torch.distributed.checkpoint.FileSystemReader(dcp_dir)
    )
    assert torch.equal(back["w0"], torch.full((256, 1024), 70.0))
    assert torch.equal(back["w1"], torch.full((256, 1024), 71.0))
    assert back["step"] == 7
