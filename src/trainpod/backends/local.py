"""The embedded local backend: the controller and one agent per node, on this machine.

Each node is an agent process with its own scratch dir and device slice: real GPUs
(CUDA_VISIBLE_DEVICES) where this machine has them, otherwise CPU slots standing in for
GPUs (simulated, and reported as such).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from trainpod.agent.facts import detect_gpus
from trainpod.agent.persisters import sweep_memory_tiers
from trainpod.backends.base import Backend, ControllerParts, ProcessStatus, register
from trainpod.backends.procs import MARKER_ENV, is_ours, read_pid, spawn, sweep, terminate
from trainpod.client.http import TrainpodClient
from trainpod.controller.config import ControllerConfig
from trainpod.controller.ports import free_port
from trainpod.errors import Conflict, ControllerUnavailable, Fatal, SpecError
from trainpod.paths import ClusterRecord, read_secret, write_secret
from trainpod.spec.cluster import ClusterSpec
from trainpod.spec.tls import ControllerSpec, is_loopback, is_wildcard, plain_http_problem

CONTROLLER = "controller"
READY_TIMEOUT_S = 120.0
"""How long `cluster start` waits for a live controller to answer (one that exits is reported
at once). Its imports alone are ~2.5 s of CPU; on a head node at load 15 (the controller kill
load at 24 nodes, tens of jobs running) a restart took over 30 s to answer."""


def python_first_path() -> dict[str, str]:
    """PATH with this interpreter's bin dir first, so ``python`` on a node is this Python
    (as with an activated venv) for lifecycle scripts and workers alike."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        path = f"{bindir}{os.pathsep}{path}"
    return {"PATH": path}


def refuse_plain_http(controller: ControllerSpec, *, insecure: bool, source: str) -> None:
    """Raise SpecError if the controller would serve plain HTTP off loopback unasked."""
    why = plain_http_problem(controller.host, controller.tls, insecure=insecure)
    if why is not None:
        raise SpecError(f"{source}: controller.host: {why}")


@register
class LocalBackend(Backend):
    name = "local"

    # -- create / start -------------------------------------------------------------------
    def create(
        self, spec: ClusterSpec, spec_path: Path, *, insecure: bool = False
    ) -> ClusterRecord:
        p = self.paths
        refuse_plain_http(spec.controller, insecure=insecure, source=str(spec_path))
        if p.record.exists():
            raise Conflict(
                f"a cluster named {spec.name!r} already exists ({p.state_dir}); "
                f"`trainpod cluster delete {spec.name}` it or change `name:` in {spec_path}"
            )
        p.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        shared = spec.storage.shared_dir or p.default_shared_dir
        scratch = spec.storage.node_scratch_root or p.default_scratch_root
        ckpt = spec.storage.checkpoint_uri or f"file://{shared / 'checkpoints'}"
        record = ClusterRecord(
            name=spec.name,
            backend=self.name,
            spec=spec.to_json(),
            spec_path=str(spec_path),
            created_at=time.time(),
            shared_dir=str(shared),
            scratch_root=str(scratch),
            checkpoint_uri=ckpt,
            **self._address(spec.controller, insecure=insecure),
        )
        record = self._new_record(record)
        write_secret(p.admin_token)
        write_secret(p.agent_token)
        record.save(p.record)
        self.start()
        return record

    def controller_parts(self, record: ClusterRecord, config: ControllerConfig) -> ControllerParts:
        """trainpod places jobs itself and replaces a node by restarting its agent afresh."""
        return ControllerParts(replacer=self.replace_node)

    def _address(self, controller: ControllerSpec, *, insecure: bool) -> dict[str, Any]:
        """The record's controller address: bind host, port, advertised host, CA, insecure."""
        host = controller.host
        advertise = controller.advertise or (
            self._wildcard_advertise() if is_wildcard(host) else None
        )
        tls = controller.tls
        return {
            "host": host,
            "port": controller.port or free_port(host),
            "advertise": advertise,
            "ca_file": None if tls is None else str(tls.trust()),
            "insecure": insecure and tls is None and not is_loopback(host),
        }

    def _wildcard_advertise(self) -> str:
        """Where clients connect to a controller bound to every interface: every process of
        a local cluster is on this machine."""
        return "127.0.0.1"

    def _new_record(self, record: ClusterRecord) -> ClusterRecord:
        """A hook for backends that record more (Slurm: its environment)."""
        return record

    def _record(self) -> ClusterRecord:
        return ClusterRecord.load(self.paths)

    def _node_slices(self, record: ClusterRecord) -> dict[str, list[str]]:
        """GPU indices per node, handed out in node order; empty without GPUs."""
        from trainpod.spec.loading import load_recorded_spec

        gpus = detect_gpus()
        out: dict[str, list[str]] = {}
        for node, group in load_recorded_spec(record).node_names():
            take = group.devices_per_node if group.role == "compute" else 0
            if gpus and take and len(gpus) >= take:
                out[node], gpus = gpus[:take], gpus[take:]
            else:
                out[node] = []
        return out

    def _nodes(self, record: ClusterRecord) -> list[str]:
        from trainpod.spec.loading import load_recorded_spec

        return [n for n, _ in load_recorded_spec(record).node_names()]

    def start(self) -> list[str]:
        record = self._record()
        p = self.paths
        marker = str(p.state_dir)
        started: list[str] = []
        if not is_ours(read_pid(p.pid_file(CONTROLLER)), marker):
            spawn(
                [sys.executable, "-m", "trainpod.controller.daemon", "--state-dir", marker],
                log=p.log_file(CONTROLLER),
                pid_file=p.pid_file(CONTROLLER),
                env={**record.env, MARKER_ENV: marker},
            )
            started.append(CONTROLLER)
        self.wait_ready(record)
        for node, gpus in self._node_slices(record).items():
            if not is_ours(read_pid(p.pid_file(f"agent-{node}")), marker):
                self._spawn_agent(node, gpus)
                started.append(f"agent-{node}")
        return started

    def _spawn_agent(self, node: str, gpus: list[str]) -> None:
        p = self.paths
        spawn(
            [
                sys.executable,
                "-m",
                "trainpod.agent.main",
                "--state-dir",
                str(p.state_dir),
                "--node",
                node,
                "--gpus",
                ",".join(gpus),
            ],
            log=p.node_dir(node) / "agent.log",
            pid_file=p.pid_file(f"agent-{node}"),
            env={**python_first_path(), MARKER_ENV: str(p.state_dir)},
        )

    def replace_node(self, node: str) -> None:
        """Replace a node like a new instance: stop its agent (and so its ranks), give it a
        clean scratch dir and a fresh (simulated) GPU, then start a new agent, which runs
        the lifecycle scripts again. Blocking; a few seconds."""
        record = self._record()
        p = self.paths
        marker = str(p.state_dir)
        pid = read_pid(p.pid_file(f"agent-{node}"))
        if pid is not None:
            terminate([pid], marker, grace_s=5.0)
        scratch = Path(record.scratch_root) / node
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True, exist_ok=True)
        node_dir = p.node_dir(node)
        for leftover in ("lifecycle.ok", "simgpu.json"):
            (node_dir / leftover).unlink(missing_ok=True)
        self._spawn_agent(node, self._node_slices(record).get(node, []))

    def wait_ready(self, record: ClusterRecord, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until the controller answers, or raise with its log tail."""
        deadline = time.monotonic() + timeout_s
        token = read_secret(self.paths.admin_token)
        with TrainpodClient.for_record(record, token, timeout_s=2) as c:
            while True:
                try:
                    c.cluster()
                    return
                except ControllerUnavailable:
                    pid = read_pid(self.paths.pid_file(CONTROLLER))
                    dead = not is_ours(pid, str(self.paths.state_dir))
                    if dead or time.monotonic() > deadline:
                        log = self.paths.log_file(CONTROLLER)
                        tail = log.read_text()[-2000:] if log.exists() else ""
                        why = "exited" if dead else f"did not answer in {timeout_s:g}s"
                        raise Fatal(
                            f"the controller {why}; its log ({log}) ends with:\n{tail}"
                        ) from None
                    time.sleep(0.05)

    # -- stop / delete --------------------------------------------------------------------
    def stop(self) -> list[str]:
        p = self.paths
        marker = str(p.state_dir)
        record = self._record()
        grace = float(record.spec.get("recovery", {}).get("teardown_grace_s", 5.0))
        stopped: list[str] = []
        agents = {f"agent-{n}": read_pid(p.pid_file(f"agent-{n}")) for n in self._nodes(record)}
        live = {name: pid for name, pid in agents.items() if is_ours(pid, marker)}
        terminate([pid for pid in live.values() if pid], marker, grace_s=grace + 5.0)
        stopped.extend(live)
        pid = read_pid(p.pid_file(CONTROLLER))
        if is_ours(pid, marker):
            assert pid is not None
            terminate([pid], marker, grace_s=5.0)
            stopped.append(CONTROLLER)
        # What outlived them: a replacement agent the controller started while it was being
        # stopped, a node repair's deep check and its device workers, an orphaned rank.
        left = sweep(marker, grace_s=grace)
        if left:
            stopped.append(f"{len(left)} leftover process{'es' if len(left) > 1 else ''}")
        return stopped

    def delete(self, *, purge: bool) -> None:
        record = self._record()
        self.stop()
        # The memory tiers (/dev/shm) that agents still list: an agent stopped or killed
        # before its jobs ended, or on Slurm one that Slurm ended mid clean-up and that no
        # later allocation brought back to its node. After this nothing knows they are ours.
        # Only this host's /dev/shm can be reached from here: a Slurm node's own is swept
        # by the next agent of the cluster there (its state file), else by the site.
        for state in sorted(self.paths.state_dir.glob("nodes/*/checkpoints.json")):
            sweep_memory_tiers(state)
        shutil.rmtree(record.scratch_root, ignore_errors=True)
        if purge:
            shutil.rmtree(record.shared_dir, ignore_errors=True)
        shutil.rmtree(self.paths.state_dir, ignore_errors=True)
        # The agents' sockets (/tmp/trainpod-<hash>/, accounts' u<uid>/ dirs included): the
        # processes that served them are gone (stop swept them), and a cluster made again
        # under the same state dir makes it afresh.
        shutil.rmtree(self.paths.runtime_dir, ignore_errors=True)

    def processes(self) -> list[ProcessStatus]:
        p = self.paths
        marker = str(p.state_dir)
        record = self._record()
        out = []
        pid = read_pid(p.pid_file(CONTROLLER))
        out.append(ProcessStatus(CONTROLLER, pid, is_ours(pid, marker), p.log_file(CONTROLLER)))
        for node in self._nodes(record):
            pid = read_pid(p.pid_file(f"agent-{node}"))
            log = p.node_dir(node) / "agent.log"
            out.append(ProcessStatus(f"agent-{node}", pid, is_ours(pid, marker), log))
        return out
