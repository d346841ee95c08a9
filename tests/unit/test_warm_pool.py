"""WarmPool: which zygote a rank starts from, and when a job's own goes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from trainpod.agent.warmpool import WarmPool
from trainpod.agent.warmstart import WarmProcess, WarmStarter
from trainpod.api.models import LaunchOrder, RankSlot


@dataclass(frozen=True)
class Forked:
    """What a fake zygote's spawn gives in place of a WarmProcess."""

    by: str


class FakeStarter:
    def __init__(
        self, name: str, modules: tuple[str, ...] = (), cwd: str = "", env: Any = None
    ) -> None:
        self.name, self.modules, self.cwd, self.env = name, list(modules), cwd, env
        self.ready = False
        self.started = self.closed = False
        self.spawned: list[list[str]] = []

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True

    def spawn(self, argv: list[str], **_: Any) -> WarmProcess | str:
        if not self.ready:
            return "the warm-start server is not ready"
        self.spawned.append(argv)
        return cast(WarmProcess, Forked(self.name))


def order(job_id: int, preload: list[str], account: str | None = None) -> LaunchOrder:
    return LaunchOrder(
        attempt_id=job_id * 10,
        job_id=job_id,
        attempt_number=1,
        argv=["python", "train.py"],
        workdir="/work",
        env={"HF_HOME": "/hf"},
        ranks=[RankSlot(rank=0, local_rank=0)],
        log_dir="/logs",
        account=account,
        preload=preload,
    )


@pytest.fixture
def made() -> dict[str, FakeStarter]:
    return {}


def pool(made: dict[str, FakeStarter], max_jobs: int = 4) -> tuple[WarmPool, FakeStarter]:
    default = FakeStarter("agent")
    default.ready = True

    def make(name: str, modules: list[str], cwd: str, env: Mapping[str, str]) -> WarmStarter:
        made[name] = FakeStarter(name, tuple(modules), cwd, env)
        return cast(WarmStarter, made[name])

    return WarmPool(cast(WarmStarter, default), make, max_jobs=max_jobs), default


def spawn(p: WarmPool, o: LaunchOrder) -> str:
    """Which zygote forked the rank (``forked by NAME``), or why none did."""
    got = p.spawn(o, env={}, log_path=Path("/logs/rank-0.log"))
    return got if isinstance(got, str) else f"forked by {cast(Forked, got).by}"


def test_a_job_without_preload_forks_from_the_agents_zygote(made: dict[str, FakeStarter]) -> None:
    p, _ = pool(made)
    assert spawn(p, order(1, [])) == "forked by agent"
    assert made == {} and p.jobs() == []


def test_a_preload_job_gets_its_own_zygote_and_forks_from_it_once_ready(
    made: dict[str, FakeStarter],
) -> None:
    p, _ = pool(made)
    assert spawn(p, order(1, ["transformers"])) == "forked by agent"  # its own is importing
    job = made["job-1"]
    assert job.started and job.cwd == "/work" and job.env == {"HF_HOME": "/hf"}
    assert job.modules == ["torch", "torch.distributed", "trainpod", "transformers"]
    job.ready = True
    assert spawn(p, order(1, ["transformers"])) == "forked by job-1"
    assert list(made) == ["job-1"]  # made once


def test_while_neither_is_ready_the_reason_names_the_preload_server(
    made: dict[str, FakeStarter],
) -> None:
    p, default = pool(made)
    default.ready = False
    why = spawn(p, order(1, ["lightning"]))
    assert "not ready" in why and "--preload server is still importing" in why


def test_an_accounts_job_has_no_preload_zygote(made: dict[str, FakeStarter]) -> None:
    p, _ = pool(made)
    assert spawn(p, order(1, ["transformers"], account="alice")) == "forked by agent"
    assert made == {}


def test_ended_jobs_zygotes_are_closed_and_the_oldest_goes_past_the_bound(
    made: dict[str, FakeStarter],
) -> None:
    p, _ = pool(made, max_jobs=2)
    for job in (1, 2, 3):
        spawn(p, order(job, ["m"]))
    assert p.jobs() == [2, 3]
    wait_closed(made["job-1"])
    p.retain({3})
    assert p.jobs() == [3]
    wait_closed(made["job-2"])
    assert not made["job-3"].closed


def test_a_zygote_that_cannot_be_made_leaves_the_job_to_the_agents(
    made: dict[str, FakeStarter],
) -> None:
    calls: list[str] = []

    def refuse(name: str, modules: list[str], cwd: str, env: Mapping[str, str]) -> WarmStarter:
        calls.append(name)
        raise ValueError("socket path is too long for a Unix socket")

    default = FakeStarter("agent")
    default.ready = True
    p = WarmPool(cast(WarmStarter, default), refuse)
    assert spawn(p, order(1, ["m"])) == "forked by agent"
    assert spawn(p, order(1, ["m"])) == "forked by agent"
    assert calls == ["job-1"]  # not tried at every rank


def wait_closed(s: FakeStarter) -> None:
    """Closing runs in a thread (the agent's heartbeat must not wait for it)."""
    from trainpod.testing.wait import wait_until

    wait_until(lambda: s.closed, timeout_s=10, what=f"{s.name} closed")
