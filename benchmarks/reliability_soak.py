"""A soak (issue 14 item 6): a local cluster run for ``--minutes`` with a stream of short
jobs, small GPT jobs that checkpoint through trainpod.Checkpointer, and a fault every
``--fault-every-s`` seconds; prints each resource's growth per hour and what was left at rest
(``trainpod.testing.soak``). Exits 1 when a job did not end as its ledger says or something
was left behind.

    flock /tmp/bench.lock python benchmarks/reliability_soak.py --minutes 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainpod.backends.procs import read_pid
from trainpod.cli.jobs import default_env
from trainpod.client.http import JOBS_PAGE
from trainpod.controller import memtrace
from trainpod.testing.soak import MEASURES, SPEC, Sample, Sampler, Soak, gpt_argv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import json_safe, local_cluster  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3, help="worker nodes (+1 hot spare)")
    parser.add_argument("--fault-every-s", type=float, default=30.0)
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument(
        "--view-cache-mib",
        type=int,
        default=64,
        help="the controller's read caches' bound (controller.view_cache_mib)",
    )
    parser.add_argument("--list-every-s", type=float, default=30.0)
    parser.add_argument(
        "--list-page",
        type=int,
        default=JOBS_PAGE,
        help="jobs per call of each listing (0: the whole list in one call, as before)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--tracemalloc",
        type=Path,
        default=None,
        help="trace the controller's Python allocations (slows it) and write its snapshots "
        "here; the growth between the second and the last is printed and kept in --json",
    )
    args = parser.parse_args(argv)
    if args.tracemalloc is not None:  # the controller inherits the environment
        os.environ[memtrace.DIR_ENV] = str(args.tracemalloc.absolute())
        os.environ.setdefault(memtrace.EVERY_ENV, str(max(60.0, args.minutes * 6.0)))
    spec = SPEC.format(name="soak", workers=args.workers, view_cache_mib=args.view_cache_mib)
    with local_cluster("soak", spec, "trainpod-soak-") as c:
        workdir = c.tmp / "work"
        workdir.mkdir()
        soak = Soak(
            c.client,
            Sampler(
                c.paths,
                [n.name for n in c.client.nodes()],
                lambda proc: read_pid(c.paths.pid_file(proc)),
                metrics=c.client.metrics,
            ),
            workdir,
            default_env(),
            train_argv=gpt_argv(sys.executable, REPO / "examples"),
            fault_every_s=args.fault_every_s,
            sample_every_s=args.sample_every_s,
            list_every_s=args.list_every_s,
            list_page=args.list_page or None,
            seed=args.seed,
        )
        began = time.monotonic()
        result = soak.run(args.minutes)
        wall = time.monotonic() - began
    print(result.report())
    print(f"faults refused (the ranks had ended since the look; tried again): {soak.missed}")
    print(f"wall {wall / 60:.1f} min; load average (1 min) at the end {os.getloadavg()[0]:.1f}")
    traced = traced_growth(args.tracemalloc) if args.tracemalloc is not None else None
    bad = result.mismatches() + result.leaks_at_rest()
    for line in result.mismatches():
        print(f"  MISMATCH {line}", file=sys.stderr)
    if args.json:
        at_rest = {n: [m(result.baseline), m(result.final)] for n, m in MEASURES.items()}
        args.json.write_text(
            json.dumps(
                json_safe(
                    {
                        "minutes": args.minutes,
                        "view_cache_mib": args.view_cache_mib,
                        "jobs": len(result.ledger.expected),
                        "faults": len(result.ledger.faults),
                        "faults_refused": soak.missed,
                        "mismatches": result.mismatches(),
                        "growth_per_hour": result.growth(),
                        "at_rest_before_after": at_rest,
                        "leaks_at_rest": result.leaks_at_rest(),
                        "load_1min_end": round(os.getloadavg()[0], 2),
                        "by_minute": by_minute(result.samples),
                        "tracemalloc_growth": traced,
                    }
                ),
                indent=2,
            )
            + "\n"
        )
    return 1 if bad else 0


def traced_growth(snapshots: Path) -> dict[str, object] | None:
    """The controller's traced growth from its second snapshot (the first may still hold
    start-up) to its last, printed, as JSON (None: fewer than three snapshots)."""
    snaps = sorted(snapshots.glob("snapshot-*.tracemalloc"))
    if len(snaps) < 3:
        print(f"tracemalloc: {len(snaps)} snapshots in {snapshots}; need 3 to compare")
        return None
    top = memtrace.growth(snaps[1], snaps[-1], frames=4, top=20)
    print(f"controller's Python allocations, {snaps[1].name} -> {snaps[-1].name}:")
    for g in top:
        print(f"  {g.size_diff / 1024:+10.1f} KiB {g.count_diff:+8d}  {' <- '.join(g.where)}")
    return {
        "from": snaps[1].name,
        "to": snaps[-1].name,
        "top": [
            {"where": list(g.where), "size_diff": g.size_diff, "count_diff": g.count_diff}
            for g in top
        ],
    }


def by_minute(samples: list[Sample], every_min: float = 5.0) -> list[dict[str, float]]:
    """Every measure at about every ``every_min`` minutes of the run: where a growth levels off."""
    out: list[dict[str, float]] = []
    for s in samples:
        minute = (s.t - samples[0].t) / 60
        if not out or minute - out[-1]["minute"] >= every_min:
            out.append(
                {"minute": round(minute, 1)} | {n: round(m(s), 1) for n, m in MEASURES.items()}
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
