"""Where a cluster keeps its state on this machine, and the record that describes it.

``$TRAINPOD_HOME`` (default ``~/.trainpod``) holds one state dir per cluster under
``clusters/<name>/``; defaults for the shared dir and node scratch live beside it, so
deleting a cluster's state never touches its shared dir unless asked to.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainpod.errors import NotFound

STATE_DIR_ENV = "TRAINPOD_STATE_DIR"
"""The cluster's state dir, in the environment of every process a local cluster starts (its
workers included: the agent passes it on explicitly), so a delete finds them all
(:func:`trainpod.backends.procs.sweep`)."""


def trainpod_home() -> Path:
    return Path(os.environ.get("TRAINPOD_HOME") or Path.home() / ".trainpod").absolute()


@dataclass(frozen=True)
class ClusterPaths:
    home: Path
    name: str

    @classmethod
    def of(cls, name: str, home: Path | None = None) -> ClusterPaths:
        return cls(home or trainpod_home(), name)

    @property
    def state_dir(self) -> Path:
        return self.home / "clusters" / self.name

    @property
    def record(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def db(self) -> Path:
        return self.state_dir / "controller.db"

    @property
    def backups(self) -> Path:
        """``trainpod cluster backup``'s default folder (ADR 0034)."""
        return self.state_dir / "backups"

    @property
    def admin_token(self) -> Path:
        return self.state_dir / "admin.token"

    @property
    def agent_token(self) -> Path:
        return self.state_dir / "agent.token"

    @property
    def scrape_token(self) -> Path:
        """Prometheus' read-only token: ``/metrics`` only (made by the controller)."""
        return self.state_dir / "scrape.token"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pids(self) -> Path:
        return self.state_dir / "pids"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def pid_file(self, proc: str) -> Path:
        return self.pids / f"{proc}.pid"

    def log_file(self, proc: str) -> Path:
        return self.logs / f"{proc}.log"

    @property
    def runtime_dir(self) -> Path:
        """A short per-cluster dir for unix sockets (their paths must stay under 108 bytes)."""
        digest = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"trainpod-{digest}"

    @property
    def default_shared_dir(self) -> Path:
        return self.home / "shared" / self.name

    @property
    def default_scratch_root(self) -> Path:
        return self.home / "scratch" / self.name


class ClusterRecord(BaseModel):
    """``cluster.json``: everything needed to (re)start a cluster's processes."""

    model_config = ConfigDict(extra="forbid")

    name: str
    backend: str
    spec: dict[str, Any]
    spec_path: str
    host: str
    port: int
    created_at: float
    shared_dir: str
    scratch_root: str
    checkpoint_uri: str
    env: dict[str, str] = {}
    """Environment the cluster's processes need (Slurm: ``SLURM_CONF``)."""
    advertise: str | None = None
    """The host clients and agents connect to; None: ``host`` (ADR 0040)."""
    ca_file: str | None = None
    """Set when the controller serves HTTPS: what every client verifies it against (the
    spec's ``controller.tls.ca``, else its self-signed certificate)."""
    insecure: bool = False
    """``cluster create --insecure``: plain HTTP off loopback, on purpose."""

    @property
    def url(self) -> str:
        host = self.advertise or self.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.ca_file else 'http'}://{host}:{self.port}"

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, paths: ClusterPaths) -> ClusterRecord:
        if not paths.record.exists():
            raise NotFound(
                f"no cluster named {paths.name!r} under {paths.home}; "
                "see `trainpod cluster list`, or create one with `trainpod cluster create -f`"
            )
        return cls.model_validate_json(paths.record.read_text())


def write_secret(path: Path) -> str:
    """Create a fresh token file readable by its owner only (0600); return the token."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)
    return token


def read_secret(path: Path) -> str:
    return path.read_text().strip()
