"""Running a node's lifecycle scripts, with a log per script and a timeout each.

Scripts run in order, once per node: a marker in the node's state dir records success,
so restarting the cluster does not run them again (a failed node runs them again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainpod import procutil
from trainpod.agent.ranks import log_tail
from trainpod.api.models import LifecycleResult, LifecycleStatus

KILL_GRACE_S = 5.0
"""A script past its timeout gets SIGTERM, and this long to clean up before SIGKILL."""


@dataclass(frozen=True)
class Script:
    path: Path
    timeout_s: float
    args: tuple[str, ...] = ()


def script_argv(script: Script) -> list[str]:
    """Run an executable directly; otherwise pick the interpreter from its suffix."""
    if os.access(script.path, os.X_OK):
        return [str(script.path), *script.args]
    if script.path.suffix == ".py":
        return [sys.executable, str(script.path), *script.args]
    return ["/bin/bash", str(script.path), *script.args]


class LifecycleRunner:
    def __init__(
        self,
        scripts: Sequence[Script],
        *,
        log_dir: Path,
        marker: Path,
        env: dict[str, str],
        on_change: Callable[[], None],
    ) -> None:
        self._scripts = list(scripts)
        self._log_dir = log_dir
        self._marker = marker
        self._env = env
        self._on_change = on_change
        self._fingerprint = json.dumps([[str(s.path), list(s.args)] for s in scripts])
        done = self.already_done()
        self.results = [
            LifecycleResult(script=s.path.name, state="ok" if done else "pending")
            for s in self._scripts
        ]
        # A node that finished its scripts before (a restarted agent) is ready at once.
        self.state: str = "ok" if done else "running"

    def already_done(self) -> bool:
        try:
            return self._marker.read_text() == self._fingerprint
        except OSError:
            return False

    def status(self) -> LifecycleStatus:
        return LifecycleStatus(state=self.state, results=list(self.results))

    def run(self) -> None:
        """Run every script (blocking); stop at the first failure."""
        if self.state == "ok":
            return
        self._marker.unlink(missing_ok=True)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        for i, script in enumerate(self._scripts):
            self.results[i] = self.results[i].model_copy(update={"state": "running"})
            self._on_change()
            result = self._run_one(i, script)
            self.results[i] = result
            if result.state != "ok":
                self.state = "failed"
                self._on_change()
                return
        self._marker.write_text(self._fingerprint)
        self.state = "ok"
        self._on_change()

    def _run_one(self, index: int, script: Script) -> LifecycleResult:
        log_path = self._log_dir / f"{index:02d}-{script.path.name}.log"
        env = {**os.environ, **self._env}
        start = time.monotonic()
        with log_path.open("wb") as out:
            out.write(f"# trainpod: running {script_argv(script)}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(
                    script_argv(script),
                    cwd=script.path.parent,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                out.write(f"trainpod: cannot run the script: {exc}\n".encode())
                return LifecycleResult(
                    script=script.path.name,
                    state="failed",
                    exit_code=127,
                    duration_s=0.0,
                    log_path=str(log_path),
                    tail=str(exc),
                )
            try:
                code = proc.wait(timeout=script.timeout_s)
                state = "ok" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                # The script leads its own process group: stop all of it, not only the script.
                procutil.terminate([procutil.Owned(proc)], grace_s=KILL_GRACE_S, groups=True)
                code = proc.wait()
                state = "timeout"
                out.write(
                    f"\ntrainpod: killed after the timeout of {script.timeout_s:g}s\n".encode()
                )
        return LifecycleResult(
            script=script.path.name,
            state=state,
            exit_code=code,
            duration_s=round(time.monotonic() - start, 3),
            log_path=str(log_path),
            tail=log_tail(log_path),
        )
