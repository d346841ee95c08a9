"""The recovery benchmark's report: tables and verdicts."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from recoverykit.common import (
    CLUSTER,
    DEFAULT_JSON,
    HANG_TIMEOUT_S,
    ROOT,
    SPLIT,
    STEP_S,
    TARGET_CRASH_DETECT_S,
    TARGET_ETTR_POINTS,
    TARGET_GPU_FIRST_STEP_S,
    TARGET_HANG_SLACK_S,
    TARGET_RATIO,
    summary,
)
from recoverykit.mttr import ALL_CLASSES, PHASES, Injection
from recoverykit.torchrun_cmp import TorchrunSample


# -- report -----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _f(value: float | None, width: int = 9, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


def _verdict(ok: bool | None) -> str:
    return "n/a " if ok is None else "PASS" if ok else "FAIL"


def render_mttr(classes: dict[str, Any]) -> list[str]:
    head = f"  {'class':<20} {'':4}" + "".join(f" {h:>10}" for _, h in PHASES)
    lines = [head]
    for name, c in classes.items():
        title = f"{name} ({c['recovered']}/{c['injections']})"
        for stat in ("p50", "p90", "max"):
            row = "".join(f" {_f(c['summary'][k][stat], 10)}" for k, _ in PHASES)
            lines.append(f"  {title:<20} {stat:4}{row}")
            title = ""
        lines.append(
            f"  {'':20} detected as {c['detected_as'] or '-'}, classified as "
            f"{c['classified_as'] or '-'} (expected {c['expect']}); "
            f"restarts counted against max_restarts: {c['counted_against_max_restarts']}"
        )
        for err in c["errors"]:
            lines.append(f"  {'':20} ! {err[:160]}")
    return lines


def render_chaos(g: dict[str, Any] | None) -> list[str]:
    """Part 3: one chaos run (``--chaos-recovery both`` gives two, side by side)."""
    lines: list[str] = []
    if g is None:
        lines.append("3. Goodput of a chaos run: skipped (--skip-chaos)")
    elif "error" in g:
        lines.append(f"3. Goodput of a chaos run: FAILED: {g['error']}")
    else:
        mo = g["model"]
        cal = g["calibration"]
        lines += [
            f"3. Goodput of a chaos run: GPT example, 2 nodes, --auto-resume, "
            f"--recovery {g.get('recovery', 'restart')}, {g['steps']} "
            f"steps, checkpoint every {_every(g['ckpt_every'])} (~{mo['tau_s']:.1f} s), "
            f"job {g['state']}{' (' + g['stopped'] + ')' if g['stopped'] else ''}",
            f"  calibration: {cal['step_time_s']:.3f} s/step, "
            f"{cal['checkpoint_stall_per_save_s'] * 1000:.1f} ms stall per save",
            f"  injected: {', '.join(f['fault'] + '@' + f['node'] for f in g['injected'] if not f['skipped']) or 'none'}",  # noqa: E501
            f"  faults detected {g['faults_detected']}: {g['faults_classified']} (goodput's "
            f"FaultRecords say {g['faults_by_kind']}), attempts {g['attempts']}",
            f"  wall {g['wall_s']:.1f} s, productive {g['productive_s']:.1f} s, goodput "
            f"{100 * g['goodput']:.1f} %, ETTR {100 * g['ettr']:.1f} %",
            f"  last step reached {g.get('last_step', '?')} (fault-free at the calibrated "
            f"step time: ~{g.get('steps_fault_free', '?')})",
            "  lost by cause (s): "
            + ", ".join(f"{k} {v:.1f}" for k, v in g["lost_by_cause_s"].items()),
        ]
        if "ettr_model" in mo:
            lines += [
                f"  model: delta {mo['delta_s'] * 1000:.1f} ms/save, M {mo['M_s']:.0f} s, "
                f"R {mo['R_s']:.1f} s ("
                + ", ".join(f"{k} {v:.1f}" for k, v in mo["R_parts_s"].items())
                + ")",
                f"  ETTR model 1-sqrt(2d/M)-R/M = {100 * mo['ettr_model']:.1f} % "
                f"(tau* {mo['tau_optimal_s']:.0f} s); measured {100 * g['ettr']:.1f} %: "
                f"{mo['diff_points']:+.1f} points",
                f"  with the actual tau, 1-d/tau-(R+tau/2)/M = "
                f"{100 * mo['ettr_model_actual_tau']:.1f} %: "
                f"{mo['diff_points_actual_tau']:+.1f} points",
                "  measured ETTR without the first start-up and the final shutdown (the model "
                f"has neither): {100 * mo['ettr_measured_without_startup_shutdown']:.1f} %",
            ]
        for note in g["notes"][:6]:
            lines.append(f"  note: {note}")
    return lines


SUMMED = (  # key in a chaos run, label, scale, decimals
    ("goodput", "goodput %", 100.0, 1),
    ("lost_s", "lost s", 1.0, 1),
    ("attempts", "attempts", 1.0, 0),
    ("last_step", "last step", 1.0, 0),
    ("steps_vs_fault_free", "steps / fault-free %", 100.0, 1),
    ("step_time_s", "calibrated s/step", 1.0, 3),
)


def summarize_chaos(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode, each figure of its completed runs as median [min, max], and how many runs
    failed (``--chaos-runs``)."""
    out: dict[str, Any] = {}
    for mode, rs in runs.items():
        ok = [g for g in rs if "goodput" in g]
        figures: dict[str, dict[str, float]] = {}
        for key, *_ in SUMMED:
            values = [float(v) for g in ok if (v := _chaos_figure(g, key)) is not None]
            if values:
                figures[key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "n": len(values),
                }
        out[mode] = {"runs": len(rs), "failed": len(rs) - len(ok), "figures": figures}
    return out


def _chaos_figure(g: dict[str, Any], key: str) -> float | None:
    if key == "lost_s":
        return float(g["wall_s"] - g["productive_s"])
    if key == "attempts":
        return float(len(g["attempts"])) if isinstance(g["attempts"], list) else g["attempts"]
    if key == "steps_vs_fault_free":
        free = g.get("steps_fault_free") or 0
        return g.get("last_step", 0) / free if free else None
    if key == "step_time_s":
        return float(g["calibration"]["step_time_s"])
    value = g.get(key)
    return None if value is None else float(value)


def render_chaos_summary(summary: dict[str, Any]) -> list[str]:
    modes = list(summary)
    lines = [
        "3b. Chaos runs side by side: median [min-max] over the runs of each mode",
        f"  {'':22}" + "".join(f" {m:>26}" for m in modes),
    ]
    for key, label, scale, d in SUMMED:
        cells = []
        for m in modes:
            f = summary[m]["figures"].get(key)
            lo, mid, hi = (None,) * 3 if f is None else (f["min"], f["median"], f["max"])
            cells.append(
                "-"
                if lo is None or mid is None or hi is None
                else f"{mid * scale:.{d}f} [{lo * scale:.{d}f}-{hi * scale:.{d}f}]"
            )
        lines.append(f"  {label:22}" + "".join(f" {c:>26}" for c in cells))
    lines.append(
        "  runs (failed): "
        + ", ".join(f"{m} {summary[m]['runs']} ({summary[m]['failed']})" for m in modes)
    )
    return lines


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        "trainpod recovery benchmark",
        f"  machine: {m['cpu_count']} CPUs, Python {m['python']}, {m['platform']}",
        f"  load average at start {r['load_start']}, at end {r['load_end']}",
        f"  cluster: {CLUSTER} (local): main = 2 workers + 1 hot spare, 1 device each; "
        "duo = 1 node x 2 devices (only the 1x2 run)",
        "  health: heartbeat 0.5 s, timeout 3 s, checks every 0.5 s, hang_timeout 3 s, "
        "scratch quota 0.25 GiB; teardown grace 5 s (default)",
        f"  worker: benchmarks/workers/steps.py, {STEP_S} s/step, Gloo all-reduce per step, "
        "checkpoint every 10 steps",
        "",
        f"1. MTTR per fault class (2 nodes x 1 rank; seconds; {r['repeats']} injections each; "
        "p50/p90/max over the recovered ones)",
        "  det(inj) = injection (chaos_injected) -> fault_detected;",
        "  det(est) = fault_at (trainpod's estimate of when it happened) -> fault_detected;",
        "  teardown = fault_detected -> attempt failed; restart = failed -> first rank_started;",
        "  ->beacon = rank_started -> first_beacon; total = injected -> first_beacon;",
        "  ->1st step = injected -> first step line of the new attempt; "
        "repair = fault_detected -> node_repaired;",
        "  node out = injected -> the faulty node turned suspect/quarantined",
    ]
    lines += render_mttr(r["mttr"]["classes"])
    slow = r["mttr"].get("slow")
    if slow:
        lines += [
            f"  slow (straggler) on a 2-rank job, watched {slow['watched_s']:g} s: step "
            f"{_f(slow['step_s_before'], 0, 3)} s -> {_f(slow['step_s_after'], 0, 3)} s, "
            f"straggler_detected events: {slow['straggler_events']}, faults: "
            f"{slow['fault_events'] or 'none'}",
            f"    ({slow['note']}){' ! ' + slow['error'] if slow['error'] else ''}",
        ]
    rp = r["mttr"].get("kill_agent_replay")
    if rp:
        verdict = {True: "YES (bug)", False: "no", None: "undecided"}[rp["replayed"]]
        lines += [
            f"  chaos kill-agent replayed on the replacement agent of {rp['node']}: {verdict}; "
            f"agents registered after it {rp.get('new_agents')}, dead {rp.get('dead_new_agents')}; "
            f"node after {rp['node_state_after_s']} s: {rp['node_state'][:100]}",
        ]
    c = r["crash_vs_torchrun"]
    lines += [
        "",
        "2. Crash (SIGKILL rank 1) -> first step after the restart, same steps.py, same line",
        "  torchrun --standalone --nproc-per-node 2 --max-restarts 3 (kill -> first step of "
        "the next generation)",
        "  vs trainpod kill-worker (chaos_injected -> first step of the next attempt)",
        "  fair comparison available here: torchrun's 2 local ranks vs trainpod 2 nodes x 1 "
        "rank (primary); trainpod 1 node x 2 procs also shown",
        "  p50 split: ->spawn = fault -> the last rank's script starts; imports = torch + "
        "trainpod; pg+resume = process group + resume step; ->step = first step",
        f"  {'':36} {'n':>3} {'p50 s':>7} {'p90 s':>7} {'max s':>7} |"
        + "".join(f" {h:>9}" for _, h in SPLIT),
    ]
    rows = c["rows"]
    for key, label in COMPARED:
        if key not in rows:
            continue
        row = rows[key]
        s = row["first_step"]
        lines.append(
            f"  {label:<36} {s['n']:>3} {_f(s['p50'], 7)} {_f(s['p90'], 7)} {_f(s['max'], 7)} |"
            + "".join(f" {_f(row[k]['p50'], 9)}" for k, _ in SPLIT)
        )
        for err in row.get("errors", []):
            lines.append(f"  {'':36} ! {err[:160]}")
    lines.append(
        "  ratio trainpod/torchrun (p50): "
        + ", ".join(f"{k.removeprefix('trainpod_')} {_f(v, 0)}" for k, v in c["ratios"].items())
    )
    for key in ("chaos", "chaos_in_process"):
        if key in r:
            lines += ["", *render_chaos(r[key])]
    both = [r.get(k) or {} for k in ("chaos", "chaos_in_process")]
    if all("goodput" in g for g in both):
        lines.append(
            f"   side by side: goodput {100 * both[0]['goodput']:.1f} % (restart) vs "
            f"{100 * both[1]['goodput']:.1f} % (in-process); lost "
            f"{both[0]['wall_s'] - both[0]['productive_s']:.1f} vs "
            f"{both[1]['wall_s'] - both[1]['productive_s']:.1f} s"
        )
    if r.get("chaos_summary"):
        lines += ["", *render_chaos_summary(r["chaos_summary"])]
    lines += ["", "targets"]
    for t in r["targets"]:
        lines.append(f"  {_verdict(t['pass'])} {t['what']}: {t['value']}")
    lines.append(f"run time: {r['run_time_s']:.1f} s ({r['phase_times_s']})")
    return "\n".join(lines)


COMPARED = (  # key, label
    ("torchrun", "torchrun 1 node x 2 ranks"),
    ("trainpod_2x1", "trainpod 2 nodes x 1 rank"),
    ("trainpod_1x2", "trainpod 1 node x 2 procs"),
    ("trainpod_2x1_cold", "trainpod 2x1, TRAINPOD_WARM_START=0"),
)


def comparison(
    torchrun: list[TorchrunSample],
    trainpod: dict[str, list[Injection]],
    errors: dict[str, list[str]],
) -> dict[str, Any]:
    """kill -> first step (and its split) per launcher, and trainpod/torchrun ratios."""

    def row(first: list[float | None], splits: list[dict[str, float | None]]) -> dict[str, Any]:
        out = {"first_step": summary([v for v in first if v is not None])}
        for key, _ in SPLIT:
            out[key] = summary([v for sp in splits if (v := sp.get(key)) is not None])
        return out

    ok = [s for s in torchrun if not s.error]
    rows: dict[str, Any] = {
        "torchrun": {
            **row([s.kill_to_first_step_s for s in ok], [s.split for s in ok]),
            "errors": [s.error for s in torchrun if s.error],
            "samples": [asdict(s) for s in torchrun],
        }
    }
    for key, samples in trainpod.items():
        good = [s for s in samples if s.ok]
        rows[key] = {
            **row([s.inject_to_first_step_s for s in good], [s.split for s in good]),
            "errors": [s.error for s in samples if s.error] + errors.get(key, []),
        }
    base = rows["torchrun"]["first_step"]["p50"]
    ratios = {
        key: rows[key]["first_step"]["p50"] / base if base else float("nan") for key in trainpod
    }
    return {"rows": rows, "ratios": ratios}


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    cls = r["mttr"]["classes"]

    def p50(name: str, key: str) -> float:
        return float(cls[name]["summary"][key]["p50"]) if name in cls else float("nan")

    def ok(value: float, limit: float) -> bool | None:
        return None if math.isnan(value) else value < limit

    crash = p50("crash", "inject_to_detect_s")
    hang = p50("hang", "inject_to_detect_s")
    hang_max = cls.get("hang", {}).get("summary", {}).get("inject_to_detect_s", {}).get("max")
    ratios = r["crash_vs_torchrun"]["ratios"]
    ratio = float(ratios.get("trainpod_2x1", float("nan")))
    ratio12 = float(ratios.get("trainpod_1x2", float("nan")))
    cold = float(ratios.get("trainpod_2x1_cold", float("nan")))
    gpu = p50("gpu_fault", "inject_to_first_step_s")
    return [
        {
            "what": f"crash detected < {TARGET_CRASH_DETECT_S:g} s (p50, injection -> detected)",
            "value": f"{crash:.3f} s",
            "pass": ok(crash, TARGET_CRASH_DETECT_S),
        },
        {
            "what": f"hang detected within hang_timeout_s + {TARGET_HANG_SLACK_S:g} s = "
            f"{HANG_TIMEOUT_S + TARGET_HANG_SLACK_S:g} s (p50, injection -> detected)",
            "value": f"{hang:.3f} s (max {_f(hang_max, 0, 3)} s)",
            "pass": ok(hang, HANG_TIMEOUT_S + TARGET_HANG_SLACK_S),
        },
        {
            "what": f"crash -> first step <= {TARGET_RATIO:g} x torchrun's (p50, 2 nodes x 1)",
            "value": f"ratio {ratio:.2f} (1 node x 2 procs: {ratio12:.2f}; cold start: {cold:.2f})",
            "pass": None if math.isnan(ratio) else ratio <= TARGET_RATIO,
        },
        {
            "what": f"GPU fault -> the spare's first step < {TARGET_GPU_FIRST_STEP_S:g} s (p50)",
            "value": f"{gpu:.3f} s",
            "pass": ok(gpu, TARGET_GPU_FIRST_STEP_S),
        },
        ettr_target(r.get("chaos")),
    ]


def ettr_target(chaos: dict[str, Any] | None) -> dict[str, Any]:
    what = f"chaos run: ETTR within +-{TARGET_ETTR_POINTS:g} points of 1-sqrt(2d/M)-R/M"
    mo = (chaos or {}).get("model", {})
    if "ettr_model" not in mo:
        return {"what": what, "value": "no chaos run (or no fault)", "pass": None}
    value = (
        f"{mo['diff_points']:+.1f} points; with the actual tau {mo['diff_points_actual_tau']:+.1f}"
    )
    return {"what": what, "value": value, "pass": abs(mo["diff_points"]) <= TARGET_ETTR_POINTS}


# -- main -------------------------------------------------------------------------------------
def _every(every: int | str) -> str:
    return f"{every} steps" if isinstance(every, int) else f"{every} interval"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=5, help="injections per fault class")
    p.add_argument("--chaos-minutes", type=float, default=10.0, help="length of the chaos run")
    p.add_argument("--fault-every-s", type=float, default=120.0, help="chaos: mean fault gap")
    p.add_argument(
        "--seed",
        type=int,
        default=4,
        help="chaos: the fault draw's seed (default 4: all four faults within ~8 minutes at "
        "the default --fault-every-s)",
    )
    p.add_argument("--skip-chaos", action="store_true", help="no GPT chaos run (part 3)")
    p.add_argument(
        "--chaos-runs",
        type=int,
        default=1,
        help="chaos: runs per recovery mode, the modes interleaved, run i with seed --seed + i "
        "(the same faults for both modes of a round); medians [min-max] across them",
    )
    p.add_argument(
        "--chaos-ckpt-every",
        default="auto",
        help="chaos: the GPT job's --ckpt-every: auto (default: Young/Daly from the measured "
        "stall and the MTBF trainpod observed), sized (one save per ~20 s of training) or N",
    )
    p.add_argument(
        "--chaos-recovery",
        choices=["restart", "in-process", "both"],
        default="restart",
        help="chaos: the GPT job's --recovery: restart (every rank starts again), "
        "in-process (the healthy ranks stay; a killed rank is replaced in the attempt) or "
        "both (the same seeded faults, one run after the other, side by side)",
    )
    p.add_argument(
        "--classes",
        type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
        default=[*ALL_CLASSES],
        help=f"fault classes to run, comma-separated (default: all: {','.join(ALL_CLASSES)}); "
        "crash includes the torchrun comparison, node_lost the kill-agent replay check",
    )
    p.add_argument(
        "--gpt-crash",
        action="store_true",
        help="part 5: the GPT example's rank 1 SIGKILLed --repeats times under torchrun "
        "--max-restarts, trainpod full restart and trainpod in-process: crash -> first step",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="part 4: full restart vs in-process recovery of the same job and injections "
        "(kill-worker, kill-agent), --repeats each",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the cluster's logs to this directory"
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.classes) - set(ALL_CLASSES))
    if unknown:
        p.error(f"unknown classes {unknown}; use some of {','.join(ALL_CLASSES)}")
    if min(args.repeats, args.chaos_runs) < 1 or min(args.chaos_minutes, args.fault_every_s) <= 0:
        p.error("--repeats, --chaos-runs, --chaos-minutes and --fault-every-s must be positive")
    every = args.chaos_ckpt_every
    if every not in ("auto", "sized") and not (every.isdigit() and int(every) > 0):
        p.error(f"--chaos-ckpt-every: got {every!r}; give auto, sized or a number of steps > 0")
    return args


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_state() -> dict[str, Any]:
    """The commit and the uncommitted changes under src/ (others edit the tree meanwhile)."""

    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "src_changes": git("status", "--short", "--", "src").splitlines(),
    }
