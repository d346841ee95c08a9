"""The controller ``kill -9``'d at random instants under load for N minutes (issue 14 item 3;
ADR 0034), the client's ledger audited against the store afterwards.

    flock /tmp/bench.lock python benchmarks/reliability_kills.py --part kills --minutes 5

A throwaway local cluster (``--nodes`` nodes of one rank, under a temporary TRAINPOD_HOME):
``--queued`` short jobs kept waiting (``true``, ``sleep 0.3``; 5% of the waiting ones
cancelled per look), ``--long`` jobs that run the whole time, a ``kill-worker`` fault every
~``--fault-every-s`` seconds on a running "faulted" job (a tenth of the short jobs: ``sleep
2``, ``--auto-resume``; each must end completed), and a kill every ``--min-gap-s`` to
``--max-gap-s`` seconds, each followed by the restart ``trainpod cluster start`` does.
Prints the figures (kills survived, jobs and events lost, duplicates, faults) and the
1-minute load average; exits 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from trainpod.backends.local import LocalBackend
from trainpod.backends.procs import read_pid
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths
from trainpod.testing.killload import KillLoad, audit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import local_cluster  # noqa: E402

SPEC = """\
name: kills
backend: local
instance_groups:
  - name: workers
    count: {nodes}
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 30
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["kills"], default="kills")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--long", type=int, default=3, help="long-running jobs")
    parser.add_argument("--min-gap-s", type=float, default=2.0)
    parser.add_argument("--max-gap-s", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--fault-every-s", type=float, default=5.0, help="0: no faults")
    parser.add_argument(
        "--short-max-s",
        type=float,
        default=0.3,
        help="a short job is `true` or sleeps up to this long (longer: more jobs run at once)",
    )
    parser.add_argument(
        "--true-fraction",
        type=float,
        default=0.7,
        help="the share of short jobs that are `true` (fewer: the queue stays near --queued)",
    )
    args = parser.parse_args(argv)
    if args.long >= args.nodes:
        parser.error(f"--long {args.long} needs fewer than --nodes {args.nodes} long jobs")
    with local_cluster("kills", SPEC.format(nodes=args.nodes), "trainpod-kills-") as c:
        return _run(args, c.paths, c.backend, c.client, c.tmp / "work")


def _run(
    args: argparse.Namespace,
    paths: ClusterPaths,
    backend: LocalBackend,
    client: TrainpodClient,
    workdir: Path,
) -> int:
    workdir.mkdir()
    load = KillLoad(
        lambda: read_pid(paths.pid_file("controller")),
        backend.start,
        client,
        workdir,
        default_env(),
        queued=args.queued,
        long_jobs=args.long,
        seed=args.seed,
        fault_every_s=args.fault_every_s,
        short_max_s=args.short_max_s,
        true_fraction=args.true_fraction,
    )
    load.start()
    began = time.monotonic()
    deadline = began + args.minutes * 60
    while time.monotonic() < deadline:
        load.run_kills(1, args.min_gap_s, args.max_gap_s)
    loaded = os.getloadavg()[0]
    load.finish(timeout_s=600)
    result = audit(load)
    minutes = (time.monotonic() - began) / 60
    print(
        f"reliability kills: {args.nodes} nodes, {args.long} long-running jobs, "
        f"~{args.queued} queued, {minutes:.1f} min (kills {args.min_gap_s:g}-"
        f"{args.max_gap_s:g} s apart); load average (1 min) {loaded:.1f} under load, "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    print(f"  {result.summary()}")
    print(
        f"  cancels {load.ledger.cancels}; calls that met a controller down "
        f"{load.ledger.refused_calls} (retried)"
    )
    if not result.ok:
        print(f"  FAILED: {result}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
