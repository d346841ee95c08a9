"""A controller serving HTTPS (ADR 0040): the CLI, the client and the agents verify it, a
client given the wrong CA is refused, and plain HTTP off loopback needs --insecure."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from tests.integration.conftest import Cluster
from tests.tlscerts import CertFiles, self_signed, signed_by
from trainpod.backends.procs import read_pid
from trainpod.client.http import TrainpodClient, trust_context
from trainpod.errors import CertificateRejected
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"

TLS_SPEC = """\
name: {{name}}
controller:
  host: 127.0.0.1
  tls: {{{{cert: {cert}, key: {key}}}}}
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
"""


def test_a_job_runs_over_https_and_a_wrong_ca_is_refused(
    make_cluster_from_spec: Callable[[str], Cluster], tmp_path: Path
) -> None:
    server = self_signed(tmp_path / "certs", "server")
    c = make_cluster_from_spec(TLS_SPEC.format(cert=server.cert, key=server.key))
    assert c.record.url.startswith("https://127.0.0.1:")
    assert c.record.ca_file == str(server.cert)  # self-signed: the certificate is the CA
    # The agents reached the controller over HTTPS: both nodes set up and are idle.
    c.wait_idle()
    out = c.cli("submit", "-N", "2", "--json", "--", "python", str(WORKERS / "allreduce.py"))
    done = c.wait_job(int(json.loads(out.stdout)["id"]))
    assert done.state == "completed", done.reason
    assert "ok rank=1 world=2" in c.client.logs(done.id, rank=1).data
    assert "https (bound to 127.0.0.1" in c.cli("cluster", "describe").stdout
    # The dashboard's login cookie, set over HTTPS, is sent back over HTTPS only.
    token = read_secret(c.paths.admin_token)
    with httpx.Client(base_url=c.record.url, verify=trust_context(server.cert)) as browser:
        login = browser.post("/ui/login", data={"token": token})
    assert login.status_code == 303, login.text
    assert "secure" in login.headers["set-cookie"].lower()

    other = self_signed(tmp_path / "other", "other")
    with (
        TrainpodClient(c.record.url, token, ca_file=other.cert) as wrong,
        pytest.raises(CertificateRejected) as info,
    ):
        wrong.cluster()
    msg = str(info.value)
    assert "certificate verify failed" in msg
    assert c.record.url in msg and str(other.cert) in msg


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainpod.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", "TRAINPOD_HOME": str(home)},
    )


def test_plain_http_on_a_wildcard_needs_insecure(home: Path, tmp_path: Path) -> None:
    spec = tmp_path / "open.yaml"
    spec.write_text(
        "name: open\ncontroller: {host: 0.0.0.0}\n"
        "instance_groups: [{name: workers, count: 1, devices_per_node: 1}]\n"
    )
    checked = _cli(home, "cluster", "validate", "-f", str(spec))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "note: `cluster create` will refuse it" in checked.stdout
    refused = _cli(home, "cluster", "create", "-f", str(spec), "--no-wait")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "give controller.tls, or pass --insecure to serve plain HTTP on purpose" in " ".join(
        refused.stderr.split()
    )
    assert not ClusterPaths(home, "open").record.exists()

    made = _cli(home, "cluster", "create", "-f", str(spec), "--no-wait", "--insecure")
    try:
        assert made.returncode == 0, made.stdout + made.stderr
        assert "--insecure: the controller serves plain HTTP on 0.0.0.0" in made.stdout
        record = ClusterRecord.load(ClusterPaths(home, "open"))
        assert record.insecure and record.ca_file is None
        assert record.url.startswith("http://127.0.0.1:")  # local: clients stay on this host
        described = _cli(home, "cluster", "describe", "open")
        assert "plain HTTP on 0.0.0.0, not loopback (created with --insecure)" in described.stdout
        log = ClusterPaths(home, "open").log_file("controller").read_text()
        assert "serving plain HTTP on 0.0.0.0, which is not loopback" in log
    finally:
        gone = _cli(home, "cluster", "delete", "open", "--purge")
        assert gone.returncode == 0, gone.stdout + gone.stderr


CA_SPEC = TLS_SPEC.replace(
    "{{{{cert: {cert}, key: {key}}}}}", "{{{{cert: {cert}, key: {key}, ca: {ca}}}}}"
)


def test_a_renewed_certificate_is_served_without_a_restart(
    make_cluster_from_spec: Callable[[str], Cluster], tmp_path: Path
) -> None:
    """The certificate is renewed in place (same CA, new key and serial) and the controller
    told with SIGHUP: the next connection gets the new certificate, the agents' open ones
    go on, and a job submitted afterwards runs; the controller never restarted."""
    ca = self_signed(tmp_path / "ca", "ca")
    first = signed_by(ca, tmp_path / "first", "server")
    renewed = signed_by(ca, tmp_path / "renewed", "server")
    live = CertFiles(tmp_path / "live" / "server.crt", tmp_path / "live" / "server.key")
    live.cert.parent.mkdir()
    for src, dest in ((first.cert, live.cert), (first.key, live.key)):
        dest.write_bytes(src.read_bytes())
    c = make_cluster_from_spec(CA_SPEC.format(cert=live.cert, key=live.key, ca=ca.cert))
    c.wait_idle()
    port = int(c.record.url.rsplit(":", 1)[1].rstrip("/"))
    pid = read_pid(c.paths.pid_file("controller"))
    assert pid is not None
    assert _serial_served(port, ca.cert) == _serial(first)
    live.key.write_bytes(renewed.key.read_bytes())  # the renewal, over the old files
    live.cert.write_bytes(renewed.cert.read_bytes())
    os.kill(pid, signal.SIGHUP)
    wait_until(
        lambda: _serial_served(port, ca.cert) == _serial(renewed),
        timeout_s=30,
        what="the renewed certificate served",
    )
    assert read_pid(c.paths.pid_file("controller")) == pid  # the same process
    out = c.cli("submit", "-N", "2", "--json", "--", "python", str(WORKERS / "allreduce.py"))
    done = c.wait_job(int(json.loads(out.stdout)["id"]))
    assert done.state == "completed", done.reason
    assert "serving the renewed certificate" in c.paths.log_file("controller").read_text()


def _serial(files: CertFiles) -> int:
    return x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number


def _serial_served(port: int, ca: Path) -> int:
    """The serial of the certificate a new connection to the controller is given."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
