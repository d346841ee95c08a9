"""A TCP proxy in front of a controller that loses replies for real (tests only).

Each connection is served one HTTP/1.1 exchange at a time: the request is read whole and
sent to the controller, the controller's whole reply is read, then passed on, or, for the
first ``drops`` requests that start with ``match``, thrown away and the client's connection
closed without a byte of it. The controller has committed and answered by then; the client
sees a connection closed before any reply (httpx: ``RemoteProtocolError``), exactly what a
dropped connection or a proxy timing out does to it.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import BinaryIO
from urllib.parse import urlsplit


class LossyProxy:
    def __init__(self, upstream_url: str, match: bytes, drops: int = 1) -> None:
        parts = urlsplit(upstream_url)
        assert parts.hostname and parts.port, upstream_url
        self._upstream = (parts.hostname, parts.port)
        self.match = match
        self._drops = drops
        self._lock = threading.Lock()
        self.requests: list[bytes] = []
        """Every request that started with ``match``, whole, in the order they came."""
        self.lost: list[bytes] = []
        """The controller's replies that were thrown away, whole."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="lossy-proxy", daemon=True)

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._listener.close()
        self._thread.join(timeout=10)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the proxy is done
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(self._upstream, timeout=60) as up:
            client, controller = conn.makefile("rb"), up.makefile("rb")
            try:
                while (request := read_message(client)) is not None:
                    up.sendall(request)
                    reply = read_message(controller)
                    if reply is None:
                        return
                    if self._lose(request, reply):
                        conn.shutdown(socket.SHUT_RDWR)  # closed with no reply at all
                        return
                    conn.sendall(reply)
            except OSError:  # the client went away
                return
            finally:
                client.close()
                controller.close()

    def _lose(self, request: bytes, reply: bytes) -> bool:
        if not request.startswith(self.match):
            return False
        with self._lock:
            self.requests.append(request)
            if self._drops <= 0:
                return False
            self._drops -= 1
            self.lost.append(reply)
            return True


def read_message(f: BinaryIO) -> bytes | None:
    """One HTTP/1.1 request or reply, head and body (framed by ``Content-Length``), or None
    at the end of the stream."""
    lines: list[bytes] = []
    while True:
        line = f.readline(65536)
        if not line:
            assert not lines, f"the stream ended inside a message head: {b''.join(lines)!r}"
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    head = b"".join(lines)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        assert name.strip().lower() != b"transfer-encoding", "chunked messages: not handled"
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = f.read(length) if length else b""
    return head + body


def header(message: bytes, name: str) -> str | None:
    """The value of header ``name`` in ``message`` (None: none)."""
    head = message.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def body(message: bytes) -> bytes:
    return message.split(b"\r\n\r\n", 1)[1]
