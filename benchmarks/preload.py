"""Crash -> the restarted rank past its imports, with and without ``--preload`` (issue 12
item 4; ADR 0042), side by side on one local cluster.

    flock /tmp/bench.lock python benchmarks/preload.py [--runs 5] [--module lightning]

Each run submits a one-rank job whose script imports ``--module`` (lightning: ~3 s of CPU
here), waits for the test's word and crashes once; ``--auto-resume`` restarts it on the same
node. Timed: from the crash (the file the script waits for is created) to the second
attempt's rank printing the clock right after its imports. With ``--preload`` the benchmark
first waits for the job's warm-start server to be ready (so the figure is the restart's, not
the server's warm-up); without, the restart forks from the agent's zygote (torch imported,
the module not). Modes alternate run by run; medians, spreads and the ratio are printed with
the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from trainpod.cli.jobs import default_env
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import LocalCluster, local_cluster  # noqa: E402

SPEC = """\
name: preload
backend: local
instance_groups:
  - name: workers
    count: 1
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 10
"""

SCRIPT = """\
import os, sys, time
import {module}
print(f"past imports at {{time.time():.6f}} attempt {{os.environ['TRAINPOD_ATTEMPT']}}",
      flush=True)
if os.environ["TRAINPOD_ATTEMPT"] == "1":
    while not os.path.exists(os.environ["CRASH_FILE"]):
        time.sleep(0.01)
    sys.exit(3)
"""

PAST = re.compile(r"past imports at ([0-9.]+) attempt 2")
SERVER = re.compile(r"zygote (\d+): preloaded ")


def one_run(c: LocalCluster, work: Path, module: str, preload: bool, n: int) -> float:
    script = work / "restart_me.py"
    script.write_text(SCRIPT.format(module=module))
    crash = work / f"crash-{n}-{int(preload)}"  # one per job: a stale one crashes at once
    job = c.client.submit(
        JobSpec(
            command=[sys.executable, str(script)],
            env={**default_env(), "CRASH_FILE": str(crash)},
            workdir=str(work),
            nodes=1,
            procs_per_node=1,
            auto_resume=True,
            max_restarts=1,
            preload=[module] if preload else [],
            name=f"preload-{'on' if preload else 'off'}",
        )
    )
    node = c.paths.node_dir("workers-0")
    wait_until(
        lambda: "attempt 1" in c.client.logs(job.id, rank=0, attempt=1).data,
        timeout_s=300,
        what=f"job {job.id}'s first attempt past its imports",
    )
    if preload:
        log = node / f"zygote-job-{job.id}.log"
        found = wait_until(
            lambda: SERVER.search(log.read_text()) if log.exists() else None,
            timeout_s=300,
            what=f"job {job.id}'s preload server",
        )
        ready = re.compile(rf"warm-start server \(pid {found.group(1)}\) ready")
        wait_until(lambda: ready.search((node / "agent.log").read_text()), timeout_s=60)
    t_crash = time.time()
    crash.touch()
    done = wait_until(
        lambda: (
            PAST.search(c.client.logs(job.id, rank=0, attempt=2).data)
            if len(c.client.job(job.id).attempts) == 2
            else None
        ),
        timeout_s=300,
        interval_s=0.05,
        what=f"job {job.id}'s restart past its imports",
    )
    wait_until(lambda: c.client.job(job.id).state == "completed", timeout_s=120)
    return float(done.group(1)) - t_crash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--module", default="lightning")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with local_cluster("preload", SPEC, "trainpod-preload-") as c:
        work = c.tmp / "work"
        work.mkdir()
        for n in range(args.runs):
            for mode in ("off", "on"):
                s = one_run(c, work, args.module, mode == "on", n)
                times[mode].append(s)
                print(f"run {n + 1} --preload {mode}: crash -> past imports {s:.3f} s", flush=True)
    load = os.getloadavg()[0]
    med = {m: statistics.median(v) for m, v in times.items()}
    for m, v in times.items():
        print(
            f"--preload {m:3}: median {med[m]:.3f} s (min {min(v):.3f}, max {max(v):.3f}, "
            f"n={len(v)})"
        )
    print(f"ratio on/off {med['on'] / med['off']:.2f}; import {args.module}; load {load:.1f}")
    if args.json:
        args.json.write_text(
            json.dumps({"module": args.module, "seconds": times, "load_1min": load}, indent=2)
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
