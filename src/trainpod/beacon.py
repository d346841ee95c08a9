"""Progress beacons: the cheap channel from a training process to its node's agent.

A training script calls :func:`report` once per step (and :func:`heartbeat` during long
phases without steps). Each call sends one message over the Unix socket named by
``TRAINPOD_BEACON_SOCKET``; the agent uses them for hang and straggler detection, goodput and
metrics. There is no reply and no HTTP.

The socket is ``SOCK_SEQPACKET``: message boundaries like a datagram socket (one call, one
message, never split or merged), but connected, so each process gets its own kernel buffer
(~the socket send buffer, a few hundred messages). A ``SOCK_DGRAM`` receiver holds only
``net.unix.max_dgram_qlen`` messages (10 by default) for *all* senders together, which drops
bursts whenever the agent's receiver thread is descheduled for a millisecond.

Contract:

* Never blocks, never raises. A missing socket, a full buffer (``EAGAIN``) or a gone agent
  drops the message and counts it (:func:`stats`); after an error the connection is retried
  at most once a second. Anything else that goes wrong (a step that is not an integer, a
  metric whose ``__float__`` raises) drops the message too, and counts in ``errors``.
  Additive counters of a dropped report (``tokens``, ``checkpoint_stall_s``) and its
  ``checkpoint_step`` are carried into the next report that gets through, so totals survive
  drops.
* Outside trainpod (``TRAINPOD_BEACON_SOCKET`` or ``TRAINPOD_ATTEMPT_ID`` unset) every call is
  a no-op: the environment is read once, on the first call; :func:`reset` reads it again.
* Fork-safe: a child forked with ``os.fork`` (or ``multiprocessing``) opens its own
  connection. Concurrent calls from threads never corrupt a message; the counters may then be
  approximate.
* Importing this module is cheap: stdlib ``os`` and ``time`` only; ``json`` and ``socket``
  are imported on the first call inside trainpod.

Wire format (one message, UTF-8 compact JSON object; unknown keys are ignored)::

    {"v":1,"a":<attempt id>,"r":<rank>,"s":<step>,"t":<sender time.time()>,"m":{...}}

``"v"`` is the wire version (a receiver ignores versions it does not know), ``"s"`` is absent
in a heartbeat, ``"m"`` when there are no metrics. Metric keys the agent understands:
``checkpoint_step`` (a checkpoint covering this step was written), ``checkpoint_stall_s``
(seconds the loop was blocked saving), ``tokens`` (tokens processed in this step),
``generation`` (the in-process recovery generation whose process group the rank joined, sent
by :func:`trainpod.elastic.run` after every join, ADR 0035, with ``collective_timeout_s``, its
group's collective timeout), ``lost_generation`` (the generation whose group the rank lost: a
collective failed or timed out, and it waits for the next; a hung peer is told apart from
the ranks waiting for it by this, ADR 0026); every
other number (``loss=...``) is plotted as ``metrics/<name>`` in the job's TensorBoard logdir
(ADR 0021; rank 0's reports, at most 64 names per attempt). Values
that JSON cannot carry (a tensor, a NumPy float32) are sent as ``float()`` of them, else as
``str()``. Keep a message well under 64 KiB.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing would cost ~20 ms here
if TYPE_CHECKING:
    from typing import Any

__all__ = ["BeaconStats", "heartbeat", "report", "reset", "stats"]

SOCKET_ENV = "TRAINPOD_BEACON_SOCKET"
ATTEMPT_ENV = "TRAINPOD_ATTEMPT_ID"
RANK_ENV = "RANK"
WIRE_VERSION = 1

# Keys summed (or, for checkpoint_step, maxed) into the next message when one is dropped.
_ADDITIVE = ("tokens", "checkpoint_stall_s")
_RECONNECT_EVERY_S = 1.0  # how often a sender retries connect() while the agent is away


class BeaconStats:
    """Counters of this process since the last :func:`reset` (or fork). Plain class, not a
    dataclass or NamedTuple, to keep ``dataclasses``/``typing`` out of the import.

    ``errors``: the dropped messages (counted in ``dropped`` too) whose failure was not the
    socket's, but an unexpected exception the never-raises contract swallowed."""

    __slots__ = ("dropped", "errors", "sent")

    def __init__(self, sent: int, dropped: int, errors: int = 0) -> None:
        self.sent = sent
        self.dropped = dropped
        self.errors = errors

    def __repr__(self) -> str:
        return f"BeaconStats(sent={self.sent}, dropped={self.dropped}, errors={self.errors})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BeaconStats):
            return NotImplemented
        return (self.sent, self.dropped, self.errors) == (other.sent, other.dropped, other.errors)

    __hash__ = None  # type: ignore[assignment]  # mutable value object, like a dataclass


# Module state. ``_enabled`` is None until the environment has been read.
_enabled: bool | None = None
_prefix = ""  # '{"v":1,"a":7,"r":0'
_path = ""
_sock: Any = None  # socket.socket once connected; Any keeps socket out of import time
_next_connect = 0.0
_MSG_NOSIGNAL = 0
_encode: Any = None  # json.JSONEncoder(...).encode
_carry: dict[str, float] = {}
_sent = 0
_dropped = 0
_errors = 0


def report(step: int, **metrics: float | int | str | bool) -> None:
    """Tell the agent that ``step`` finished, with optional metrics. Never blocks or raises.

    ``step`` is the number of the step just completed (any integer, normally increasing).
    """
    if _enabled is False:
        return
    if _enabled is None and not _configure():
        return
    _send(step, metrics)


def heartbeat(**metrics: float | int | str | bool) -> None:
    """Tell the agent "alive, no step finished" (long steps, evaluation, checkpointing),
    with optional metrics (``generation=``: see the module's docstring)."""
    if _enabled is False:
        return
    if _enabled is None and not _configure():
        return
    _send(None, metrics or None)


def stats() -> BeaconStats:
    """How many messages this process sent and dropped."""
    return BeaconStats(_sent, _dropped, _errors)


def reset() -> None:
    """Forget the cached environment, socket and counters; the next call reads the env again.

    For tests and for programs that change ``TRAINPOD_*`` variables after the first call.
    """
    global _enabled, _sent, _dropped, _errors
    _close_socket()
    _enabled = None
    _sent = _dropped = _errors = 0
    _carry.clear()


def _configure() -> bool:
    """Read the environment once; import json and socket only when beacons are on."""
    global _enabled, _prefix, _path, _encode
    path = os.environ.get(SOCKET_ENV, "")
    try:
        attempt = int(os.environ[ATTEMPT_ENV])
        rank = int(os.environ.get(RANK_ENV, "0"))
    except (KeyError, ValueError):
        path = ""
    if not path:
        _enabled = False
        return False
    import json

    _encode = json.JSONEncoder(separators=(",", ":"), default=_jsonable).encode
    _prefix = f'{{"v":{WIRE_VERSION},"a":{attempt},"r":{rank}'
    _path = path
    _enabled = True
    return True


def _jsonable(value: object) -> object:
    """JSON fallback for metric values: float() of tensors and NumPy scalars, else str()."""
    try:
        return float(value)  # type: ignore[arg-type]  # any __float__ will do; else str()
    except (TypeError, ValueError):
        return str(value)


def _send(step: int | None, metrics: dict[str, Any] | None) -> None:
    global _sent, _dropped, _errors
    try:
        if _carry and metrics is not None:
            metrics = _merge_carry(metrics)
        head = _prefix if step is None else f'{_prefix},"s":{int(step)}'
        if metrics:
            data = f'{head},"t":{time.time()!r},"m":{_encode(metrics)}}}'
        else:
            data = f'{head},"t":{time.time()!r}}}'
        sock = _sock if _sock is not None else _connect()
        if sock is not None:
            sock.send(data.encode(), _MSG_NOSIGNAL)
            _sent += 1
            return
    except BlockingIOError:
        pass  # our buffer is full: the agent is behind; keep the connection
    except OSError as exc:
        import errno

        # EPIPE, ECONNRESET...: the agent went away (it may come back: reconnect later).
        if exc.errno != errno.EMSGSIZE:
            _close_socket()
    except Exception:
        # A beacon must never raise into the training loop: int(step) of a non-number, a
        # metric whose __float__ or __str__ raises, a bug here. Drop the message and count
        # it, so a job whose beacons all fail shows it in stats() (and later in metrics).
        _errors += 1
    _dropped += 1
    if metrics:
        _stash_carry(metrics)


def _connect() -> Any:
    """A connected non-blocking socket, or None (tried at most once a second)."""
    global _sock, _next_connect, _MSG_NOSIGNAL
    now = time.monotonic()
    if now < _next_connect:
        return None
    _next_connect = now + _RECONNECT_EVERY_S
    import socket

    # EPIPE instead of SIGPIPE even when the program restored the default SIGPIPE handler.
    _MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.setblocking(False)  # connect() fails with EAGAIN rather than wait on a full backlog
        sock.connect(_path)
    except OSError:
        sock.close()
        return None
    _sock = sock
    return sock


def _close_socket() -> None:
    global _sock, _next_connect
    sock, _sock = _sock, None
    _next_connect = 0.0
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


def _stash_carry(metrics: dict[str, Any]) -> None:
    for key in _ADDITIVE:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _carry[key] = value  # already includes any earlier carry (see _merge_carry)
    ckpt = metrics.get("checkpoint_step")
    if isinstance(ckpt, int) and not isinstance(ckpt, bool):
        _carry["checkpoint_step"] = ckpt


def _merge_carry(metrics: dict[str, Any]) -> dict[str, Any]:
    merged = dict(metrics)
    for key in _ADDITIVE:
        if key in _carry:
            value = merged.get(key, 0)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = value + _carry[key]
    if "checkpoint_step" in _carry:
        ckpt = merged.get("checkpoint_step")
        if not isinstance(ckpt, int) or ckpt < _carry["checkpoint_step"]:
            merged["checkpoint_step"] = int(_carry["checkpoint_step"])
    _carry.clear()
    return merged


def _after_fork_in_child() -> None:
    # The child shares the parent's connection: close its copy (the parent's stays open) so
    # that its messages go over a connection of its own; its counters start at zero.
    global _sent, _dropped, _errors
    _close_socket()
    _sent = _dropped = _errors = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
