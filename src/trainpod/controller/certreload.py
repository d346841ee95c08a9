"""A renewed certificate is served without restarting the controller.

Certificates expire (90 days for ACME's, often less inside a company) and are renewed in
place: cert-manager, certbot or a cron job writes new files where the old ones were. A
controller that read them once at start would serve the old certificate until restarted,
then fail every client at its expiry. So the controller watches its certificate and key
(``controller.tls`` in the cluster spec) and loads them into the live ``SSLContext`` when
they change (their size or modification time), or on SIGHUP: connections made afterwards
get the new certificate, and the ones open keep theirs (TLS decides the certificate once,
at the handshake).

The live context is never loaded into: ``load_cert_chain`` sets the certificate, then the
key, and OpenSSL drops the old key when the new certificate does not match it, so a
handshake on the server's loop between the two had no key and the client saw the
connection closed (a CI run caught it). A renewal is loaded into a context of its own, and
the live context's SNI callback, which OpenSSL calls at every ClientHello (with no name
too), hands each new connection the newest whole context.

A renewal is seen in two writes (the key, then the certificate, or the other way round), so
a pair that does not load together is not an error yet: it is tried again at each look, and
the old certificate stays served meanwhile. Only a pair that still fails after
``settle_s`` is logged as a failed reload; the old one is still served, never none.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 5.0
"""How often the files are looked at (a stat of each)."""
SETTLE_S = 30.0
"""How long a pair that does not load together may be half-written before it is reported."""


@dataclass(frozen=True)
class Stamp:
    size: int
    mtime_ns: int
    inode: int


def stamp(path: Path) -> Stamp | None:
    try:
        st = os.stat(path)  # follows links: a renewed Kubernetes secret moves a link
    except OSError:
        return None
    return Stamp(st.st_size, st.st_mtime_ns, st.st_ino)


ContextFactory = Callable[[Path, Path], ssl.SSLContext]
"""Makes a server context with the given certificate and key loaded (and the server's other
settings): what the server itself would have made from those files."""


def like(context: ssl.SSLContext) -> ContextFactory:
    """A factory of contexts with ``context``'s protocol, options and verify mode."""

    def make(cert: Path, key: Path) -> ssl.SSLContext:
        made = ssl.SSLContext(context.protocol)
        made.options = context.options
        made.verify_mode = context.verify_mode
        made.load_cert_chain(cert, key)
        return made

    return make


class CertReloader:
    """Serves ``cert`` and ``key`` again, from the next handshake, when they change.

    ``context``: the server's own context (uvicorn's, made at its start). Its SNI callback is
    taken: each new connection gets the newest context ``make_context`` made.
    """

    def __init__(
        self,
        context: ssl.SSLContext,
        cert: Path,
        key: Path,
        *,
        make_context: ContextFactory | None = None,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.context = context
        self.cert = cert
        self.key = key
        self._make = make_context or like(context)
        self._current = context
        """The context new connections get; replaced whole, never changed."""
        context.sni_callback = self._hand_over
        self.settle_s = settle_s
        self._clock = clock
        self._served = (stamp(cert), stamp(key))
        self._failing_since: float | None = None
        self._reported = False
        self.reloads = 0
        """Times a new certificate was loaded."""
        self.last_error = ""
        """Why the newest files did not load (empty once they do)."""
        self.wake = threading.Event()
        """Set (by SIGHUP) for a look now."""

    def check(self) -> bool:
        """Look at the files; load them if they changed and load together. True: loaded."""
        now = (stamp(self.cert), stamp(self.key))
        if now == self._served or None in now:
            return False
        try:
            made = self._make(self.cert, self.key)  # both files, or neither is taken
        except (ssl.SSLError, OSError) as exc:
            self._not_yet(exc)
            return False
        self._current = made  # one reference swap: a handshake sees the old or the new
        self._served = now
        self._failing_since = None
        self._reported = False
        self.last_error = ""
        self.reloads += 1
        log.info("serving the renewed certificate %s (key %s)", self.cert, self.key)
        return True

    def _hand_over(
        self, connection: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: ssl.SSLContext
    ) -> None:
        """SNI callback, at a ClientHello: the connection takes the newest context."""
        current = self._current
        if current is not self.context:
            connection.context = current

    def _not_yet(self, exc: Exception) -> None:
        reason = getattr(exc, "reason", None) or str(exc)
        self.last_error = (
            f"the certificate {self.cert} and key {self.key} do not load together ({reason}); "
            "the previous certificate is still served"
        )
        t = self._clock()
        if self._failing_since is None:
            self._failing_since = t
        elif not self._reported and t - self._failing_since >= self.settle_s:
            self._reported = True
            log.warning("%s: fix the files (they are tried again every look)", self.last_error)

    def run(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        while not stop.is_set():
            self.wake.wait(poll_s)
            self.wake.clear()
            try:
                self.check()
            except Exception:  # a look must never end the watch
                log.exception("looking at the certificate %s failed", self.cert)
