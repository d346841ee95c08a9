"""A real controller process on a local port, with no agents: what the API fuzz runs against.

Its nodes are declared by the spec but never join, so a job the fuzz submits waits in the
queue and nothing fuzzed is ever run as a command on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from trainpod.backends.local import CONTROLLER, LocalBackend
from trainpod.backends.procs import is_ours, read_pid
from trainpod.paths import ClusterPaths, read_secret
from trainpod.spec.loading import load_cluster_spec

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 2
teams:
  - name: vision
    quota: {{default: 2}}
users:
  - {{name: alice, team: vision}}
  - {{name: bob, team: vision}}
health:  # no agent ever beats: nothing times out (nor an allocation's lease) while fuzzed
  heartbeat_timeout_s: 3600
"""


class ControllerOnly(LocalBackend):
    """The local backend without its agents (this process never starts one)."""

    def _spawn_agent(self, node: str, gpus: list[str]) -> None:
        return None


@dataclass
class Controller:
    url: str
    paths: ClusterPaths
    tokens: dict[str, str | None]
    """kind -> token: admin, user (alice), agent, none (no token)."""

    @property
    def admin(self) -> str:
        token = self.tokens["admin"]
        assert token is not None
        return token

    def alive(self) -> bool:
        return is_ours(read_pid(self.paths.pid_file(CONTROLLER)), str(self.paths.state_dir))


@contextmanager
def controller(tmp: Path, name: str = "fuzz") -> Iterator[Controller]:
    """A controller of its own under ``$TRAINPOD_HOME`` (set by the caller), deleted after."""
    spec_path = tmp / f"{name}.yaml"
    spec_path.write_text(SPEC.format(name=name))
    paths = ClusterPaths.of(name)
    backend = ControllerOnly(paths)
    record = backend.create(load_cluster_spec(spec_path), spec_path)
    try:
        admin = read_secret(paths.admin_token)
        with httpx.Client(base_url=record.url, timeout=20) as http:
            headers = {"Authorization": f"Bearer {admin}"}
            r = http.post("/v1/users", json={"name": "alice"}, headers=headers)
            r.raise_for_status()
            alice = str(r.json()["token"])
            # A job of alice's and one of the admin's, so that fuzzed job ids find some.
            job = {"command": ["true"], "workdir": str(tmp)}
            for token in (alice, admin):
                r = http.post("/v1/jobs", json=job, headers={"Authorization": f"Bearer {token}"})
                r.raise_for_status()
        tokens = {
            "admin": admin,
            "user": alice,
            "agent": read_secret(paths.agent_token),
            "none": None,
        }
        yield Controller(record.url, paths, tokens)
    finally:
        backend.delete(purge=True)
