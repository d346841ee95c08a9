"""Listening on a unix SOCK_SEQPACKET socket the agent owns (beacons, checkpoint hand-offs)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from trainpod.errors import Conflict, Fatal

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
