"""Beacon benchmark: what ``trainpod.report()`` costs a training loop per call.

In one run, interleaved so that all modes see the same machine load, it times ``--calls``
iterations (default 100k) of three loops, ``--runs`` times (default 5), and reports the
median of each:

* ``baseline``: ``for i in range(n): pass``;
* ``empty fn``: a call of an empty ``def f(step, **metrics)`` (the floor of any call);
* ``env unset``: ``trainpod.report(i, loss=0.5, tokens=4096)`` outside trainpod (no-op);
* ``agent``: the same call with ``TRAINPOD_BEACON_SOCKET`` pointing at a real
  :class:`~trainpod.agent.beacons.BeaconServer` running in a separate process (as the
  agent would). The loop runs flat out, far faster than any training loop, so the agent
  falls behind and some calls take the drop path (counted and printed); that path costs
  more than a successful send, so the figure is an upper bound.

Per call it prints ns, the ratio to the baseline, and the overhead over the baseline as a
fraction of a 10 ms training step (target: < 1%; PASS/FAIL is printed). It also measures
``import trainpod`` (``-X importtime``, median of 5 fresh interpreters).

Run it from the repository root::

    .venv/bin/python benchmarks/beacon.py [--calls 100000] [--runs 5] \\
        [--json benchmarks/results/beacon.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trainpod
from trainpod import beacon

DEFAULT_JSON = Path(__file__).parent / "results" / "beacon.json"
STEP_S = 0.010
TARGET = 0.01  # overhead / step

AGENT = """
import sys
from pathlib import Path
from trainpod.agent.beacons import BeaconServer
srv = BeaconServer(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
srv.close()
print(srv.received, srv.bad, flush=True)
"""


def loop_pass(n: int) -> None:
    for _ in range(n):
        pass


def _empty(step: int, **metrics: float) -> None:
    pass


def loop_empty(n: int) -> None:
    f = _empty
    for i in range(n):
        f(i, loss=0.5, tokens=4096)


def loop_report(n: int) -> None:
    report = trainpod.report
    for i in range(n):
        report(i, loss=0.5, tokens=4096)


def timed(fn: Callable[[int], None], n: int) -> float:
    """Seconds per call of one run of ``n`` calls."""
    t0 = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - t0) / n / 1e9


def import_time_ms(runs: int = 5) -> float:
    """Median cumulative ``import trainpod`` time in fresh interpreters, in ms."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPOD_")}
    samples = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import trainpod"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        for line in out.stderr.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] == "trainpod":
                samples.append(int(parts[1]) / 1000)
    return statistics.median(samples)


def with_env(socket_path: str | None) -> None:
    for key in ("TRAINPOD_BEACON_SOCKET", "TRAINPOD_ATTEMPT_ID", "RANK"):
        os.environ.pop(key, None)
    if socket_path is not None:
        os.environ.update(TRAINPOD_BEACON_SOCKET=socket_path, TRAINPOD_ATTEMPT_ID="1", RANK="0")
    beacon.reset()


def measure(calls: int, runs: int, socket_path: str) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"baseline": [], "empty fn": [], "env unset": [], "agent": []}
    sent = dropped = 0
    loop_report(1000)  # warm up the no-op path (env unset by the caller)
    for _ in range(runs):
        samples["baseline"].append(timed(loop_pass, calls))
        samples["empty fn"].append(timed(loop_empty, calls))
        with_env(None)
        samples["env unset"].append(timed(loop_report, calls))
        with_env(socket_path)
        trainpod.report(-1)  # connect outside the timed loop
        samples["agent"].append(timed(loop_report, calls))
        st = beacon.stats()
        sent, dropped = sent + st.sent, dropped + st.dropped  # sent includes the connect call
        with_env(None)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {"samples_s": samples, "median_s": medians, "sent": sent, "dropped": dropped}


def start_agent(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit("the beacon server did not start")
    return proc


def stop_agent(proc: subprocess.Popen[str]) -> tuple[int, int]:
    out, _ = proc.communicate("", timeout=30)
    received, bad = out.split()
    return int(received), int(bad)


def report_text(res: dict[str, Any]) -> str:
    med = res["median_s"]
    base = med["baseline"]
    lines = [
        f"trainpod.report() per call, median of {res['runs']} runs x {res['calls']:,} calls"
        f" ({res['machine']['cpu_count']} CPUs, Python {res['machine']['python']})",
        f"  {'mode':<10} {'ns/call':>9} {'x baseline':>11} {'overhead ns':>12} {'% of 10 ms':>11}",
    ]
    for mode in ("baseline", "empty fn", "env unset", "agent"):
        v = med[mode]
        over = max(0.0, v - base)
        lines.append(
            f"  {mode:<10} {v * 1e9:9.1f} {v / base:11.1f} {over * 1e9:12.1f}"
            f" {over / STEP_S * 100:10.4f}%"
        )
    a = res["agent"]
    lines.append(
        f"  agent run: {a['sent']:,} sent, {a['dropped']:,} dropped by the sender"
        f" ({a['dropped_share'] * 100:.1f}%: the loop outruns the receiver),"
        f" {a['received']:,} received, {a['bad']} bad"
    )
    lines.append(f"  import trainpod: {res['import_ms']:.1f} ms (cumulative, -X importtime)")
    verdict = "PASS" if res["pass"] else "FAIL"
    lines.append(
        f"  {verdict}: agent overhead {res['agent_fraction_of_step'] * 100:.4f}% of a 10 ms step"
        f" (target < {TARGET * 100:g}%)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=100_000, help="calls per timed run")
    p.add_argument("--runs", type=int, default=5, help="runs per mode (the median is reported)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = p.parse_args(argv)

    saved = {k: os.environ.get(k) for k in ("TRAINPOD_BEACON_SOCKET", "TRAINPOD_ATTEMPT_ID")}
    with_env(None)
    tmp = Path(tempfile.mkdtemp(prefix="tpbench-", dir="/tmp"))  # AF_UNIX paths are short
    agent = start_agent(tmp / "beacon.sock")
    try:
        res = measure(args.calls, args.runs, str(tmp / "beacon.sock"))
    finally:
        received, bad = stop_agent(agent)
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    med = res["median_s"]
    overhead = max(0.0, med["agent"] - med["baseline"])
    total = res["sent"] + res["dropped"]
    results: dict[str, Any] = {
        "benchmark": "beacon",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
        },
        "calls": args.calls,
        "runs": args.runs,
        "call": "trainpod.report(i, loss=0.5, tokens=4096)",
        "median_s": med,
        "samples_s": res["samples_s"],
        "ratio_to_baseline": {k: v / med["baseline"] for k, v in med.items()},
        "overhead_s": {k: max(0.0, v - med["baseline"]) for k, v in med.items()},
        "agent": {
            "sent": res["sent"],
            "dropped": res["dropped"],
            "dropped_share": res["dropped"] / total if total else 0.0,
            "received": received,
            "bad": bad,
        },
        "step_s": STEP_S,
        "agent_fraction_of_step": overhead / STEP_S,
        "target_fraction_of_step": TARGET,
        "pass": overhead / STEP_S < TARGET,
        "import_ms": import_time_ms(),
    }
    print(report_text(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"  results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
