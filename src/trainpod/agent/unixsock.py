"""Listening on a unix SOCK_SEQPACKET socket the agent owns (beacons, checkpoint hand-offs).

:func:`bind_seqpacket` makes the listener; :class:`SeqpacketServer` serves it from a thread.

Every accepted connection's peer is checked with ``SO_PEERCRED`` (the kernel's word for the
connecting process's uid, not something the peer sends): the server's main socket admits only
root and the agent's own user; a socket added with :meth:`SeqpacketServer.add_listener` for a
POSIX account (the ranks of a job that runs as that account) admits root, the agent and that
account. Any other peer is refused, the reason logged, and counted in ``refused``. What a
peer may then say (whose attempt, whose job) is the callback's to check: it gets the uid.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainpod.errors import Conflict, Fatal

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix socket, as the
    kernel recorded them when it connected (``SO_PEERCRED``)."""
    pid, uid, gid = _UCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return pid, uid, gid


def trusted_uids() -> frozenset[int]:
    """Who may connect to every socket of the agent: root and the agent's own user."""
    return frozenset({0, os.geteuid()})


def is_live(path: Path) -> bool:
    """Whether some process still listens on the socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    else:
        return True
    finally:
        probe.close()


def bind_seqpacket(path: Path, mode: int, *, what: str, backlog: int) -> socket.socket:
    """A non-blocking listener at ``path`` (file mode ``mode``). A stale socket file is
    replaced; a live one (another agent) or a non-socket file is refused with the fix."""
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise Fatal(
            f"{what} socket path {str(path)!r} is {size} bytes, over the {UNIX_PATH_MAX}-byte"
            " limit of unix sockets; use a shorter TRAINPOD_HOME or temp dir"
        )
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise Fatal(f"{what} socket path {str(path)!r} exists and is not a socket; move it")
        if is_live(path):
            raise Conflict(f"another agent already serves {what} on {str(path)!r}; stop it")
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class _Listener:
    sock: socket.socket
    path: Path
    account: int | None  # the uid admitted besides root and the agent; None: nobody else


ACCEPT_BACKOFF_S = 1.0
"""How long a server stops watching its listener after a failed ``accept()`` (EMFILE...)."""
SELECT_TIMEOUT_S = 1.0
"""The longest a server's thread sleeps in ``select()``: it then looks at ``close()`` again."""


class SeqpacketServer:
    """A listener on a unix ``SOCK_SEQPACKET`` socket, served from one daemon thread.

    The constructor binds (see :func:`bind_seqpacket`, whose errors it raises), listens and
    starts the thread; :meth:`close` stops it, closes every connection and removes the socket
    file. The thread accepts connections (checking each peer, see the module's docstring) and
    calls ``on_readable(conn, uid)`` for each one that is readable (a message or EOF), ``uid``
    the peer's; ``conn`` is non-blocking, and ``on_readable`` reads what it wants and returns
    whether to keep the connection (False: the server closes it). After the
    connections of one wake-up are handled it calls ``after_wake()``, where a caller can book
    a batch under one lock. An exception from either callback ends the thread (logged).

    When ``accept()`` fails (EMFILE, ENFILE, ENOBUFS), the connection stays queued and the
    listener stays readable: the server stops watching the listener for
    :data:`ACCEPT_BACKOFF_S` instead of spinning on it, and counts the failures in
    :attr:`accept_errors`. ``select()`` wakes at least every :data:`SELECT_TIMEOUT_S`.
    ``what`` names the service in messages ("beacons").
    """

    def __init__(
        self,
        path: Path,
        on_readable: Callable[[socket.socket, int], bool],
        *,
        what: str,
        backlog: int,
        mode: int = 0o600,
        after_wake: Callable[[], None] | None = None,
        thread_name: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.what = what
        self.accept_errors = 0
        """Failed ``accept()`` calls (each one pauses accepting for a while)."""
        self.refused = 0
        """Connections refused because their peer's uid may not connect (logged)."""
        self._trusted = trusted_uids()
        self._backlog = backlog
        self._on_readable = on_readable
        self._after_wake = after_wake
        self._closing = False
        self._open = 0
        self._paused_until: float | None = None
        main = bind_seqpacket(self.path, mode, what=what, backlog=backlog)
        self._listeners: dict[socket.socket, _Listener] = {main: _Listener(main, self.path, None)}
        self._adding: list[_Listener] = []  # bound by add_listener, registered by the thread
        self._add_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(main, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._run, name=thread_name or f"{what}:{self.path.name}", daemon=True
        )
        self._thread.start()

    @property
    def connections(self) -> int:
        """Accepted connections still open."""
        return self._open

    @property
    def alive(self) -> bool:
        """Whether the thread is serving (False after :meth:`close` or a crash)."""
        return self._thread.is_alive() and not self._closing

    @property
    def accepting(self) -> bool:
        """False while accepting is paused after a failed ``accept()``."""
        return self._paused_until is None

    def add_listener(self, path: Path, *, uid: int, gid: int) -> None:
        """Listen on ``path`` too, for the POSIX account ``uid``: the socket file is given to
        it (mode 0600) and its connections admit root, the agent and ``uid`` alone. Put it in
        a directory only that account can enter. A connection may be made as soon as this
        returns (it waits in the backlog until the thread accepts it)."""
        sock = bind_seqpacket(Path(path), 0o600, what=self.what, backlog=self._backlog)
        try:
            os.chown(path, uid, gid)
        except OSError:
            sock.close()
            raise
        with self._add_lock:
            if self._closing:
                sock.close()
                return
            self._adding.append(_Listener(sock, Path(path), uid))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the thread looks again within SELECT_TIMEOUT_S anyway

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            if not self._closing:
                # Say so loudly: every client of this socket now goes unanswered.
                log.exception("the %s server on %s died: no more is received", self.what, self.path)
            raise

    def _loop(self) -> None:
        select, listeners, wake = self._selector.select, self._listeners, self._wake_r
        on_readable, after_wake = self._on_readable, self._after_wake
        while not self._closing:
            timeout = SELECT_TIMEOUT_S
            if self._paused_until is not None:
                left = self._paused_until - time.monotonic()
                if left <= 0.0:
                    self._paused_until = None
                    for sock in listeners:
                        self._selector.register(sock, selectors.EVENT_READ)
                else:
                    timeout = min(timeout, left)
            for key, _ in select(timeout):
                conn = key.fileobj
                if conn is wake:
                    self._woken()
                    continue
                assert isinstance(conn, socket.socket)  # only sockets are registered
                listener = listeners.get(conn)
                if listener is not None:
                    self._accept(listener)
                elif not on_readable(conn, key.data):
                    self._selector.unregister(conn)
                    conn.close()
                    self._open -= 1
            if after_wake is not None:
                after_wake()

    def _woken(self) -> None:
        """Drain the wake-up socket; start watching the listeners added since."""
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass
        with self._add_lock:
            added, self._adding = self._adding, []
        for listener in added:
            self._listeners[listener.sock] = listener
            if self._paused_until is None:
                self._selector.register(listener.sock, selectors.EVENT_READ)

    def _accept(self, listener: _Listener) -> None:
        while True:
            try:
                conn, _ = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.accept_errors += 1
                log.warning(
                    "cannot accept a %s connection on %s (%s); retrying in %g s",
                    self.what,
                    listener.path,
                    exc,
                    ACCEPT_BACKOFF_S,
                )
                for sock in self._listeners:
                    self._selector.unregister(sock)
                self._paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                return
            try:
                pid, uid, _ = peer_cred(conn)
            except OSError as exc:
                conn.close()
                self.refused += 1
                log.warning("refused a %s connection on %s: %s", self.what, listener.path, exc)
                continue
            if uid not in self._trusted and uid != listener.account:
                conn.close()
                self.refused += 1
                who = "root and the agent" + (
                    f" and uid {listener.account}" if listener.account is not None else ""
                )
                log.warning(
                    "refused a %s connection on %s from pid %d (uid %d): only %s may connect",
                    self.what,
                    listener.path,
                    pid,
                    uid,
                    who,
                )
                continue
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, uid)
            self._open += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving, close every connection and remove the socket file. Idempotent;
        blocks up to ``timeout_s`` for the thread."""
        if self._closing:
            return
        with self._add_lock:
            self._closing = True
            added, self._adding = self._adding, []
        self._wake()
        self._thread.join(timeout_s)
        for key in list((self._selector.get_map() or {}).values()):
            key.fileobj.close()  # type: ignore[union-attr]  # only sockets registered
        listeners = [*self._listeners.values(), *added]
        for listener in listeners:
            listener.sock.close()  # not in the map while accepting is paused
        self._selector.close()
        self._wake_w.close()
        self._open = 0
        for listener in listeners:
            listener.path.unlink(missing_ok=True)
