"""The controller process: ``python -m trainpod.controller.daemon --state-dir DIR``.

Loads the cluster record, opens the store, reconciles in a background thread and serves
the API with uvicorn. Restartable at any time: everything it knows is in SQLite.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import pwd
import signal
import ssl
import threading
import time
from pathlib import Path

import uvicorn
import uvicorn.config

from trainpod.api.app import create_app
from trainpod.api.models import ClusterInfo
from trainpod.backends.base import backend_for
from trainpod.controller import memtrace
from trainpod.controller.certreload import CertReloader
from trainpod.controller.config import ControllerConfig, NodeDecl, PreemptionConfig
from trainpod.controller.core import Controller
from trainpod.controller.external import Scheduling
from trainpod.controller.ops import ClusterOps
from trainpod.controller.tensorboard import GoodputFollower
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret, write_secret
from trainpod.spec.loading import load_recorded_spec
from trainpod.spec.sharing import quota_nodes
from trainpod.spec.tls import ControllerSpec, TlsSpec, plain_http_problem
from trainpod.store.backup import check, refuse_corrupt
from trainpod.store.repo import Store
from trainpod.store.walcheckpoint import AUTOCHECKPOINT_CAP_PAGES, WalCheckpointer

log = logging.getLogger(__name__)

STEP_INTERVAL_S = 0.25
BACKLOG = 4096  # pending connections: every agent of a large cluster (re)connects at once
KEEP_ALIVE_S = 60
"""How long an idle client connection is kept open (uvicorn's default: 5 s). Clients drop
theirs sooner (``trainpod.client.http.KEEPALIVE_S``), so a server-side close never meets a
reused connection mid-request."""
OBSERVE_INTERVAL_S = 2.0
# The cyclic garbage collector's generation thresholds (CPython's default: 700, 10, 10).
# With ~1,200 heartbeats a second in flight, every 700 allocations found live requests'
# objects (parsed beats, replies, futures) and promoted them: a full collection of the
# ~250,000-object heap came every ~2.5 s and took ~0.4 s with the GIL held, a third of the
# controller's CPU and most of the heartbeats' p99 (ADR 0015). Objects of a request die
# young (reference counting frees them) if the young generation is large enough to outlast
# a request; cycles are still collected, only less often.
GC_THRESHOLDS = (50_000, 20, 10)


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
        exit_wait_s=spec.health.exit_wait_s,
        straggler_factor=spec.health.straggler_factor,
        straggler_checks=spec.health.straggler_checks,
        auto_repair=spec.recovery.auto_repair,
        retire_after=spec.recovery.retire_after,
        deep_check_timeout_s=spec.recovery.deep_check_timeout_s,
        preemption=PreemptionConfig(
            signal=spec.preemption.signal,
            grace_s=spec.preemption.grace_s,
            min_run_s=spec.preemption.min_run_s,
            lend_reserved=spec.preemption.lend_reserved,
        ),
        extra={"cluster_id": f"{spec.name}-{record.created_at:.0f}"},
        priority_classes=spec.priority_classes,
        teams=spec.teams,
        team_quotas={t.name: quota_nodes(spec, t) for t in spec.teams},
        users=spec.users,
        fair_share_half_life_s=spec.fair_share.half_life_s,
        operator=_owner_of(paths.admin_token),
        carbon=spec.carbon_intensity(),
        view_cache_bytes=spec.controller.view_cache_mib << 20,
    )


def watch_certificate(reloader: CertReloader, stop: threading.Event) -> None:
    """Serve a renewed certificate from the next connection on: looked for every few
    seconds, and at once on SIGHUP (``kill -HUP``, as nginx and HAProxy take it)."""
    signal.signal(signal.SIGHUP, lambda *_: reloader.wake.set())
    threading.Thread(target=reloader.run, args=(stop,), name="cert-reload", daemon=True).start()


def _owner_of(path: Path) -> str:
    """The POSIX user owning ``path`` (the admin token: the cluster's creator)."""
    try:
        return pwd.getpwuid(path.stat().st_uid).pw_name
    except (KeyError, OSError):
        return "admin"


def _scrape_token(paths: ClusterPaths) -> str:
    """Prometheus' token for /metrics, made on the first start (also for older clusters)."""
    if not paths.scrape_token.exists():
        return write_secret(paths.scrape_token)
    return read_secret(paths.scrape_token)


STEP_BACKOFF_MAX_S = 30.0
PRUNE_INTERVAL_S = 3600.0  # how often the event log's retention is applied


class StepHealth:
    """How the reconcile loop fares: failures in a row and the last error, for
    ``trainpod cluster describe``; a failing step backs off instead of looping hot."""

    def __init__(self) -> None:
        self.failures_in_a_row = 0
        self.total_failures = 0
        self.last_error = ""
        self.last_error_at: float | None = None

    def delay_s(self) -> float:
        if not self.failures_in_a_row:
            return STEP_INTERVAL_S
        backoff: float = STEP_INTERVAL_S * 2.0 ** min(self.failures_in_a_row, 16)
        return min(backoff, STEP_BACKOFF_MAX_S)


def run_reconciler(
    controller: Controller, stop: threading.Event, health: StepHealth | None = None
) -> None:
    """Call ``step()`` a few times a second, and at once when something changed. A step
    that keeps failing backs off (up to STEP_BACKOFF_MAX_S) and records an event when a
    run of failures starts and when it ends."""
    health = health or StepHealth()
    next_prune = time.monotonic() + PRUNE_INTERVAL_S
    while not stop.is_set():
        if time.monotonic() >= next_prune:
            next_prune = time.monotonic() + PRUNE_INTERVAL_S
            try:
                pruned = controller.prune_events()
                if pruned:
                    log.info(
                        "event retention: %d events older than %g days removed",
                        pruned,
                        controller.cfg.event_retention_days,
                    )
            except Exception:  # retention is housekeeping: the loop goes on without it
                log.exception("pruning the event log failed")
        try:
            controller.step()
        except Exception as exc:  # the loop must survive a bad step; the error is logged in full
            log.exception("reconcile step failed (%d in a row)", health.failures_in_a_row + 1)
            health.failures_in_a_row += 1
            health.total_failures += 1
            health.last_error = f"{type(exc).__name__}: {exc}"
            health.last_error_at = time.time()
            if health.failures_in_a_row == 1:
                controller.record_step_failure(health.last_error, 1)
            stop.wait(health.delay_s())
            continue
        if health.failures_in_a_row:
            controller.record_step_failure("", health.failures_in_a_row)
            health.failures_in_a_row = 0
        controller.wakeup.wait(STEP_INTERVAL_S)


def run_observer(controller: Controller, ops: ClusterOps, stop: threading.Event) -> None:
    """Look at the external scheduler every OBSERVE_INTERVAL_S (Slurm commands run outside
    the controller's lock) and apply what changed."""
    while not stop.wait(OBSERVE_INTERVAL_S):
        try:
            obs = ops.observe(controller.external_ids())
            if obs is not None:
                controller.observe(obs)
        except Exception:  # Slurm may be briefly unreachable; the next look retries
            log.exception("looking at the external scheduler failed")


def refuse_a_damaged_db(paths: ClusterPaths) -> None:
    """Stop before opening a database that fails its check (ADR 0034): the log, and so
    ``trainpod cluster start``'s error, names the file, the check and the command to run."""
    if not paths.db.exists():  # the first start creates it
        return
    result = check(paths.db, quick=True)
    if not result.ok:
        hint = f"`trainpod cluster restore {paths.name}` (newest backup in {paths.backups})"
        error = refuse_corrupt(paths.db, result, hint)
        log.error("%s", error)
        raise SystemExit(f"trainpod-controller: {error}")


def tune_gc() -> None:
    """Once started (modules, the app, the store's first reads): what exists now lives as
    long as the process, so it is frozen out of every later collection, and the young
    generation is made large (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def serving_tls(record: ClusterRecord, controller: ControllerSpec) -> TlsSpec | None:
    """The certificate to serve with, or None for plain HTTP; refuses plain HTTP off
    loopback unless the cluster was created ``--insecure`` (ADR 0040), and warns when so."""
    why = plain_http_problem(record.host, controller.tls, insecure=record.insecure)
    if why is not None:
        raise SystemExit(f"refusing to start: {why} (`trainpod cluster create --insecure`)")
    if record.insecure:
        log.warning(
            "serving plain HTTP on %s, which is not loopback: created with --insecure; "
            "tokens cross the network in clear text (give controller.tls to serve HTTPS)",
            record.host,
        )
    return controller.tls


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
    refuse_a_damaged_db(paths)
    spec = load_recorded_spec(record)
    tls = serving_tls(record, spec.controller)
    busy_s = spec.storage.state_db_busy_timeout_s
    store = Store.open(paths.db, busy_timeout_s=busy_s)
    wal = WalCheckpointer(paths.db)  # outside the lock, not inside a commit
    store.checkpoint_at(AUTOCHECKPOINT_CAP_PAGES)
    parts = backend_for(record.backend, paths).controller_parts(record, config)
    controller = Controller(
        store, config, scheduling=parts.scheduling or Scheduling, replacer=parts.replacer
    )
    controller.bootstrap()
    health = StepHealth()

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
            step_failures_in_a_row=health.failures_in_a_row,
            step_failures=health.total_failures,
            last_step_error=health.last_error,
            last_step_error_at=health.last_error_at,
        )

    stop = threading.Event()
    stopped = threading.Lock()

    def shut_down() -> None:
        """Once: stop the loops, write what is only in memory, close the store (the last
        connection's close folds SQLite's log into the database file: a stopped cluster's
        state is one file, ADR 0034)."""
        if not stopped.acquire(blocking=False):
            return
        stop.set()
        controller.wakeup.set()
        controller.flush_energy()
        wal.close()  # first: the store's close must be the last, to fold the log
        controller.close()
        log.info("controller for %s stopped; store closed", record.name)

    app = create_app(
        controller,
        admin_token=read_secret(paths.admin_token),
        agent_token=read_secret(paths.agent_token),
        info=info,
        scrape_token=_scrape_token(paths),
        on_shutdown=shut_down,
    )
    tune_gc()
    memtrace.start_from_env(stop)  # a soak's tracemalloc snapshots; off unless asked for
    wal.start()
    loop = threading.Thread(target=run_reconciler, args=(controller, stop, health), daemon=True)
    loop.start()
    if parts.ops is not None:
        watch = threading.Thread(
            target=run_observer, args=(controller, parts.ops, stop), daemon=True
        )
        watch.start()
    goodput = GoodputFollower(
        shared_dir=config.shared_dir,
        active_jobs=lambda: controller.job_infos(include_ended=False),
        jobs=controller.views.of_jobs,
        changes=controller.views.changes,
        events=lambda job_id: controller.event_infos(job_id=job_id),
    )
    threading.Thread(target=goodput.run, args=(stop,), name="tensorboard", daemon=True).start()
    log.info("controller for %s listening on %s", record.name, record.url)
    serving = uvicorn.Config(
        app,
        host=record.host,
        port=record.port,
        log_level="warning",
        access_log=False,
        # Named rather than "auto": both are dependencies, and a silent fall-back to the
        # pure-Python h11 parser and asyncio's loop would cost every heartbeat.
        http="httptools",
        loop="uvloop",
        backlog=BACKLOG,
        # Nothing reads a client's address; uvicorn's X-Forwarded-For rewriting is a
        # middleware run on every request, heartbeats included.
        proxy_headers=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_certfile=None if tls is None else str(tls.cert),
        ssl_keyfile=None if tls is None else str(tls.key),
    )
    serving.load()  # makes the SSLContext now, so that a renewed certificate goes into it
    if tls is not None and serving.ssl is not None:

        def make_context(cert: Path, key: Path) -> ssl.SSLContext:
            """What uvicorn made at its start, from the renewed files."""
            return uvicorn.config.create_ssl_context(
                cert,
                key,
                password=None,
                ssl_version=serving.ssl_version,
                cert_reqs=serving.ssl_cert_reqs,
                ca_certs=serving.ssl_ca_certs,
                ciphers=serving.ssl_ciphers,
            )

        reloader = CertReloader(serving.ssl, tls.cert, tls.key, make_context=make_context)
        watch_certificate(reloader, stop)
    try:
        uvicorn.Server(serving).run()
    finally:
        shut_down()


if __name__ == "__main__":
    main()
