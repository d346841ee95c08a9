"""Where each tier lives: resolved once from explicit arguments, else trainpod's environment.

Explicit arguments always win over the environment. Under trainpod a worker gets
``TRAINPOD_CHECKPOINT_URI`` / ``TRAINPOD_CHECKPOINT_DIR`` (durable, per job),
``TRAINPOD_SCRATCH_DIR`` / ``TRAINPOD_JOB_SCRATCH_DIR`` (node-local NVMe), ``TRAINPOD_NODE``,
``TRAINPOD_NODES``, ``TRAINPOD_JOB_ID`` and ``TRAINPOD_ATTEMPT``. Outside trainpod only the
durable location is needed (``Checkpointer(dir=...)``); the node is the host name.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainpod.ckpt.errors import CheckpointConfigError
from trainpod.mtbf import DEFAULT_MTBF_S as DEFAULT_MTBF_S
from trainpod.mtbf import mtbf_is_prior as mtbf_is_prior
from trainpod.mtbf import mtbf_s as mtbf_s
from trainpod.mtbf import young_daly_s as young_daly_s

SHM_ROOT = Path("/dev/shm")
SCRATCH_TIER = "ckpt"
"""The scratch tier's dir inside a job's scratch dir on a node."""
PEER_TIER = "ckpt-peer"
"""Where a node holds its peers' copies, inside its own scratch dir of the job."""


@dataclass(frozen=True)
class Layout:
    """The resolved locations of one rank's tiers (no I/O happens when building it)."""

    node: str
    """This rank's node (``TRAINPOD_NODE``; the host name outside trainpod)."""
    nodes: tuple[str, ...]
    """Every node of the job, in ``TRAINPOD_NODES`` order (the peer of a node is the next one)."""
    job_key: str
    """Names this job's directories: ``job-<id>-<hash of durable>`` under trainpod, else
    ``dir-<hash of durable>``."""
    attempt: int
    """``TRAINPOD_ATTEMPT`` (1 outside trainpod)."""
    durable: str
    """The durable store: a local path or an fsspec URL (``file://``, ``s3://``, ``memory://``)."""
    memory: Path | None
    """This node's shared-memory tier root; None when disabled."""
    scratch: Path | None
    """This node's scratch tier root; None outside trainpod unless given."""
    scratch_base: Path | None
    """The directory holding every node's scratch dir (local backend), for the peer tier."""
    job_scratch_name: str
    """Name of the per-job dir inside a node's scratch dir (``job-<id>``)."""
    managed: bool = False
    """Run by trainpod (``TRAINPOD_JOB_ID`` set): the node's agent removes the memory tier when
    the job ends. Outside trainpod nobody does, so :meth:`Checkpointer.close` does."""

    def peer_of(self, node: str, nodes: tuple[str, ...] | None = None) -> str | None:
        """The node that holds ``node``'s peer copy: the next one in ``nodes`` (None if alone)."""
        ring = nodes if nodes is not None else self.nodes
        if node not in ring or len(ring) < 2:
            return None
        return ring[(ring.index(node) + 1) % len(ring)]

    def peer_root(self, holder: str) -> Path | None:
        """Where node ``holder`` keeps the peer copies it holds for other nodes."""
        if self.scratch_base is None:
            return None
        return self.scratch_base / holder / self.job_scratch_name / PEER_TIER


def resolve(
    dir: str | os.PathLike[str] | None,
    *,
    memory: bool | str | os.PathLike[str] = True,
    scratch_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    require_durable: bool = True,
) -> Layout:
    """Build the :class:`Layout` of this rank. Pure apart from reading ``env`` (``os.environ``).

    Raises :class:`CheckpointConfigError` when no durable location is known and
    ``require_durable``.
    """
    env = os.environ if env is None else env
    if dir is not None:
        durable = os.fspath(dir)
    else:
        durable = env.get("TRAINPOD_CHECKPOINT_DIR") or env.get("TRAINPOD_CHECKPOINT_URI") or ""
    if not durable and require_durable:
        raise CheckpointConfigError(
            "no checkpoint location: got neither dir= nor TRAINPOD_CHECKPOINT_DIR/"
            "TRAINPOD_CHECKPOINT_URI; pass Checkpointer(dir='/path/or/url') outside trainpod"
        )
    if durable and "://" not in durable:
        durable = os.path.abspath(durable)
    elif durable.startswith("file://"):
        durable = durable[len("file://") :]
    # Job ids restart at 1 in every cluster, and /dev/shm is shared by all clusters on a host:
    # the cluster's identity and the durable location go into the key too.
    job_id = env.get("TRAINPOD_JOB_ID", "")
    cluster = env.get("TRAINPOD_CLUSTER_ID", "")
    digest = hashlib.sha256(f"{cluster}|{durable}".encode()).hexdigest()
    job_key = f"job-{job_id}-{digest[:8]}" if job_id else f"dir-{digest[:12]}"
    node = env.get("TRAINPOD_NODE") or socket.gethostname()
    nodes = tuple(n for n in env.get("TRAINPOD_NODES", "").split(",") if n) or (node,)
    if node not in nodes:
        nodes = (*nodes, node)
    try:
        attempt = int(env.get("TRAINPOD_ATTEMPT", "1"))
    except ValueError:
        attempt = 1

    mem: Path | None = None
    if memory is True:
        base = SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir()) / "trainpod-shm"
        mem = base / "trainpod" / job_key / node
    elif memory is not False:
        mem = Path(os.fspath(memory)).absolute() / job_key / node

    # Every node's scratch dir sits in one base dir: <base>/<node>/<job>/ (trainpod's local
    # backend layout); the peer tier finds the other nodes' dirs there.
    scratch: Path | None = None
    scratch_base: Path | None = None
    job_scratch = env.get("TRAINPOD_JOB_SCRATCH_DIR", "")
    node_scratch = env.get("TRAINPOD_SCRATCH_DIR", "")
    job_scratch_name = job_key
    if scratch_dir is not None:
        scratch_base = Path(os.fspath(scratch_dir)).absolute()
        scratch = scratch_base / node / job_key / SCRATCH_TIER
    elif job_scratch:
        scratch = Path(job_scratch) / SCRATCH_TIER
        job_scratch_name = Path(job_scratch).name
        base = Path(node_scratch) if node_scratch else Path(job_scratch).parent
        scratch_base = base.parent
    elif node_scratch:
        scratch = Path(node_scratch) / job_key / SCRATCH_TIER
        scratch_base = Path(node_scratch).parent
    return Layout(
        node=node,
        nodes=nodes,
        job_key=job_key,
        attempt=attempt,
        durable=durable,
        memory=mem,
        scratch=scratch,
        scratch_base=scratch_base,
        job_scratch_name=job_scratch_name,
        managed=bool(job_id),
    )


def job_scratch_dir(node_scratch: Path, job_id: int) -> Path:
    """A trainpod job's scratch dir on a node whose scratch dir is ``node_scratch`` (the
    agent makes it for the job's ranks and gives it them as ``TRAINPOD_JOB_SCRATCH_DIR``)."""
    return node_scratch / f"job-{job_id}"


def private_dir(path: Path) -> Path:
    """Make ``path`` a directory only this process's user may enter (mode 0700, whatever the
    umask), its parents as they come. A job's memory tier holds its weights in RAM under a
    base every account shares (``/dev/shm/trainpod``, mode 1777): another account must not read
    it, nor make the directory first to deny or watch it. Raises
    :class:`CheckpointConfigError` for one that is not this user's own directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise CheckpointConfigError(
            f"{path} is {what} of uid {st.st_uid}, not of this process (uid {me}): another "
            "account made it first; have an admin remove it, or pass Checkpointer(memory=...) "
            "a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path
