"""The agent's SOCK_SEQPACKET server: serving connections, and backing off when accept()
fails for want of file descriptors instead of spinning on a listener that stays readable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.agent.unixsock import ACCEPT_BACKOFF_S, SeqpacketServer
from trainpod.errors import Conflict
from trainpod.testing.wait import wait_until


@pytest.fixture
def sock_path() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tpu-", dir="/tmp"))  # short: sun_path is 108 bytes
    yield d / "s.sock"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _client(path: Path, timeout_s: float = 5.0) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.settimeout(timeout_s)
    c.connect(str(path))
    return c


def _echo(conn: socket.socket, uid: int) -> bool:
    try:
        data = conn.recv(4096)
    except BlockingIOError:
        return True
    if not data:
        return False
    if data == b"bye":
        return False
    conn.send(data)
    return True


def test_it_serves_connections_and_cleans_up(sock_path: Path) -> None:
    wakes: list[int] = []
    srv = SeqpacketServer(
        sock_path, _echo, what="test", backlog=8, after_wake=lambda: wakes.append(1)
    )
    try:
        assert srv.alive and srv.accepting and sock_path.exists()
        with pytest.raises(Conflict):
            SeqpacketServer(sock_path, _echo, what="test", backlog=8)  # a live one owns it
        a, b = _client(sock_path), _client(sock_path)
        for c, msg in ((a, b"one"), (b, b"two"), (a, b"three")):
            c.send(msg)
            assert c.recv(4096) == msg
        assert srv.connections == 2 and wakes
        b.send(b"bye")  # the callback says: close it
        assert b.recv(4096) == b""
        wait_until(lambda: srv.connections == 1, what="the server to close its end")
        a.close()  # EOF: closed too
        wait_until(lambda: srv.connections == 0, what="the server to see EOF")
        b.close()
        assert srv.accept_errors == 0
    finally:
        srv.close()
    srv.close()  # idempotent
    assert not srv.alive and not sock_path.exists()


# Runs in a child whose file-descriptor limit leaves room for a couple of connections only.
_LOW_FDS = """
import os, resource, sys
from pathlib import Path
from trainpod.agent.unixsock import SeqpacketServer

def echo(conn, uid):
    try:
        data = conn.recv(4096)
    except BlockingIOError:
        return True
    if data:
        conn.send(data)
    return bool(data)

srv = SeqpacketServer(Path(sys.argv[1]), echo, what="test", backlog=32)
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 3, hard))
print("ready", flush=True)
for _ in sys.stdin:
    print(srv.accept_errors, srv.connections, int(srv.accepting), flush=True)
srv.close()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/fd")
def test_out_of_file_descriptors_it_pauses_accepting_then_serves_the_queue(
    sock_path: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOW_FDS, str(sock_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def stats() -> tuple[int, int, bool]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        errors, conns, accepting = proc.stdout.readline().split()
        return int(errors), int(conns), accepting == "1"

    clients: list[socket.socket] = []
    try:
        assert proc.stdout.readline() == "ready\n"
        clients = [_client(sock_path) for _ in range(8)]  # queued in the backlog
        for i, c in enumerate(clients):
            c.send(f"ping {i}".encode())
        wait_until(lambda: stats()[0] >= 1, what="accept() to fail with EMFILE")
        errors, served, _ = stats()
        assert 1 <= served < len(clients)
        for i, c in enumerate(clients[:served]):
            assert c.recv(4096) == f"ping {i}".encode()
        # The listener stays readable all along: a server that kept watching it would fail
        # accept() thousands of times a second. This one tries again once per back-off.
        window_s = 1.5
        time.sleep(window_s)
        later, _, _ = stats()
        assert later - errors <= window_s / ACCEPT_BACKOFF_S + 1, (errors, later)
        # Free descriptors: the queued connections are served once the back-off ends.
        for c in clients[:served]:
            c.close()
        waiting = clients[served]
        assert waiting.recv(4096) == f"ping {served}".encode()  # within the 5 s timeout
    finally:
        for c in clients:
            c.close()
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert proc.stderr is not None and "cannot accept a test connection" in proc.stderr.read()


# Connects to argv[1] as whatever user it runs as; prints "refused" when the server closes
# the connection unanswered, else what it echoed.
_CONNECT = """
import socket, sys
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.settimeout(30)
c.connect(sys.argv[1])
try:
    c.send(b"hello")
    print(c.recv(4096).decode() or "refused")
except OSError:
    print("refused")
"""


# The test's own interpreter may sit where other users cannot run it (under /root).
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _connect_as(path: Path, uid: int) -> str:
    out = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", _CONNECT, str(path)],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as other uids needs root")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 for other uids")
def test_only_root_the_agent_and_the_listeners_account_get_in(sock_path: Path) -> None:
    account, stranger = 65533, 65534
    seen: list[int] = []

    def echo(conn: socket.socket, uid: int) -> bool:
        seen.append(uid)
        return _echo(conn, uid)

    srv = SeqpacketServer(sock_path, echo, what="test", backlog=8)
    theirs = sock_path.with_name("theirs.sock")
    try:
        srv.add_listener(theirs, uid=account, gid=account)
        assert (theirs.stat().st_uid, theirs.stat().st_mode & 0o777) == (account, 0o600)
        # Open the files to everybody: what keeps a stranger out must be the peer check.
        sock_path.parent.chmod(0o755)
        for p in (sock_path, theirs):
            p.chmod(0o666)
        assert _connect_as(theirs, account) == "hello"
        assert _connect_as(theirs, stranger) == "refused"
        assert _connect_as(sock_path, account) == "refused"  # the agent's own socket
        assert srv.refused == 2
        c = _client(theirs)  # root (the agent's user here) reaches every socket
        c.send(b"root")
        assert c.recv(4096) == b"root"
        c.close()
        assert set(seen) == {account, 0}
    finally:
        srv.close()
    assert not theirs.exists() and not sock_path.exists()
