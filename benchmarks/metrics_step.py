"""What observability costs a training step: the beacon path with metrics on vs off.

Part of ``benchmarks/metrics.py`` (``--part step``). A training loop runs ``--steps`` steps
(default 300) of ``--step-ms`` (default 10 ms) of work, calling
``trainpod.report(step, loss=..., tokens=...)`` after each, against three agents, each a
separate process with a real :class:`~trainpod.agent.beacons.BeaconServer` on its own socket:

* ``on``: the agent as ``trainpod.agent.main`` builds it: the server hands every batch to a
  :class:`~trainpod.agent.tensorboard.TensorBoardTap` watching the attempt, whose writer
  thread writes each rank-0 beacon to the job's TensorBoard event file (the per-step scalars:
  ``metrics/loss``, ``metrics/tokens``, ``trainpod/steps_per_s``, ...) and flushes it;
* ``off``: the same server with no tap. This is what "metrics off" honestly means here: the
  beacons are still sent and booked, because the hang and straggler detectors and goodput
  need them whether or not anybody looks at metrics; what observability adds on a node is
  the TensorBoard writing (the controller's ``/metrics`` reads what heartbeats carry anyway,
  on the controller's machine, never on the training step's path);
* ``none``: no agent (``TRAINPOD_BEACON_SOCKET`` unset: ``report`` is a no-op), for scale:
  the whole beacon path against nothing.

Besides the step times it reports the CPU the ``on`` agent spent beyond the ``off`` one per
beacon (both agents' own ``process_time``: receiver and writer threads), as a share of the
nominal step: on a shared, loaded box that figure holds where a 1% difference of step
times drowns in the noise.

The step's work is a CPU matmul (torch, one thread) STANDING IN for a GPU step: there is no
GPU here, so the loop, the receiver and the writer compete for the same two cores (and
whatever else the box runs), which makes the figure an upper bound of what a GPU node pays.
The modes are interleaved run by run (their order rotated) so each sees the same load; a
run's figure is its mean step time; the median of ``--runs`` runs (default 7) per mode is
compared, with the spread of the per-run on/off ratios. Target: ``on`` costs at most 1%
over ``off``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainpod import beacon

TARGET = 0.01
MODES = ("on", "off", "none")

AGENT = """
import sys
import time
from pathlib import Path
from trainpod.agent.beacons import BeaconServer
from trainpod.agent.tensorboard import TensorBoardTap
from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.telemetry.tensorboard import ENV, StepScalars
sock, logdir, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tap = None
if mode == "on":
    warm = StepScalars(Path(logdir + "-warm"), attempt=1)  # import what writing needs now
    warm.beacon(0, 0.0, {"loss": 1.0})
    warm.close()
    tap = TensorBoardTap()
    order = LaunchOrder(attempt_id=1, job_id=1, attempt_number=1, argv=["train"], workdir="/",
                        env={ENV: logdir}, ranks=[RankSlot(rank=0, local_rank=0)], log_dir="/")
    assert tap.watch(order)
srv = BeaconServer(sock, tap=None if tap is None else tap.offer)
cpu0 = time.process_time()  # from here on: receiving (and writing)
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
srv.close()
if tap is not None:
    tap.close()
print(srv.received, 0 if tap is None else tap.dropped, time.process_time() - cpu0, flush=True)
"""


def calibrate(step_s: float) -> torch.Tensor:
    """A square matrix whose product with itself takes about ``step_s`` here (the fastest
    of a few tries: the box is shared, and a slow try would make the step too small)."""
    n = 128
    while True:
        a = torch.rand(n, n)
        a @ a  # warm up
        took = min(_matmul_s(a) for _ in range(5))
        if took >= step_s / 4 or n >= 4096:
            side = max(8, int(n * (step_s / took) ** (1 / 3)))
            return torch.rand(side, side)
        n *= 2


def _matmul_s(a: torch.Tensor) -> float:
    t0 = time.perf_counter()
    a @ a
    return time.perf_counter() - t0


def start_agent(sock: Path, logdir: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(sock), str(logdir), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"the {mode} agent did not start")
    return proc


def use(sock: Path | None) -> None:
    for key in (beacon.SOCKET_ENV, beacon.ATTEMPT_ENV, "RANK"):
        os.environ.pop(key, None)
    if sock is not None:
        os.environ.update({beacon.SOCKET_ENV: str(sock), beacon.ATTEMPT_ENV: "1", "RANK": "0"})
    beacon.reset()


def loop(work: torch.Tensor, first: int, steps: int) -> float:
    """Mean seconds per step of ``steps`` steps, numbered from ``first``."""
    report = beacon.report
    t0 = time.perf_counter()
    for step in range(first, first + steps):
        work @ work
        report(step, loss=1.0 / (step + 1), tokens=4096)
    return (time.perf_counter() - t0) / steps


def measure(steps: int, runs: int, step_ms: float) -> dict[str, Any]:
    torch.set_num_threads(1)  # one core for the step, one for the agent: a fair 2-core split
    tmp = Path(tempfile.mkdtemp(prefix="tpstep-", dir="/tmp"))  # AF_UNIX paths are short
    saved = {k: os.environ.get(k) for k in (beacon.SOCKET_ENV, beacon.ATTEMPT_ENV, "RANK")}
    agents = {m: start_agent(tmp / f"{m}.sock", tmp / "tb" / m, m) for m in ("on", "off")}
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    loads: list[float] = []
    sent = dropped = 0
    try:
        work = calibrate(step_ms / 1000)
        step = itertools.count(0, steps)  # steps only grow, as TensorBoard's writer wants
        loop(work, next(step), steps)  # warm up torch and the caches
        for run in range(runs):
            order = MODES[run % 3 :] + MODES[: run % 3]
            for mode in order:
                use(None if mode == "none" else tmp / f"{mode}.sock")
                beacon.report(-1)  # connect outside the timed loop
                samples[mode].append(loop(work, next(step), steps))
                st = beacon.stats()
                sent, dropped = sent + st.sent, dropped + st.dropped
            loads.append(os.getloadavg()[0])
    finally:
        use(None)
        done = {}
        for mode, proc in agents.items():
            out, _ = proc.communicate("", timeout=60)
            received, tap_dropped, cpu = out.split()
            done[mode] = {
                "received": int(received),
                "tap_dropped": int(tap_dropped),
                "cpu_s": float(cpu),
            }
        events = sorted((tmp / "tb" / "on").rglob("events.out.tfevents.*"))
        event_bytes = sum(p.stat().st_size for p in events)
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    med = {m: statistics.median(v) for m, v in samples.items()}
    ratios = [on / off for on, off in zip(samples["on"], samples["off"], strict=True)]
    overhead = med["on"] / med["off"] - 1.0
    extra_cpu = (done["on"]["cpu_s"] - done["off"]["cpu_s"]) / max(1, done["on"]["received"])
    return {
        "step_ms_target": step_ms,
        "matmul": list(work.shape),
        "torch_threads": torch.get_num_threads(),
        "steps_per_run": steps,
        "runs": runs,
        "step_s": {m: spread(v) for m, v in samples.items()},
        "on_over_off": round(overhead, 4),
        "on_over_off_per_run": spread([r - 1.0 for r in ratios], 4),
        "beacons_over_none": round(med["off"] / med["none"] - 1.0, 4),
        "sent": sent,
        "dropped_by_sender": dropped,
        "agents": done,
        "writer_cpu_s_per_step": round(extra_cpu, 7),
        "writer_cpu_share_of_step": round(extra_cpu / (step_ms / 1000), 5),
        "tensorboard_event_bytes": event_bytes,
        "target": TARGET,
        "load1": spread(loads, 2),
        "simulated": "the step is a CPU matmul standing in for a GPU step (no GPU here)",
    } | verdict(overhead, ratios)


def verdict(overhead: float, ratios: list[float]) -> dict[str, Any]:
    """Met, not met, or not resolved: runs that spread wider than the target cannot show a
    difference of the target's size either way."""
    width = max(ratios) - min(ratios)
    resolved = width <= 2 * TARGET
    return {
        "met": resolved and overhead <= TARGET,
        "verdict": ("met" if overhead <= TARGET else "NOT met")
        if resolved
        else f"not resolved (the runs spread {width * 100:.0f}%, the target is {TARGET * 100:g}%)",
    }


def spread(values: list[float], digits: int = 6) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def summary(r: dict[str, Any]) -> str:
    s = r["step_s"]
    per = r["on_over_off_per_run"]
    lines = [
        f"training step with beacons, SIMULATED ({r['simulated']}): {r['runs']} runs x "
        f"{r['steps_per_run']} steps of a {r['matmul'][0]}x{r['matmul'][1]} matmul "
        f"({r['torch_threads']} torch threads), modes interleaved",
    ]
    for m in MODES:
        lines.append(
            f"  {m:<5} {s[m]['median'] * 1e3:8.3f} ms/step "
            f"[{s[m]['min'] * 1e3:.3f}-{s[m]['max'] * 1e3:.3f}]"
        )
    load = r["load1"]
    lines.append(
        f"  metrics on vs off: {r['on_over_off'] * 100:+.2f}% (per run: median "
        f"{per['median'] * 100:+.2f}% [{per['min'] * 100:+.2f}%..{per['max'] * 100:+.2f}%]); "
        f"beacons vs none: {r['beacons_over_none'] * 100:+.2f}%; "
        f"{r['agents']['on']['received']:,} beacons received by the on agent, which spent "
        f"{r['writer_cpu_s_per_step'] * 1e6:.0f} us of CPU more per step than the off one "
        f"({r['writer_cpu_share_of_step'] * 100:.2f}% of a {r['step_ms_target']:g} ms step), "
        f"{r['tensorboard_event_bytes']:,} bytes of TensorBoard events; "
        f"load1 {load['median']} [{load['min']}-{load['max']}]; target <= {TARGET * 100:g}%: "
        f"{r['verdict']}"
    )
    return "\n".join(lines)
