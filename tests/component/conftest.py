"""A real Controller on a real SQLite file, a fake clock and fake agents, stepped by hand."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from trainpod.api.app import create_app
from trainpod.api.models import ClusterInfo, EventInfo, JobInfo, NodeInfo, Orders
from trainpod.controller.config import ControllerConfig
from trainpod.controller.core import Controller
from trainpod.controller.external import Scheduling
from trainpod.controller.ports import free_port
from trainpod.controller.repair import Replacer
from trainpod.controller.transitions import Transitions
from trainpod.scheduler.base import Scheduler
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config
from trainpod.testing.wait import wait_until

PORT = 29500
ADMIN_TOKEN = "admin-secret"
AGENT_TOKEN = "agent-secret"


class Cluster:
    """One controller and an agent per compute node; nothing happens until a test acts."""

    def __init__(
        self,
        cfg: ControllerConfig,
        db: Path,
        clock: FakeClock,
        replacer: Replacer | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.cfg = cfg
        self.db = db
        self.clock = clock
        self.replacer = replacer  # replaces nodes like new instances; None: cannot
        self.scheduler = scheduler  # None: the embedded FIFO
        self.controller = self._start()
        self.agents = {d.name: FakeAgent(self.controller, d.name) for d in cfg.nodes}

    def _start(self) -> Controller:
        controller = Controller(
            Store.open(self.db),
            self.cfg,
            clock=self.clock,
            ports=_port,
            replacer=self.replacer,
            scheduling=self._scheduling,
        )
        controller.bootstrap()
        return controller

    def _scheduling(self, store: Store, cfg: ControllerConfig, tx: Transitions) -> Scheduling:
        return Scheduling(store, cfg, tx, self.scheduler)

    def restart_controller(self, replacer: Replacer | None = None) -> Controller:
        """Close the store as a dying controller would, start a fresh one on the same file
        (with ``replacer``, one whose backend can replace nodes)."""
        self.controller.store.close()
        self.replacer = replacer or self.replacer
        self.controller = self._start()
        for agent in self.agents.values():
            agent.controller = self.controller
        return self.controller

    def close(self) -> None:
        self.controller.store.close()

    # -- serving ----------------------------------------------------------------------------
    def app(self) -> FastAPI:
        """The controller's real HTTP app, with the operator's and the agents' tokens
        (``ADMIN_TOKEN``, ``AGENT_TOKEN``) and this cluster's facts for ``/v1/cluster``."""
        return create_app(
            self.controller, admin_token=ADMIN_TOKEN, agent_token=AGENT_TOKEN, info=self.info
        )

    def info(self) -> ClusterInfo:
        nodes, jobs = self.controller.counts()
        return ClusterInfo(
            name=self.cfg.cluster,
            backend=self.cfg.backend,
            controller_pid=1,
            started_at=self.controller.started_at,
            nodes=nodes,
            jobs=jobs,
            partitions=self.cfg.partitions,
            shared_dir=str(self.cfg.shared_dir),
            scratch_root=str(self.cfg.scratch_root),
            checkpoint_uri=self.cfg.checkpoint_uri,
        )

    # -- acting ---------------------------------------------------------------------------
    def up(self, *names: str) -> None:
        """Register the agents (default: all) with their lifecycle done."""
        for name in names or self.agents:
            self.agents[name].beat()

    def beat(self, *names: str) -> dict[str, Orders]:
        return {name: self.agents[name].beat() for name in names or self.agents}

    def submit(self, nodes: int = 2, procs: int | None = 2, **kw: Any) -> int:
        spec = JobSpec(command=["python", "train.py"], nodes=nodes, procs_per_node=procs, **kw)
        return self.controller.submit(spec)

    def start(self, job_id: int) -> int:
        """Step, let every node of the job's attempt start its ranks and report them.

        Returns the attempt id.
        """
        self.controller.step()
        attempt = self.attempt_id(job_id)
        for name in self.job(job_id).attempts[-1].nodes:
            agent = self.agents[name]
            agent.start_ranks(agent.beat())
            agent.beat()
        return attempt

    # -- looking ----------------------------------------------------------------------------
    def attempt_id(self, job_id: int) -> int:
        return self.controller.store.attempts(job_id)[-1].id

    def job(self, job_id: int) -> JobInfo:
        return self.controller.job_info(job_id)

    def node(self, name: str) -> NodeInfo:
        return next(n for n in self.controller.node_infos() if n.name == name)

    def node_states(self) -> dict[str, str]:
        return {n.name: n.state for n in self.controller.node_infos()}

    def events(self, kind: str | None = None, **match: Any) -> list[EventInfo]:
        return [
            e
            for e in self.controller.event_infos()
            if (kind is None or e.kind == kind)
            and all(getattr(e, k, e.data.get(k)) == v for k, v in match.items())
        ]


def issue_tokens(http: TestClient, *users: str) -> dict[str, str]:
    """Each user's bearer token, issued by the operator through ``POST /v1/users``."""
    tokens = {}
    for name in users:
        r = http.post("/v1/users", json={"name": name}, headers=bearer(ADMIN_TOKEN))
        assert r.status_code == 201, r.text
        tokens[name] = str(r.json()["token"])
    return tokens


@contextmanager
def serve(c: Cluster, timeout_s: float = 20.0) -> Iterator[str]:
    """The cluster's controller behind a real HTTP server (uvicorn on a free loopback port,
    ADMIN_TOKEN and AGENT_TOKEN); yields its URL."""

    def info() -> ClusterInfo:
        raise AssertionError("not used")

    app = create_app(c.controller, admin_token=ADMIN_TOKEN, agent_token=AGENT_TOKEN, info=info)
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout_s=timeout_s, what="the API server started")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _port(host: str) -> int:
    return PORT


MakeCluster = Callable[..., Cluster]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    made: list[Cluster] = []

    def make(
        groups: Sequence[FakeGroup | tuple[str, int]] = (FakeGroup("workers", 2),),
        scheduler: Scheduler | None = None,
        **kw: Any,
    ) -> Cluster:
        root = tmp_path / f"cluster-{len(made)}"
        cfg = make_config(root, groups=groups, **kw)
        root.mkdir()
        cluster = Cluster(cfg, root / "state.db", FakeClock(), scheduler=scheduler)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> Cluster:
    """Two 2-device workers, both registered and idle."""
    c = make_cluster()
    c.up()
    return c


from .healing import make_healing_cluster  # noqa: E402,F401  (fixture `make`)
