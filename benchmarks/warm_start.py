"""A warm start's own cost: the agent asks its zygote for a rank -> the rank's first line,
with a child forked ahead (the spare, the default) and without (a fork on each request),
side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/warm_start.py [--runs 5] [--starts 40]

Two zygotes as the agent runs its own (torch, torch.distributed and trainpod preloaded,
dynamo and DCP imported once ready), one with ``--no-spare``. Each run starts ``--starts``
ranks through each, alternating start by start, of two scripts: a one-line script that
prints the clock, and the scheduling benchmark's job (``benchmarks/workers/trace_job.py
--steps 0``: argparse, ``import trainpod``, the preemption notice's handler, its log). Timed
per start: ``spawn()`` called -> the pid came back (the reply), and -> the script's first
line (its clock, on this machine's one clock). Starts are ``SPARE_DELAY_S`` + 50 ms apart (a
zygote forks its next spare once idle that long). A run's figure is the median of its starts;
the table gives the median [min-max] of the runs and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainpod.agent.warmstart import (  # noqa: E402
    AGENT_WARM_LATER,
    DEFAULT_PRELOAD,
    WarmStarter,
    agents_zygote_env,
)
from trainpod.agent.zygote import SPARE_DELAY_S  # noqa: E402
from trainpod.testing.wait import wait_until  # noqa: E402

SIDES = {"spare": True, "fork on request": False}
TRIVIAL = "import time\nprint(f'first {time.time():.6f}', flush=True)\n"
WORKER = REPO / "benchmarks" / "workers" / "trace_job.py"


def first_line_t(script: str, log: Path, job_dir: Path) -> float:
    if script == "trivial":
        line = next(x for x in log.read_text().splitlines() if x.startswith("first "))
        return float(line.split()[1])
    first = (job_dir / "progress.log").read_text().split()
    return float(next(f for f in first if f.startswith("t="))[2:])


def wait_warmed(side: str, w: WarmStarter, log: Path) -> None:
    def warmed() -> bool:
        return w.ready and "warmed" in log.read_text()

    wait_until(warmed, timeout_s=300, what=f"the {side} zygote and its later imports")


def one_start(w: WarmStarter, script: str, work: Path, n: int) -> tuple[float, float]:
    """(reply s, first line s) of one rank started through ``w``."""
    log, job_dir = work / f"rank-{n}.log", work / f"job-{n}"
    if script == "trivial":
        argv = [sys.executable, str(work / "trivial.py")]
    else:
        argv = [sys.executable, str(WORKER), "--dir", str(job_dir), "--steps", "0"]
        argv += ["--mode", "trainpod"]
    env = {**w.env, "PATH": os.environ.get("PATH", "")}
    t0 = time.time()
    proc = w.spawn(argv, cwd=str(work), env=env, log_path=log)
    t1 = time.time()
    if isinstance(proc, str):
        raise SystemExit(f"the zygote did not start the rank warm: {proc}")
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"the rank exited {code}: {log.read_text()}")
    return t1 - t0, first_line_t(script, log, job_dir) - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--starts", type=int, default=40, help="ranks per script, side and run")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "warm_start.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpws-") as tmp:
        root = Path(tmp)
        (root / "trivial.py").write_text(TRIVIAL)
        starters = {
            side: WarmStarter(
                socket_path=root / f"z{i}.sock",
                log_path=root / f"z{i}.log",
                env=agents_zygote_env(),
                preload=DEFAULT_PRELOAD,
                later=AGENT_WARM_LATER,
                spare=spare,
            )
            for i, (side, spare) in enumerate(SIDES.items())
        }
        for w in starters.values():
            w.start()
        try:
            for i, (side, w) in enumerate(starters.items()):
                wait_warmed(side, w, root / f"z{i}.log")
            runs: list[dict[str, object]] = []
            n = 0  # every start its own log and directory
            for run in range(args.runs):
                times: dict[str, dict[str, list[tuple[float, float]]]] = {
                    s: {"trivial": [], "worker": []} for s in SIDES
                }
                loads = [round(os.getloadavg()[0], 2)]
                for i in range(args.starts):
                    order = list(SIDES) if (i + run) % 2 == 0 else list(SIDES)[::-1]
                    for script in ("trivial", "worker"):
                        for side in order:
                            n += 1
                            times[side][script].append(one_start(starters[side], script, root, n))
                            # The zygote forks its next spare once idle for SPARE_DELAY_S.
                            time.sleep(SPARE_DELAY_S + 0.05)
                loads.append(round(os.getloadavg()[0], 2))
                fig = {
                    f"{side} {script} {what}": statistics.median(x[k] for x in ts) * 1e3
                    for side, per in times.items()
                    for script, ts in per.items()
                    for k, what in enumerate(("reply ms", "first line ms"))
                }
                runs.append({"run": run + 1, "load_1min": loads, **fig})
                print(
                    f"run {run + 1}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in fig.items())
                    + f"; load {loads}",
                    flush=True,
                )
        finally:
            for w in starters.values():
                w.close()
    keys = [k for k in runs[0] if k.endswith(" ms")]
    summary = {}
    for k in keys:
        vals = [float(str(r[k])) for r in runs]
        summary[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    print(f"\nmedian [min-max] of {args.runs} runs, {args.starts} starts each:")
    for k, v in summary.items():
        print(f"  {k:38} {v['median']:7.2f} [{v['min']:.2f}-{v['max']:.2f}]")
    for script in ("trivial", "worker"):
        a = summary[f"spare {script} first line ms"]["median"]
        b = summary[f"fork on request {script} first line ms"]["median"]
        print(f"  {script}: spare / fork on request = {a / b:.2f}")
    out = {"command": " ".join(sys.argv), "runs": runs, "summary": summary}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
