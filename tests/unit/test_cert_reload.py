"""A renewed certificate goes into the live SSLContext (trainpod.controller.certreload):
real certificates from one CA, real handshakes (in memory)."""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path

import pytest
from tests.tlscerts import CertFiles, self_signed, served_certificate, signed_by

from trainpod.controller.certreload import CertReloader


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _install(src: CertFiles, dest: CertFiles, *, cert: bool = True, key: bool = True) -> None:
    """Write ``src`` where the server reads ``dest`` (as a renewal writes over the old)."""
    if key:
        dest.key.write_bytes(src.key.read_bytes())
    if cert:
        dest.cert.write_bytes(src.cert.read_bytes())


@pytest.fixture
def certs(tmp_path: Path) -> tuple[CertFiles, CertFiles, CertFiles, CertFiles]:
    """(ca, the served files, the first certificate, its renewal)."""
    ca = self_signed(tmp_path / "ca", "ca")
    first = signed_by(ca, tmp_path / "first", "server")
    renewed = signed_by(ca, tmp_path / "renewed", "server")
    served = CertFiles(tmp_path / "live" / "server.crt", tmp_path / "live" / "server.key")
    served.cert.parent.mkdir()
    _install(first, served)
    return ca, served, first, renewed


def _serial(files: CertFiles) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number


def _context(files: CertFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(files.cert, files.key)
    return ctx


def test_a_renewed_certificate_is_served_from_the_next_handshake(
    certs: tuple[CertFiles, CertFiles, CertFiles, CertFiles],
) -> None:
    ca, served, first, renewed = certs
    ctx = _context(served)
    reloader = CertReloader(ctx, served.cert, served.key)
    assert served_certificate(ctx, ca.cert).serial_number == _serial(first)
    assert reloader.check() is False  # nothing changed
    _install(renewed, served)
    assert reloader.check() is True and reloader.reloads == 1
    assert served_certificate(ctx, ca.cert).serial_number == _serial(renewed)
    assert reloader.check() is False  # loaded once


def test_a_half_written_renewal_keeps_the_old_one_served_then_is_reported(
    certs: tuple[CertFiles, CertFiles, CertFiles, CertFiles], caplog: pytest.LogCaptureFixture
) -> None:
    ca, served, first, renewed = certs
    ctx = _context(served)
    clock = Clock()
    reloader = CertReloader(ctx, served.cert, served.key, settle_s=30, clock=clock)
    _install(renewed, served, key=False)  # the new certificate, the old key: not a pair
    with caplog.at_level(logging.WARNING, logger="trainpod.controller.certreload"):
        assert reloader.check() is False
        clock.t = 10
        assert reloader.check() is False
        assert not caplog.records  # within settle_s: the other file may still be coming
        assert "do not load together" in reloader.last_error
        assert "previous certificate is still served" in reloader.last_error
        clock.t = 31
        assert reloader.check() is False
        clock.t = 90
        assert reloader.check() is False
    assert len(caplog.records) == 1, caplog.records  # reported once, not at every look
    assert str(served.cert) in caplog.records[0].getMessage()
    assert served_certificate(ctx, ca.cert).serial_number == _serial(first)  # never none
    _install(renewed, served, cert=False)  # the key arrives
    assert reloader.check() is True and reloader.last_error == ""
    assert served_certificate(ctx, ca.cert).serial_number == _serial(renewed)


def test_files_missing_for_a_moment_change_nothing(
    certs: tuple[CertFiles, CertFiles, CertFiles, CertFiles],
) -> None:
    ca, served, first, _ = certs
    ctx = _context(served)
    reloader = CertReloader(ctx, served.cert, served.key)
    served.key.unlink()  # a renewal that removes, then writes
    assert reloader.check() is False and reloader.last_error == ""
    assert served_certificate(ctx, ca.cert).serial_number == _serial(first)


def test_handshakes_during_reloads_never_meet_a_half_loaded_context(
    certs: tuple[CertFiles, CertFiles, CertFiles, CertFiles],
) -> None:
    """A handshake on another thread while the files are loaded again gets the old or the
    new certificate, never none: loading into the live context dropped its key for a moment
    (OpenSSL frees a key that does not match the new certificate) and a client saw EOF."""
    ca, served, first, renewed = certs
    ctx = _context(served)
    reloader = CertReloader(ctx, served.cert, served.key)
    serials = {_serial(first), _serial(renewed)}
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def handshakes() -> None:
        while not stop.is_set():
            try:
                seen.append(served_certificate(ctx, ca.cert).serial_number)
            except BaseException as exc:  # the test reports it
                errors.append(exc)
                return

    thread = threading.Thread(target=handshakes)
    thread.start()
    try:
        for i in range(40):
            _install(renewed if i % 2 == 0 else first, served)
            os.utime(served.cert, ns=(i + 1, i + 1))  # a new stamp even for the same bytes
            assert reloader.check() is True
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]
    assert seen and set(seen) <= serials
    assert reloader.reloads == 40
    assert served_certificate(ctx, ca.cert).serial_number == _serial(first)
