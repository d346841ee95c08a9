"""The controller's address and TLS: ``controller: {host, port, advertise, tls}`` (ADR 0040).

A controller bound to anything but loopback (127.0.0.0/8, ``::1``, ``localhost``) must serve
HTTPS, unless ``--insecure`` says plain HTTP is meant (:func:`plain_http_problem`). The files
are checked when the spec is loaded: each exists and is readable, the key matches the
certificate (Python's :mod:`ssl` loads them as the server will), and the CA loads as a
trust store.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ``::1`` and ``localhost``; a wildcard (``0.0.0.0``, ``::``)
    listens on every interface and is not loopback, nor is any other name or address."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def plain_http_problem(host: str, tls: TlsSpec | None, *, insecure: bool) -> str | None:
    """Why a controller may not serve plain HTTP on ``host``, or None if it may."""
    if tls is not None or insecure or is_loopback(host):
        return None
    return (
        f"the controller would listen on {host}, which is not loopback, over plain HTTP: "
        "give controller.tls, or pass --insecure to serve plain HTTP on purpose "
        "(controller.tls in the cluster spec takes cert and key, and ca when a private CA "
        "signed them)"
    )


def _problem(reason: str, got: object, fix: str, *loc: str) -> ValueError:
    from trainpod.spec.cluster import SpecProblem, SpecProblems

    return SpecProblems([SpecProblem(tuple(loc), reason, got, fix)])


def _resolve(path: Path, info: ValidationInfo) -> Path:
    context = info.context if isinstance(info.context, dict) else {}
    base = Path(context["base_dir"]) if context.get("base_dir") is not None else Path.cwd()
    return Path(os.path.normpath(base / path.expanduser()))


def _readable(path: Path, written: Path) -> None:
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "file not found"
        fix = f"create the file or correct the path (resolved to {path})"
        raise _problem(reason, str(written), fix)
    if not os.access(path, os.R_OK):
        fix = f"let this user read it (chmod u+r {path}) or run as its owner"
        raise _problem("file not readable", str(written), fix)


class TlsSpec(BaseModel):
    """The controller's certificate and key (PEM), and the CA clients verify it against."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    cert: Path
    """The server certificate (PEM; a chain after it is fine). Its subject alternative
    names must include the address clients and agents connect to (``advertise``)."""
    key: Path
    """The certificate's private key (PEM, unencrypted)."""
    ca: Path | None = None
    """The CA certificate(s) clients verify the server against; None: the certificate
    itself (self-signed)."""

    @field_validator("cert", "key", "ca", mode="after")
    @classmethod
    def _readable_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        path = _resolve(value, info)
        _readable(path, value)
        return path

    @model_validator(mode="after")
    def _key_matches(self) -> TlsSpec:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise _problem(
                f"the key {self.key} does not load with the certificate {self.cert} "
                f"({exc.reason or exc})",
                str(self.key),
                "give the unencrypted PEM private key this certificate was made for, and the "
                "PEM certificate as cert",
                "key",
            ) from None
        if self.ca is not None:
            try:
                ssl.create_default_context(cafile=str(self.ca))
            except ssl.SSLError as exc:
                raise _problem(
                    f"not a PEM CA certificate ({exc.reason or exc})",
                    str(self.ca),
                    "give the CA certificate(s) that signed cert, in PEM",
                    "ca",
                ) from None
        return self

    def trust(self) -> Path:
        """What clients verify the server against: ``ca``, else the certificate itself."""
        return self.ca if self.ca is not None else self.cert


Port = Annotated[StrictInt, Field(ge=1, le=65535)]


class ControllerSpec(BaseModel):
    """Where the controller listens, and whether it serves HTTPS."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    host: StrictStr = "127.0.0.1"
    """The address the controller binds. Anything but loopback needs ``tls`` (or
    ``trainpod cluster create --insecure``)."""
    port: Port | None = None
    """The API port; None: a free one picked at ``cluster create``."""
    advertise: StrictStr | None = None
    """The host name or address clients and agents connect to (the certificate must name
    it). None: ``host``; for a wildcard (``0.0.0.0``, ``::``), 127.0.0.1 on the local
    backend and this machine's host name on Slurm."""
    tls: TlsSpec | None = None
    """Serve HTTPS with this certificate and key; None: plain HTTP (loopback only, unless
    ``--insecure``)."""
    view_cache_mib: Annotated[StrictInt, Field(ge=1)] = 64
    """How much memory (MiB) each of the controller's two read caches may take: the decoded
    specs of recent jobs, and the JSON of jobs that have ended. Past it the oldest entries
    go (and are rebuilt from the database when asked for again)."""
