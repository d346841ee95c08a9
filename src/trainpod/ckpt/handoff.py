"""The checkpoint hand-off between a worker and its node's agent, and the tier recipe both use.

Under trainpod the agent owns persistence (see ``docs/decisions/0009``): the worker writes
and commits the node-local primary tier (shared memory) and its node leader hands the
committed step to the agent over the unix socket named by ``TRAINPOD_CKPT_SOCKET``; the
agent's persister process (:mod:`trainpod.ckpt.persist`) copies it on to scratch, peer and
durable. Both ends build their tiers from one :class:`TierConfig`, a plain JSON-able record,
so the agent needs no Python object of the worker's.

Wire format: one JSON object per ``SOCK_SEQPACKET`` message, one reply per request, then
the worker closes. Requests::

    {"op": "persist", "v": 1, "job_key", "node", "step", "job_id", "attempt_id", "stall_s",
     "bytes", "retry_base_s", "durable", "tiers": TierConfig}
                                                      -> {"ok": true} | {"ok": false, "error"}
    {"op": "status", "v": 1, "job_key", "node"}       -> {"ok": true, "status": PersistStatus}
    {"op": "tier_full", "v": 1, "job_key", "node", "step", "job_id", "attempt_id", "tier",
     "path", "reason", "needed", "free", "to", "error"}      -> {"ok": true} | {"ok": false, …}

``persist`` carries ``source`` (a tier name) when the step was written into a later tier
because the primary was full or unwritable (``tier_full`` says so first; docs/decisions/0036).

``persist`` is idempotent (the newest step wins; resending a step is harmless). ``durable``
says whether the step goes to the global tiers too: the workers decide it together in the
gather that commits the step (see :class:`trainpod.ckpt.persist.Persister`). Importing this
module is cheap (no torch, no fsspec until tiers are built).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainpod.ckpt.errors import CheckpointConfigError

SOCKET_ENV = "TRAINPOD_CKPT_SOCKET"
WIRE_VERSION = 1
MAX_MESSAGE = 65536

TYPE_CHECKING = False
if TYPE_CHECKING:
    from trainpod.ckpt.fullness import Full
    from trainpod.ckpt.layout import Layout
    from trainpod.ckpt.tiers import Tier


@dataclass(frozen=True)
class TierConfig:
    """Where one node's tiers of one job live; JSON-able (``to_dict``; the agent's side
    parses it with the hand-off request, see :func:`trainpod.ckpt.persistwire.parse_request`).

    Raises ``ValueError`` for an empty ``node`` or a ``peer_holder`` without a root."""

    node: str
    """The node whose part these tiers hold."""
    memory: str | None = None
    """Shared-memory tier root (the primary when set)."""
    scratch: str | None = None
    """Node scratch tier root (the primary when there is no memory tier)."""
    peer_holder: str | None = None
    """The node that keeps this node's peer copy; None: no peer tier."""
    peer_roots: dict[str, str] = field(default_factory=dict)
    """Node -> where it keeps the peer copies it holds."""
    durable: str = ""
    """Durable store: a local path or an fsspec URL; "" for none."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    keep: dict[str, int] = field(default_factory=dict)
    """Retention per tier name (missing names keep 2)."""
    bandwidth_bps: float | None = None
    """Cap on bytes/s copied to throttled tiers (peer, durable); None: unlimited."""
    reuse_files: bool = False
    """Copies into scratch, peer and a local durable store write over the files of the step
    they pruned (ADR 0056: the durable copy sooner; its cost to the loop not settled)."""

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("node must be a node name, got an empty string")
        if self.peer_holder is not None and self.peer_holder not in self.peer_roots:
            raise ValueError(
                f"peer_holder {self.peer_holder!r} is not in peer_roots {sorted(self.peer_roots)};"
                " name where it keeps peer copies, or leave peer_holder None"
            )

    @classmethod
    def of_layout(
        cls,
        layout: Layout,
        *,
        keep: Mapping[str, int],
        peer: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        bandwidth_bps: float | None = None,
        reuse_files: bool = False,
    ) -> TierConfig:
        holder = layout.peer_of(layout.node) if peer and layout.scratch_base is not None else None
        roots = {n: str(r) for n in layout.nodes if (r := layout.peer_root(n)) is not None}
        return cls(
            node=layout.node,
            memory=None if layout.memory is None else str(layout.memory),
            scratch=None if layout.scratch is None else str(layout.scratch),
            peer_holder=holder if holder in roots else None,
            peer_roots=roots if holder in roots else {},
            durable=layout.durable,
            storage_options=dict(storage_options or {}),
            keep=dict(keep),
            bandwidth_bps=bandwidth_bps,
            reuse_files=reuse_files,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PersistStatus:
    """Where one job's persister on one node stands. The persister sends it to its agent
    (``{"event": "status", "status": ...}`` on stdout), the agent to the worker (the reply to
    ``status``); each end parses it once on receipt. The default instance is "no status
    yet" (``{}`` on the wire)."""

    received: int | None = None
    """The newest step offered (node tiers)."""
    flagged: int | None = None
    """The newest step offered for the global tiers (``durable``)."""
    done_through: int | None = None
    """The newest step done in every tier it will reach."""
    global_busy: bool = False
    """Copying into the global tiers, or about to (the workers then flag no new step)."""
    committed: dict[str, int | None] = field(default_factory=dict)
    """Copy tier -> its newest committed step."""
    errors: dict[str, str] = field(default_factory=dict)
    """Tier (or "config") -> the last error, until that tier commits again."""
    copying_step: int | None = None
    copying_tier: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bps: float = 0.0
    retry_in_s: float | None = None
    """Seconds to the next retry of a failed global copy; None: none scheduled."""
    waiting_step: int | None = None
    """A step whose part is in the global tiers while other nodes' parts are not yet."""
    pid: int | None = None
    """The persister's process id."""
    steps_skipped: dict[str, int] = field(default_factory=dict)
    """Copy tier -> steps it never got because a newer one went instead (it was busy)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> PersistStatus:
        """Parse :meth:`to_dict`'s output (``{}``: the default). Unknown keys are ignored (a
        newer sender). Raises ``ValueError`` for a mistyped value. Plain Python on purpose:
        the worker parses it, and the worker does not import pydantic."""
        if not isinstance(d, dict):
            raise ValueError(f"a persister status is an object, got {type(d).__name__}")
        vals: dict[str, Any] = {}
        for key, v in d.items():
            rule = _STATUS_RULES.get(key)
            if rule is None:
                continue
            ok, want = rule
            if not ok(v):
                raise ValueError(f"persister status: {key} must be {want}, got {v!r}")
            vals[key] = float(v) if v is not None and key in _FLOATS else v
        return cls(**vals)


def _opt(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or ok(v)


def _is_int(v: object) -> bool:
    return type(v) is int  # not a bool


def _is_num(v: object) -> bool:
    return type(v) in (int, float)


def _is_map(value: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and value(x) for k, x in v.items())
    )


_STATUS_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "received": (_opt(_is_int), "an int or null"),
    "flagged": (_opt(_is_int), "an int or null"),
    "done_through": (_opt(_is_int), "an int or null"),
    "global_busy": (lambda v: type(v) is bool, "a bool"),
    "committed": (_is_map(_opt(_is_int)), "an object of steps (int or null)"),
    "errors": (_is_map(lambda v: isinstance(v, str)), "an object of strings"),
    "copying_step": (_opt(_is_int), "an int or null"),
    "copying_tier": (_opt(lambda v: isinstance(v, str)), "a string or null"),
    "bytes_done": (_is_int, "an int"),
    "bytes_total": (_is_int, "an int"),
    "rate_bps": (_is_num, "a number"),
    "retry_in_s": (_opt(_is_num), "a number or null"),
    "waiting_step": (_opt(_is_int), "an int or null"),
    "pid": (_opt(_is_int), "an int or null"),
    "steps_skipped": (_is_map(_is_int), "an object of ints"),
}
"""How :meth:`PersistStatus.from_dict` checks each field (a unit test keeps it complete)."""
_FLOATS = {"rate_bps", "retry_in_s"}


def build_tiers(cfg: TierConfig) -> list[Tier]:
    """memory → scratch → peer → durable, as far as ``cfg`` has them (fastest first).

    Raises :class:`CheckpointConfigError` when the durable URL has no usable fsspec backend.
    """
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # no type hints

    from trainpod.ckpt.tiers import FsTier, PeerTier

    def keep(name: str) -> int:
        return cfg.keep.get(name, 2)

    tiers: list[Tier] = []
    if cfg.memory is not None:
        tiers.append(
            FsTier(
                "memory", cfg.memory, node=cfg.node, keep=keep("memory"), sync=False, prealloc=True
            )
        )
    if cfg.scratch is not None:
        tiers.append(
            FsTier(
                "scratch", cfg.scratch, node=cfg.node, keep=keep("scratch"), reuse=cfg.reuse_files
            )
        )
    if cfg.peer_holder is not None:
        roots = {n: Path(r) for n, r in cfg.peer_roots.items()}
        tiers.append(
            PeerTier(cfg.node, cfg.peer_holder, roots, keep=keep("peer"), reuse=cfg.reuse_files)
        )
    if cfg.durable:
        try:
            fs, path = url_to_fs(cfg.durable, **cfg.storage_options)
        except (ImportError, ValueError) as exc:
            raise CheckpointConfigError(
                f"durable store {cfg.durable!r}: {exc}; install its fsspec backend "
                "(s3fs for s3://) or pass dir= a local path"
            ) from exc
        tiers.append(
            FsTier(
                "durable",
                path,
                fs=fs,
                keep=keep("durable"),
                throttled=True,
                retry=True,
                reuse=cfg.reuse_files,
            )
        )
    return tiers


class AgentLink:
    """The worker's end of the hand-off socket. Thread-safe; every call blocks at most
    ``timeout_s`` and never raises (None: the agent did not answer)."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentLink | None:
        path = (os.environ if env is None else env).get(SOCKET_ENV, "")
        return cls(path) if path else None

    def request(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request, return the reply (a dict), or None on any failure."""
        data = json.dumps({"v": WIRE_VERSION, **msg}, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.path)
            sock.send(data)
            reply = json.loads(sock.recv(MAX_MESSAGE).decode() or "null")
        except (OSError, ValueError):
            return None
        finally:
            sock.close()
        return reply if isinstance(reply, dict) else None

    def status(self, job_key: str, node: str) -> PersistStatus | None:
        """The persister's status for this job and node (the default one when it has none
        yet); None when the agent does not answer, or answers what this worker cannot read."""
        reply = self.request({"op": "status", "job_key": job_key, "node": node})
        if reply is None or not reply.get("ok"):
            return None
        try:
            return PersistStatus.from_dict(reply.get("status") or {})
        except ValueError:
            return None


class AgentPersistence:
    """A worker's hand-off of one job's committed steps to its node's agent.

    ``handoff`` (node leader, writer thread) tells the agent about a step committed in the
    primary tier; ``resend`` repeats the newest one (idempotent); ``status`` reads back what
    the agent's persister did. Thread-safe; never raises; blocks at most the link timeout.
    """

    def __init__(
        self,
        link: AgentLink,
        *,
        job_key: str,
        node: str,
        config: TierConfig,
        job_id: int | None,
        attempt_id: int | None,
        retry_base_s: float = 1.0,
    ) -> None:
        self.link = link
        self.job_key = job_key
        self.node = node
        self.config = config
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.retry_base_s = retry_base_s
        self._last: dict[str, Any] | None = None

    def handoff(
        self,
        step: int,
        stall_s: float | None,
        nbytes: int,
        durable: bool = True,
        *,
        source: str | None = None,
    ) -> bool:
        """True when the agent accepted the step (it persists it from then on); ``durable``:
        to the global tiers too (decided by all ranks together); ``source``: the tier it was
        written into when not the primary (which was full: see :meth:`tier_full`)."""
        msg = {
            "op": "persist",
            "job_key": self.job_key,
            "node": self.node,
            "step": step,
            "job_id": self.job_id,
            "attempt_id": self.attempt_id,
            "stall_s": stall_s,
            "bytes": nbytes,
            "retry_base_s": self.retry_base_s,
            "durable": durable,
            "tiers": self.config.to_dict(),
        }
        if source is not None:
            msg["source"] = source
        if self._last is None or step >= self._last["step"]:
            self._last = msg
        reply = self.link.request(msg)
        return bool(reply and reply.get("ok"))

    def tier_full(self, step: int, full: Full, to: str | None, error: str | None) -> bool:
        """Tell the agent that ``full.tier`` could not take ``step`` on this node, and where
        the step went (``to``; None: nowhere, ``error`` says why). True when it answered."""
        reply = self.link.request(
            {
                "op": "tier_full",
                "job_key": self.job_key,
                "node": self.node,
                "step": step,
                "job_id": self.job_id,
                "attempt_id": self.attempt_id,
                "tier": full.tier,
                "path": full.path,
                "reason": full.reason,
                "needed": full.needed,
                "free": full.free,
                "to": to,
                "error": (error or "")[:4000],
            }
        )
        return bool(reply and reply.get("ok"))

    def resend(self) -> bool:
        """Hand the newest step over again, for every tier (``wait()`` and ``close()``: every
        node's leader does it, so the nodes agree on the step)."""
        last = self._last
        if last is None:
            return False
        reply = self.link.request({**last, "durable": True})
        return bool(reply and reply.get("ok"))

    def global_idle(self) -> bool:
        """Whether this node's persister is free to start on a new step for the global tiers
        (True when it cannot be asked: the step is then still handed over)."""
        st = self.status()
        return st is None or not st.global_busy

    def status(self) -> PersistStatus | None:
        return self.link.status(self.job_key, self.node)


def env_int(name: str, env: Mapping[str, str] | None = None) -> int | None:
    try:
        return int((os.environ if env is None else env).get(name, ""))
    except ValueError:
        return None
