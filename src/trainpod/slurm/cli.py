"""Running Slurm's commands and reading their JSON output (never screen-scraped text).

Every command runs with the cluster's environment (``SLURM_CONF``) and a timeout; a
failure raises :class:`SlurmError` naming the command and Slurm's own message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from trainpod.controller.ops import ExternalJob, ExternalNode
from trainpod.errors import Fatal
from trainpod.slurm.hostlist import expand

TIMEOUT_S = 30.0


class SlurmError(Fatal):
    """A Slurm command failed or is missing."""


class Slurm:
    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> None:
        self.env = dict(env or {})
        self.timeout_s = timeout_s

    def run(self, argv: Sequence[str], *, stdin: str | None = None) -> str:
        if shutil.which(argv[0]) is None:
            raise SlurmError(
                f"`{argv[0]}` is not installed here; run trainpod's Slurm backend on a Slurm "
                "login/head node (Debian: apt-get install slurm-client)"
            )
        try:
            proc = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                env={**os.environ, **self.env},
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{' '.join(argv)}` did not answer in {self.timeout_s:g}s") from None
        if proc.returncode != 0:
            why = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
            raise SlurmError(f"`{' '.join(argv)}` failed: {why}")
        return proc.stdout

    def json(self, argv: Sequence[str]) -> dict[str, Any]:
        out = self.run(argv)
        try:
            data = json.loads(out)
        except json.JSONDecodeError as exc:
            raise SlurmError(f"`{' '.join(argv)}` printed no JSON ({exc}): {out[:200]!r}") from None
        if not isinstance(data, dict):
            raise SlurmError(f"`{' '.join(argv)}` printed {type(data).__name__}, not an object")
        errors = [e for e in data.get("errors", []) if e]
        if errors:
            raise SlurmError(f"`{' '.join(argv)}` reported: {errors}")
        return data

    # -- queries ------------------------------------------------------------------------
    def _sinfo_nodes(self) -> list[dict[str, Any]]:
        # scontrol has no --json before Slurm 23.02; sinfo and squeue have it since 21.08.
        nodes = self.json(["sinfo", "--json"]).get("nodes", [])
        return [n for n in nodes if isinstance(n, dict)]

    def nodes(self) -> dict[str, ExternalNode]:
        return {n.name: n for n in (parse_node(raw) for raw in self._sinfo_nodes())}

    def partitions(self) -> dict[str, list[str]]:
        """Partition name -> its node names."""
        out: dict[str, list[str]] = {}
        for raw in self._sinfo_nodes():
            for part in raw.get("partitions") or []:
                out.setdefault(str(part), []).append(str(raw.get("name")))
        return out

    def jobs(self) -> dict[str, ExternalJob]:
        """Every job slurmctld still knows (finished ones for MinJobAge), by id."""
        data = self.json(["squeue", "--json"])
        return {j.id: j for j in (parse_job(raw) for raw in data.get("jobs", []))}

    # -- actions ------------------------------------------------------------------------
    def sbatch(self, script: str) -> str:
        out = self.run(["sbatch", "--parsable"], stdin=script).strip()
        return out.split(";")[0]

    def scancel(self, job: str) -> None:
        self.run(["scancel", job])

    def release(self, job: str) -> None:
        self.run(["scontrol", "release", job])

    def requeue(self, job: str) -> None:
        self.run(["scontrol", "requeue", job])

    def update_job(self, job: str, **fields: str) -> None:
        self.run(["scontrol", "update", f"jobid={job}", *(f"{k}={v}" for k, v in fields.items())])

    def drain(self, node: str, reason: str) -> None:
        self.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"])

    def resume(self, node: str) -> None:
        self.run(["scontrol", "update", f"nodename={node}", "state=resume"])


def _state(value: Any) -> tuple[str, frozenset[str]]:
    """Slurm's state fields: a string (22.05: "idle", "down*", "IDLE+DRAIN") or a list."""
    if isinstance(value, list):
        words = [str(v).upper() for v in value]
    else:
        words = str(value or "").upper().replace("*", "").split("+")
    words = [w for w in words if w]
    return (words[0] if words else "UNKNOWN"), frozenset(words[1:])


def parse_node(raw: Mapping[str, Any]) -> ExternalNode:
    state, flags = _state(raw.get("state"))
    extra = raw.get("state_flags") or []
    flags = flags | frozenset(str(f).upper() for f in extra)
    return ExternalNode(
        name=str(raw.get("name", "")), state=state, flags=flags, reason=str(raw.get("reason", ""))
    )


def parse_job(raw: Mapping[str, Any]) -> ExternalJob:
    state, _ = _state(raw.get("job_state"))
    nodes = raw.get("nodes") or ""
    return ExternalJob(
        id=str(raw.get("job_id", "")),
        state=state,
        reason="" if raw.get("state_reason") in (None, "None") else str(raw["state_reason"]),
        nodes=tuple(expand(str(nodes))) if nodes and nodes != "None assigned" else (),
        restarts=int(raw.get("restart_cnt") or 0),
    )
