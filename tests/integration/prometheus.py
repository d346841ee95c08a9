"""A private Prometheus (Debian's ``prometheus`` package) that scrapes one local cluster.

Its config is the shipped ``deploy/prometheus/prometheus.yml`` with the target, the token
file and the rules file pointed at the test's cluster and the shipped rules, and a 1 s
scrape interval. Its TSDB lives in the test's temp dir, it listens on a free localhost
port, and :meth:`Prometheus.stop` ends it (no system service is involved).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from trainpod.testing.wait import wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = (
    "Debian's prometheus package is not installed (scripts/services installs it: "
    "apt-get install prometheus)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_for(target: str, token_file: Path, scrape_interval: str = "1s") -> dict[str, Any]:
    """The shipped scrape config, aimed at ``target`` (host:port) with ``token_file``."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job.update(scrape_interval=scrape_interval, scrape_timeout=scrape_interval)
    job["authorization"]["credentials_file"] = str(token_file)
    job["static_configs"] = [{"targets": [target]}]
    return config


class Prometheus:
    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        assert PROMETHEUS is not None, MISSING
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config_file}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._ready, timeout_s=30, what=f"prometheus ready on {self.url}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; raises on an error status (with its message)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
