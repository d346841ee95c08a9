"""``trainpod.elastic.run`` across real Gloo ranks (4 processes on this machine, CPU only).

The test plays the agent's part of ADR 0026 with the protocol's own writer
(:func:`trainpod.elastic.write_recover`): it kills a rank, publishes the recover message and
starts the replacement with the new group's facts, as the agent will. The healthy ranks are
never restarted: their pids at the end are the pids they started with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainpod.agent.launcher import Launcher
from trainpod.api.models import LaunchOrder, RankReport, RankSlot, RecoverOrder
from trainpod.elastic import EXIT_RECOVERY_FAILED, Recover, recover_file, write_recover
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

WORKER = Path(__file__).parent / "workers" / "elastic_dp.py"
WORLD = 4
STEPS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ranks:
    """The ranks of one job, started like the agent starts them (own session, own log)."""

    def __init__(self, root: Path, *, steps: int = STEPS, extra: tuple[str, ...] = ()) -> None:
        self.out = root / "out"
        self.out.mkdir(parents=True)
        self.logs = root / "logs"
        self.logs.mkdir()
        self.file = recover_file(root / "scratch")
        self.port = free_port()
        self.argv = [sys.executable, str(WORKER), "--steps", str(steps), "--out", str(self.out)]
        self.argv += list(extra)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, list[int]] = {}  # rank -> every pid it had

    def start(self, rank: int, *, port: int | None = None, generation: int = 0) -> None:
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port or self.port),
            "TRAINPOD_RECOVERY": "in-process",
            "TRAINPOD_RECOVER_FILE": str(self.file),
            "OMP_NUM_THREADS": "1",
        }
        if generation:
            env["TRAINPOD_RECOVER_GENERATION"] = str(generation)
        with (self.logs / f"rank-{rank}.log").open("ab") as log:
            proc = subprocess.Popen(
                self.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[rank] = proc
        self.started.setdefault(rank, []).append(proc.pid)

    def start_all(self) -> None:
        for r in range(WORLD):
            self.start(r)

    def kill(self, rank: int) -> None:
        os.killpg(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait()

    def recover(self, generation: int, replaced: tuple[int, ...], deadline_s: float = 30) -> int:
        """Publish generation ``generation`` and start ``replaced`` anew in it; its port."""
        port = free_port()
        message = Recover(
            generation=generation,
            attempt_id=1,
            master_addr="127.0.0.1",
            master_port=port,
            world_size=WORLD,
            replaced=replaced,
            deadline_s=deadline_s,
        )
        write_recover(self.file, message)
        for r in replaced:
            self.start(r, port=port, generation=generation)
        return port

    def marked(self, step: int) -> bool:
        return all((self.out / f"at-{step}-rank-{r}").exists() for r in range(WORLD))

    def ended(self) -> dict[int, int] | None:
        codes = {r: p.poll() for r, p in self.procs.items()}
        return None if any(c is None for c in codes.values()) else codes  # type: ignore[return-value]

    def results(self) -> dict[int, dict[str, Any]]:
        return {r: json.loads((self.out / f"rank-{r}.json").read_text()) for r in range(WORLD)}

    def log(self, rank: int) -> str:
        return (self.logs / f"rank-{rank}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def ranks_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Ranks] = []

    def make(name: str, **kw: Any) -> Ranks:
        r = Ranks(tmp_path / name, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def _finish(ranks: Ranks, timeout_s: float = 90) -> dict[int, int]:
    codes: dict[int, int] = wait_until(ranks.ended, timeout_s=timeout_s, what="every rank to end")
    return codes


def _logs(ranks: Ranks) -> str:
    return "\n".join(f"--- rank {r}\n{ranks.log(r)[-3000:]}" for r in range(WORLD))


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """What every rank ends with when nothing goes wrong."""
    reference = Ranks(tmp_path_factory.mktemp("reference"))
    try:
        reference.start_all()
        assert _finish(reference) == dict.fromkeys(range(WORLD), 0), _logs(reference)
        return reference.results()
    finally:
        reference.stop()


@pytest.mark.timeout(240)
def test_killed_rank_recovers_in_process(
    ranks_factory: Any, undisturbed: dict[int, dict[str, Any]]
) -> None:
    ranks = ranks_factory("faulty", extra=("--mark-at", "10", "--step-sleep", "0.05"))
    ranks.start_all()
    wait_until(lambda: ranks.marked(10), timeout_s=60, what="every rank past step 10")
    ranks.kill(3)
    ranks.recover(1, replaced=(3,))
    codes = _finish(ranks)
    assert codes == dict.fromkeys(range(WORLD), 0), _logs(ranks)
    got = ranks.results()

    for r in range(3):  # the healthy ranks were never restarted
        assert ranks.started[r] == [got[r]["pid"]]
        assert got[r]["generation"] == 1
        [rec] = got[r]["recoveries"]
        # at most the step that was running is redone: rolled back by one step at most
        assert rec["failed_step"] - rec["resumed_step"] in (0, 1), rec
        assert rec["source"] in range(3)
        ran = got[r]["ran"]
        assert sorted(set(ran)) == list(range(STEPS))  # no step lost
        redone = len(ran) - len(set(ran))
        assert redone <= 1, ran
    assert len(ranks.started[3]) == 2
    assert got[3]["pid"] == ranks.started[3][1]
    [joined] = got[3]["recoveries"]
    assert joined["cause"] == "replacement"
    assert got[3]["ran"] == list(range(joined["resumed_step"], STEPS))
    for r in range(WORLD):  # the same model as the run nobody disturbed, on every rank
        assert got[r]["final_loss"] == undisturbed[r]["final_loss"]
        assert got[r]["params"] == undisturbed[r]["params"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("every", ["5", "auto"])
def test_copies_every_k_steps_roll_back_to_the_newest_one_every_rank_holds(
    ranks_factory: Any, undisturbed: dict[int, dict[str, Any]], every: str
) -> None:
    """The state copied every 5 steps, or every k steps that the ranks agree on after 20
    ("auto", with no fault in an hour assumed: a cheap copy is many steps apart): a rank
    killed after step 22 rolls every rank back to the newest copy, no more than k steps,
    and the model is still the undisturbed run's."""
    extra = ("--mark-at", "22", "--step-sleep", "0.1", "--snapshot-every", every)
    ranks = ranks_factory(f"every-{every}", extra=(*extra, "--mtbf-s", "3600"))
    ranks.start_all()
    wait_until(lambda: ranks.marked(22), timeout_s=60, what="every rank past step 22")
    ranks.kill(3)
    ranks.recover(1, replaced=(3,))
    assert _finish(ranks) == dict.fromkeys(range(WORLD), 0), _logs(ranks)
    got = ranks.results()
    for r in range(3):
        [rec] = got[r]["recoveries"]
        k = rec["snapshot_every"]  # in force when the fault came
        assert k == 5 if every == "5" else k > 1, rec
        rolled = rec["failed_step"] - rec["resumed_step"]
        assert 0 <= rolled <= k, rec
        if every == "5" and rolled:  # a copy of the schedule: 0, 5, 10, ...
            assert rec["resumed_step"] % 5 == 0, rec
        elif every == "5":  # the recover message came between steps: kept there
            assert rec["resumed_step"] == rec["failed_step"], rec
        else:
            assert rec["resumed_step"] >= 20, rec  # the agreement at step 20 copied there
        ran = got[r]["ran"]
        assert sorted(set(ran)) == list(range(STEPS))
        assert len(ran) - len(set(ran)) == rolled  # exactly the steps since the copy
    assert len({got[r]["recoveries"][0]["snapshot_every"] for r in range(3)}) == 1  # agreed
    assert len({got[r]["snapshot_every"] for r in range(WORLD)}) == 1  # and after it
    for r in range(WORLD):
        assert got[r]["final_loss"] == undisturbed[r]["final_loss"]
        assert got[r]["params"] == undisturbed[r]["params"]


@pytest.mark.timeout(300)
def test_a_checkpointer_carries_on_through_an_in_process_recovery(
    ranks_factory: Any, undisturbed: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    """The healthy ranks' Checkpointer is rebound to the new group, the replacement's is
    new: all save at the same steps after the recovery, the last save is committed, and a
    full restart resumes from it (``resume=``) with the model of the undisturbed run."""
    ckpt = tmp_path / "ckpt"
    extra: tuple[str, ...] = ("--mark-at", "10", "--mark-at", "25", "--step-sleep", "0.05")
    extra += ("--ckpt", str(ckpt), "--ckpt-every", "3")
    ranks = ranks_factory("ckpt-faulty", extra=extra)
    ranks.start_all()
    wait_until(lambda: ranks.marked(10), timeout_s=60, what="every rank past step 10")
    ranks.kill(3)
    ranks.recover(1, replaced=(3,))
    # A second fault, of another rank, once the first replacement runs: its Checkpointer is
    # the fresh one now, rank 3's the rebound one.
    wait_until(lambda: ranks.marked(25), timeout_s=60, what="every rank past step 25")
    ranks.kill(2)
    ranks.recover(2, replaced=(2,))
    assert _finish(ranks) == dict.fromkeys(range(WORLD), 0), _logs(ranks)
    got = ranks.results()
    joined = got[2]["recoveries"][-1]
    assert joined["cause"] == "replacement" and got[2]["generation"] == 2
    resumed = joined["resumed_step"]
    after = [s for s in got[0]["saves"] if s >= resumed]
    assert after and after[-1] == STEPS - 1, got[0]["saves"]
    for r in range(WORLD):
        assert [s for s in got[r]["saves"] if s >= resumed] == after, (r, got[r]["saves"])
        assert got[r]["committed"]["memory"] == STEPS - 1, (r, got[r]["committed"])
        assert got[r]["committed"]["durable"] == STEPS - 1, (r, got[r]["committed"])
        assert got[r]["params"] == undisturbed[r]["params"]

    again = ranks_factory("ckpt-resumed", extra=("--ckpt", str(ckpt)))
    again.start_all()
    assert _finish(again) == dict.fromkeys(range(WORLD), 0), _logs(again)
    for r, res in again.results().items():
        assert res["ran"] == [], res["ran"]  # resumed after the last step: nothing to run
        assert res["params"] == undisturbed[r]["params"]
        assert res["final_loss"] == undisturbed[r]["final_loss"]


@pytest.mark.timeout(120)
def test_no_recover_message_exits_for_a_full_restart(ranks_factory: Any) -> None:
    ranks = ranks_factory(
        "silent", extra=("--mark-at", "5", "--step-sleep", "0.05", "--wait-s", "3")
    )
    ranks.start_all()
    wait_until(lambda: ranks.marked(5), timeout_s=60, what="every rank past step 5")
    ranks.kill(2)
    codes = _finish(ranks)
    assert codes[2] == -signal.SIGKILL
    for r in (0, 1, 3):
        assert codes[r] == EXIT_RECOVERY_FAILED, _logs(ranks)
        assert "in-process recovery failed: no recover message" in ranks.log(r)


@pytest.mark.timeout(240)
def test_fault_during_recovery_is_recovered_by_a_newer_generation(ranks_factory: Any) -> None:
    """A second fault while generation 1 forms: its replacement dies before it joins. The
    healthy ranks give generation 1 up at its deadline and re-join generation 2."""
    ranks = ranks_factory("twice", extra=("--mark-at", "8", "--step-sleep", "0.05"))
    ranks.start_all()
    wait_until(lambda: ranks.marked(8), timeout_s=60, what="every rank past step 8")
    ranks.kill(1)
    ranks.recover(1, replaced=(), deadline_s=3)  # nobody starts rank 1: generation 1 fails
    wait_until(
        lambda: all("re-joining generation 1 failed" in ranks.log(r) for r in (0, 2, 3)),
        timeout_s=60,
        what="the healthy ranks to give generation 1 up",
    )
    ranks.recover(2, replaced=(1,))
    assert _finish(ranks) == dict.fromkeys(range(WORLD), 0), _logs(ranks)
    got = ranks.results()
    for r in (0, 2, 3):
        assert ranks.started[r] == [got[r]["pid"]]
        assert got[r]["generation"] == 2
    assert len({json.dumps(got[r]["params"]) for r in range(WORLD)}) == 1


@pytest.mark.timeout(240)
def test_the_agents_launcher_starts_only_the_killed_rank_and_tells_the_others(
    tmp_path: Path, undisturbed: dict[int, dict[str, Any]]
) -> None:
    """The agent's half of ADR 0026 with the real launcher: a ``RecoverOrder`` writes the
    message where the ranks look and starts the killed rank again in the same attempt."""
    out = tmp_path / "out"
    out.mkdir()
    launcher = Launcher(node_env={"TRAINPOD_SCRATCH_DIR": str(tmp_path)}, on_change=lambda: None)
    argv = [sys.executable, str(WORKER), "--steps", str(STEPS), "--out", str(out)]
    env = {
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TRAINPOD_RECOVERY": "in-process",
        "OMP_NUM_THREADS": "1",
    }
    order = LaunchOrder(
        attempt_id=5,
        job_id=3,
        attempt_number=1,
        argv=[*argv, "--mark-at", "10", "--step-sleep", "0.05"],
        workdir=str(tmp_path),
        env=env,
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(WORLD)],
        log_dir=str(tmp_path / "logs"),
    )

    def ranks() -> list[RankReport]:
        (rep,) = launcher.reports()
        return rep.ranks

    def text() -> str:
        return "\n".join(
            (tmp_path / "logs" / f"rank-{r}.log").read_text(errors="replace")[-2000:]
            for r in range(WORLD)
        )

    try:
        assert launcher.launch(order)
        wait_until(
            lambda: all((out / f"at-10-rank-{r}").exists() for r in range(WORLD)),
            timeout_s=60,
            what="every rank past step 10",
        )
        before = {r.rank: r.pid for r in ranks()}
        assert launcher.signal_rank(1, signal.SIGKILL) == 1
        wait_until(lambda: ranks()[1].state == "exited", what="rank 1 to end")
        recover = RecoverOrder(
            attempt_id=5,
            generation=1,
            master_addr="127.0.0.1",
            master_port=free_port(),
            world_size=WORLD,
            replaced=[1],
            respawn=[1],
            deadline_s=30,
        )
        assert launcher.recover(recover)
        assert not launcher.recover(recover)  # the same generation twice: once

        def all_ended() -> list[RankReport] | None:
            now = ranks()
            return now if all(r.state == "exited" for r in now) else None

        done = wait_until(all_ended, timeout_s=120, what="every rank to end")
        assert [r.exit_code for r in done] == [0] * WORLD, text()
        got = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)}
        assert {r: got[r]["pid"] for r in (0, 2, 3)} == {r: before[r] for r in (0, 2, 3)}
        assert got[1]["pid"] == done[1].pid != before[1]
        assert recover_file(tmp_path / "job-3").exists()
        for r in range(WORLD):
            assert got[r]["generation"] == 1
            assert got[r]["params"] == undisturbed[r]["params"], text()
    finally:
        launcher.kill_everything()


@pytest.mark.timeout(240)
def test_a_ddp_job_rebuilds_its_wrapper_in_the_new_group(ranks_factory: Any) -> None:
    """DistributedDataParallel keeps the group it was built with: ``on_group`` builds it
    again in every new group, and the replacement is rank 0, the store's host."""
    reference = ranks_factory("ddp-reference", extra=("--ddp",))
    reference.start_all()
    assert _finish(reference) == dict.fromkeys(range(WORLD), 0), _logs(reference)
    ranks = ranks_factory("ddp", extra=("--ddp", "--mark-at", "10", "--step-sleep", "0.05"))
    ranks.start_all()
    wait_until(lambda: ranks.marked(10), timeout_s=60, what="every rank past step 10")
    ranks.kill(0)
    ranks.recover(1, replaced=(0,))
    assert _finish(ranks) == dict.fromkeys(range(WORLD), 0), _logs(ranks)
    got, undisturbed = ranks.results(), reference.results()
    for r in range(1, WORLD):
        assert ranks.started[r] == [got[r]["pid"]]
    for r in range(WORLD):
        assert got[r]["params"] == undisturbed[r]["params"], _logs(ranks)
