"""Listening on a unix SOCK_SEQPACKET socket the agent owns (beacons, checkpoint hand-offs).

:func:`bind_seqpacket` makes the listener; :class:`SeqpacketServer` serves it from a thread.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainpod.errors import Conflict, Fatal

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


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


ACCEPT_BACKOFF_S = 1.0
"""How long a server stops watching its listener after a failed ``accept()`` (EMFILE...)."""
SELECT_TIMEOUT_S = 1.0
"""The longest a server's thread sleeps in ``select()``: it then looks at ``close()`` again."""


class SeqpacketServer:
    """A listener on a unix ``SOCK_SEQPACKET`` socket, served from one daemon thread.

    The constructor binds (see :func:`bind_seqpacket`, whose errors it raises), listens and
    starts the thread; :meth:`close` stops it, closes every connection and removes the socket
    file. The thread accepts connections and calls ``on_readable(conn)`` for each one that is
    readable (a message or EOF); ``conn`` is non-blocking, and ``on_readable`` reads what it
    wants and returns whether to keep the connection (False: the server closes it). After the
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
        on_readable: Callable[[socket.socket], bool],
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
        self._on_readable = on_readable
        self._after_wake = after_wake
        self._closing = False
        self._open = 0
        self._paused_until: float | None = None
        self._listener = bind_seqpacket(self.path, mode, what=what, backlog=backlog)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
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

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            if not self._closing:
                # Say so loudly: every client of this socket now goes unanswered.
                log.exception("the %s server on %s died: no more is received", self.what, self.path)
            raise

    def _loop(self) -> None:
        select, listener, wake = self._selector.select, self._listener, self._wake_r
        on_readable, after_wake = self._on_readable, self._after_wake
        while not self._closing:
            timeout = SELECT_TIMEOUT_S
            if self._paused_until is not None:
                left = self._paused_until - time.monotonic()
                if left <= 0.0:
                    self._paused_until = None
                    self._selector.register(listener, selectors.EVENT_READ)
                else:
                    timeout = min(timeout, left)
            for key, _ in select(timeout):
                conn = key.fileobj
                if conn is listener:
                    self._accept()
                elif conn is not wake:
                    assert isinstance(conn, socket.socket)  # only sockets are registered
                    if not on_readable(conn):
                        self._selector.unregister(conn)
                        conn.close()
                        self._open -= 1
            if after_wake is not None:
                after_wake()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.accept_errors += 1
                log.warning(
                    "cannot accept a %s connection on %s (%s); retrying in %g s",
                    self.what,
                    self.path,
                    exc,
                    ACCEPT_BACKOFF_S,
                )
                self._selector.unregister(self._listener)
                self._paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                return
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ)
            self._open += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving, close every connection and remove the socket file. Idempotent;
        blocks up to ``timeout_s`` for the thread."""
        if self._closing:
            return
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the thread sees _closing within SELECT_TIMEOUT_S anyway
        self._thread.join(timeout_s)
        for key in list((self._selector.get_map() or {}).values()):
            key.fileobj.close()  # type: ignore[union-attr]  # only sockets registered
        self._listener.close()  # not in the map while accepting is paused
        self._selector.close()
        self._wake_w.close()
        self._open = 0
        self.path.unlink(missing_ok=True)
