"""controller.tls: the files are checked at load, and plain HTTP is refused off loopback."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.tlscerts import self_signed

from trainpod.backends.local import LocalBackend
from trainpod.client.http import TrainpodClient, _verify_failed
from trainpod.errors import CertificateRejected, ControllerUnavailable, Fatal, SpecError
from trainpod.paths import ClusterPaths, ClusterRecord
from trainpod.spec.loading import parse_cluster_spec
from trainpod.spec.tls import is_loopback, plain_http_problem


def spec_of(controller: dict[str, Any], base: Path) -> Any:
    data = {"name": "t", "instance_groups": [{"name": "w", "count": 1}], "controller": controller}
    return parse_cluster_spec(data, source="spec.yaml", base_dir=base)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("10.0.0.1", False),
        ("head.example.org", False),
    ],
)
def test_loopback_rule(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    problem = plain_http_problem(host, None, insecure=False)
    assert (problem is None) is loopback
    assert plain_http_problem(host, None, insecure=True) is None


def test_the_refusal_says_what_to_do() -> None:
    problem = plain_http_problem("0.0.0.0", None, insecure=False)
    assert problem is not None
    assert "give controller.tls" in problem
    assert "pass --insecure to serve plain HTTP on purpose" in problem


def test_tls_files_resolve_against_the_spec_and_the_ca_defaults_to_the_cert(
    tmp_path: Path,
) -> None:
    files = self_signed(tmp_path / "certs", "server")
    spec = spec_of(
        {"host": "0.0.0.0", "tls": {"cert": "certs/server.crt", "key": "certs/server.key"}},
        tmp_path,
    )
    tls = spec.controller.tls
    assert tls is not None
    assert tls.cert == files.cert and tls.key == files.key
    assert tls.trust() == files.cert
    assert plain_http_problem("0.0.0.0", tls, insecure=False) is None
    # What the record keeps parses back to an equal spec (as every path of the spec).
    assert parse_cluster_spec(spec.to_json(), source="record", base_dir=Path("/")) == spec


def test_a_missing_cert_is_named_with_the_fix(tmp_path: Path) -> None:
    files = self_signed(tmp_path, "server")
    with pytest.raises(SpecError) as info:
        spec_of({"tls": {"cert": "nope.crt", "key": str(files.key)}}, tmp_path)
    msg = str(info.value)
    assert "spec.yaml: controller.tls.cert: file not found" in msg
    assert f"Fix: create the file or correct the path (resolved to {tmp_path / 'nope.crt'})" in msg


def test_an_unreadable_key_is_named(tmp_path: Path) -> None:
    files = self_signed(tmp_path, "server")
    files.key.chmod(0)
    if os.geteuid() == 0:
        pytest.skip("running as root: every file is readable")
    with pytest.raises(SpecError, match=r"controller\.tls\.key: file not readable.*chmod u\+r"):
        spec_of({"tls": {"cert": str(files.cert), "key": str(files.key)}}, tmp_path)


def test_a_key_of_another_certificate_is_refused(tmp_path: Path) -> None:
    one, other = self_signed(tmp_path, "one"), self_signed(tmp_path, "other")
    with pytest.raises(SpecError) as info:
        spec_of({"tls": {"cert": str(one.cert), "key": str(other.key)}}, tmp_path)
    msg = str(info.value)
    assert f"controller.tls.key: the key {other.key} does not load with the certificate" in msg
    assert str(one.cert) in msg and str(other.key) in msg
    assert "Fix: give the unencrypted PEM private key this certificate was made for" in msg


def test_a_ca_that_is_not_a_certificate_is_refused(tmp_path: Path) -> None:
    files = self_signed(tmp_path, "server")
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n")
    with pytest.raises(SpecError, match=r"controller\.tls\.ca: not a PEM CA certificate"):
        spec_of(
            {"tls": {"cert": str(files.cert), "key": str(files.key), "ca": str(bogus)}}, tmp_path
        )


def test_create_refuses_plain_http_on_a_wildcard_before_making_anything(
    tmp_path: Path,
) -> None:
    spec = spec_of({"host": "0.0.0.0"}, tmp_path)
    paths = ClusterPaths(tmp_path / "home", "t")
    with pytest.raises(SpecError) as info:
        LocalBackend(paths).create(spec, tmp_path / "spec.yaml")
    msg = str(info.value)
    assert "controller.host" in msg and "0.0.0.0" in msg
    assert "give controller.tls" in msg and "--insecure" in msg
    assert not paths.state_dir.exists()


def test_the_record_url_follows_tls_and_the_advertised_host() -> None:
    base: dict[str, Any] = {
        "name": "t",
        "backend": "local",
        "spec": {},
        "spec_path": "/s.yaml",
        "port": 8443,
        "created_at": 0.0,
        "shared_dir": "/s",
        "scratch_root": "/r",
        "checkpoint_uri": "file:///c",
    }
    assert ClusterRecord(**base, host="127.0.0.1").url == "http://127.0.0.1:8443"
    tls = ClusterRecord(**base, host="0.0.0.0", advertise="head.lan", ca_file="/ca.pem")
    assert tls.url == "https://head.lan:8443"
    assert ClusterRecord(**base, host="::1").url == "http://[::1]:8443"


def test_a_client_with_a_missing_ca_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(Fatal, match=r"cannot load the CA file .*missing\.pem"):
        TrainpodClient("https://127.0.0.1:1", "t", ca_file=tmp_path / "missing.pem")


def test_a_verify_failure_is_told_apart_from_an_unreachable_controller(tmp_path: Path) -> None:
    files = self_signed(tmp_path, "server")
    client = TrainpodClient("https://127.0.0.1:1", "t", ca_file=files.cert)
    cause = ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
    )
    failed = httpx.ConnectError("handshake")
    failed.__cause__ = cause
    assert _verify_failed(failed)
    rejected = client._unreachable(failed)
    assert isinstance(rejected, CertificateRejected)
    assert "certificate verify failed" in str(rejected)
    assert "https://127.0.0.1:1" in str(rejected) and str(files.cert) in str(rejected)
    assert isinstance(client._unreachable(httpx.ConnectError("refused")), ControllerUnavailable)
    client.close()


def test_the_controller_refuses_to_serve_plain_http_off_loopback_unless_recorded_insecure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from trainpod.controller.daemon import serving_tls

    record = ClusterRecord(
        name="t",
        backend="local",
        spec={},
        spec_path="/s.yaml",
        host="0.0.0.0",
        port=8443,
        created_at=0.0,
        shared_dir="/s",
        scratch_root="/r",
        checkpoint_uri="file:///c",
    )
    plain = spec_of({"host": "0.0.0.0"}, tmp_path).controller
    with pytest.raises(SystemExit, match=r"refusing to start: .*give controller\.tls"):
        serving_tls(record, plain)
    insecure = record.model_copy(update={"insecure": True})
    assert serving_tls(insecure, plain) is None
    assert "serving plain HTTP on 0.0.0.0, which is not loopback" in caplog.text
    files = self_signed(tmp_path, "server")
    tls = spec_of(
        {"host": "0.0.0.0", "tls": {"cert": str(files.cert), "key": str(files.key)}}, tmp_path
    )
    assert serving_tls(record, tls.controller) == tls.controller.tls
