"""The controller process: ``python -m trainpod.controller.daemon --state-dir DIR``.

Loads the cluster record, opens the store, reconciles in a background thread and serves
the API with uvicorn. Restartable at any time: everything it knows is in SQLite.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

import uvicorn

from trainpod.api.app import create_app
from trainpod.api.models import ClusterInfo
from trainpod.backends.base import backend_for
from trainpod.controller.config import ControllerConfig, NodeDecl
from trainpod.controller.core import Controller
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.cluster import ClusterSpec
from trainpod.spec.loading import parse_cluster_spec
from trainpod.store.repo import Store

log = logging.getLogger(__name__)

STEP_INTERVAL_S = 0.25


def config_from_record(record: ClusterRecord, paths: ClusterPaths) -> ControllerConfig:
    spec = load_recorded_spec(record)
    return ControllerConfig(
        cluster=spec.name,
        backend=spec.backend,
        nodes=[
            NodeDecl(name, g.name, g.role, g.spare, g.devices_per_node)
            for name, g in spec.node_names()
        ],
        partitions={p.name: list(p.groups) for p in spec.effective_partitions()},
        default_partition=spec.default_partition().name,
        jobs_dir=paths.jobs_dir,
        shared_dir=Path(record.shared_dir),
        scratch_root=Path(record.scratch_root),
        checkpoint_uri=record.checkpoint_uri,
        heartbeat_interval_s=spec.health.heartbeat_interval_s,
        heartbeat_timeout_s=spec.health.heartbeat_timeout_s,
        teardown_grace_s=spec.recovery.teardown_grace_s,
        max_restarts=spec.recovery.max_restarts,
        hang_timeout_s=spec.health.hang_timeout_s,
        straggler_factor=spec.health.straggler_factor,
        straggler_checks=spec.health.straggler_checks,
        auto_repair=spec.recovery.auto_repair,
        retire_after=spec.recovery.retire_after,
        deep_check_timeout_s=spec.recovery.deep_check_timeout_s,
    )


def load_recorded_spec(record: ClusterRecord) -> ClusterSpec:
    return parse_cluster_spec(
        record.spec, source=record.spec_path, base_dir=Path(record.spec_path).parent
    )


def run_reconciler(controller: Controller, stop: threading.Event) -> None:
    """Call ``step()`` a few times a second, and at once when something changed."""
    while not stop.is_set():
        try:
            controller.step()
        except Exception:  # the loop must survive a bad step; the error is logged in full
            log.exception("reconcile step failed")
        controller.wakeup.wait(STEP_INTERVAL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainpod-controller")
    parser.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir.absolute()
    paths = ClusterPaths(state_dir.parent.parent, state_dir.name)
    logging.basicConfig(
        level=os.environ.get("TRAINPOD_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    record = ClusterRecord.load(paths)
    config = config_from_record(record, paths)
    store = Store.open(paths.db)
    controller = Controller(store, config)
    backend = backend_for(record.backend, paths)
    controller.repairer = backend.replace_node
    controller.bootstrap()

    def info() -> ClusterInfo:
        nodes, jobs = controller.counts()
        return ClusterInfo(
            name=record.name,
            backend=record.backend,
            controller_pid=os.getpid(),
            started_at=controller.started_at,
            nodes=nodes,
            jobs=jobs,
            partitions=config.partitions,
            shared_dir=record.shared_dir,
            scratch_root=record.scratch_root,
            checkpoint_uri=record.checkpoint_uri,
        )

    app = create_app(
        controller,
        admin_token=read_secret(paths.admin_token),
        agent_token=read_secret(paths.agent_token),
        info=info,
    )
    stop = threading.Event()
    loop = threading.Thread(target=run_reconciler, args=(controller, stop), daemon=True)
    loop.start()
    log.info("controller for %s listening on %s", record.name, record.url)
    try:
        uvicorn.run(app, host=record.host, port=record.port, log_level="warning", access_log=False)
    finally:
        stop.set()
        controller.wakeup.set()


if __name__ == "__main__":
    main()
