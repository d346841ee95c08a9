"""The dispatch benchmark's report: figures from the samples, the JSON, the plain-text tables
(per backend, then side by side with ratios). See dispatch.py for what is measured."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

from dispatchkit import LatencySample, summary

BACKENDS = ("local", "slurm", "sbatch")
LABELS = {"local": "embedded", "slurm": "trainpod/Slurm", "sbatch": "plain sbatch"}


def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _ms(value: float) -> str:
    return f"{value * 1000:9.1f}"


def _fmt_ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value * 1000:.1f} ms" if value < 10 else f"{value:.2f} s"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    r = a / b
    return f"x{r:.0f}" if r >= 100 else f"x{r:.1f}" if r >= 10 else f"x{r:.2f}"


LOCAL_ROWS = [
    ("(a) submit -> first rank instruction", "submit_to_first_instruction_s"),
    ("  - HTTP submit (client -> controller)", "http_submit_s"),
    ("  - controller -> agent spawn", "submit_to_spawn_s"),
    ("  - spawn -> first instruction", "spawn_to_first_instruction_s"),
    ("(b) submit -> spawn (events)", "submit_to_spawn_s"),
    ("(c) submit -> completed (event ts)", "submit_to_completed_s"),
    ("(c) submit -> completed (client polling)", "submit_to_completed_observed_s"),
    ("floor: Popen -> first instruction", "floor_s"),
]
SLURM_ROWS = [
    ("submit call returned (HTTP + sbatch)", "submit_returned_s"),
    ("slurmctld allocated the node", "submit_to_allocated_s"),
    ("slurmd launched the batch script", "submit_to_batch_launch_s"),
    ("slurmd launched the agent's srun step", "submit_to_step_launch_s"),
    ("agent registered (first heartbeat)", "submit_to_agent_registered_s"),
    ("  - step launch -> agent registered", "step_launch_to_agent_registered_s"),
    ("  - floor: import trainpod.agent.main", "agent_import_s"),
    ("agent spawned the rank", "submit_to_rank_spawned_s"),
    ("(a) first rank instruction", "submit_to_first_instruction_s"),
    ("  - Slurm allocated -> first instruction", "allocated_to_first_instruction_s"),
    ("trainpod job completed (event ts)", "submit_to_completed_s"),
    ("Slurm job done (allocation released)", "submit_to_slurm_done_s"),
]
SBATCH_ROWS = [
    ("sbatch returned", "submit_returned_s"),
    ("slurmctld allocated the node", "submit_to_allocated_s"),
    ("slurmd launched the batch script", "submit_to_batch_launch_s"),
    ("(a) first instruction (printed)", "submit_to_first_instruction_s"),
    ("  - Slurm allocated -> first instruction", "allocated_to_first_instruction_s"),
    ("Slurm job done", "submit_to_slurm_done_s"),
]


def _table(stats: dict[str, dict[str, float]], rows: list[tuple[str, str]]) -> list[str]:
    lines = [f"  {'':44} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9}"]
    for label, key in rows:
        s = stats.get(key)
        if not s:
            continue
        lines.append(f"  {label:<44} {_ms(s['p50'])} {_ms(s['p95'])} {_ms(s['max'])}")
    return lines


def _burst_lines(b: dict[str, Any]) -> list[str]:
    what = " ".join(b["command"])
    lines = [
        f"  burst: {b['jobs']} jobs of {what}, one client",
        f"    submit rate                 {b['submit_rate_jobs_s']:8.1f} jobs/s "
        f"({b['submit_s']:.2f} s; one submit p50 {b['submit_call_s']['p50'] * 1000:.1f} ms, "
        f"max {b['submit_call_s']['max'] * 1000:.1f} ms)",
        f"    dispatch+complete rate      {b['dispatch_complete_rate_jobs_s']:8.1f} jobs/s "
        f"(first submit -> last completion {b['first_submit_to_last_completion_s']:.2f} s)",
    ]
    if b.get("first_submit_to_all_slurm_done_s") is not None:
        lines.append(
            f"    Slurm: last allocation released {b['first_submit_to_all_slurm_done_s']:.2f} s "
            f"after the first submit; at most {b['peak_running_slurm_jobs']} held at once; "
            f"started in {b['scheduler_passes']} scheduler passes"
        )
    cpu = b.get("cpu") or {}
    if cpu:
        lines.append(
            f"    machine busy {cpu['busy_fraction'] * 100:.0f}% of "
            f"{os.cpu_count()} CPUs ({cpu['busy_cpu_s']:.1f} CPU-s, "
            f"{cpu['busy_cpu_s'] / max(b['jobs'], 1) * 1000:.0f} ms per job, all tenants); "
            f"load after {cpu['loadavg_1m_after']:.2f}"
        )
    lines.append(
        f"    completed {b['completed']}, failed {b['failed']}, unfinished {b['unfinished']}"
    )
    for f in b["failures"][:3]:
        lines.append(f"    failure: {f}")
    return lines


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "trainpod dispatch benchmark",
        "  machine: {cpu_count} CPUs, Python {python} ({implementation}), {platform}".format(**m),
        f"  load average (1, 5, 15 min): at start {results['loadavg']['start']}, "
        f"before bursts {results['loadavg']['before_bursts']}, "
        f"at end {results['loadavg']['end']}",
    ]
    be = results["backends"]
    if "slurm_cluster" in results:
        s = results["slurm_cluster"]
        lines.append(
            f"  Slurm: {s['version']}, {len(s['nodes'])} nodes x {s['cpus_per_node']} CPUs "
            f"(private, {s['dir']}); up in {s['slurm_up_s']:.2f} s; trainpod agents "
            f"TRAINPOD_WARM_START={s['agent_warm_start']}"
        )
    lines.append("")
    if "local" in be:
        r = be["local"]
        lat = r["latency"]
        lines += [
            f"embedded (local): {r['cluster']['name']}, 2 nodes x 1 device; up in "
            f"{r['cluster']['cluster_up_s']:.2f} s",
            f"  latency: {lat['jobs']} jobs, one at a time, "
            "command: python -c 'print(time.time())'",
            f"  {'(rows starting with - split (a); their p50s need not add up)':<44}",
            *_table(lat["summary"], LOCAL_ROWS),
            f"  p50 (a) vs floor median: x{lat['vs_floor']['ratio']:.1f}, "
            f"overhead {lat['vs_floor']['overhead_ms']:.1f} ms; failed: {lat['failed']}",
            *_burst_lines(r["burst"]),
            "",
        ]
    if "slurm" in be:
        r = be["slurm"]
        lat = r["latency"]
        lines += [
            f"trainpod on Slurm: {r['cluster']['name']}; "
            f"up in {r['cluster']['cluster_up_s']:.2f} s",
            f"  latency: {lat['jobs']} jobs, one at a time; milestones after the submit",
            *_table(lat["summary"], SLURM_ROWS),
            f"  failed: {lat['failed']}",
            *_burst_lines(r["burst"]),
            "",
        ]
    if "sbatch" in be:
        r = be["sbatch"]
        lat = r["latency"]
        lines += [
            "plain sbatch: sbatch --wrap 'python -c ...' --output FILE",
            f"  latency: {lat['jobs']} jobs, one at a time; milestones after the submit",
            *_table(lat["summary"], SBATCH_ROWS),
            f"  failed: {lat['failed']}",
            *_burst_lines(r["burst"]),
            *(_burst_lines(r["burst_exclusive"]) if "burst_exclusive" in r else []),
            "",
        ]
    lines += _side_by_side(results)
    if "target" in results:
        t = results["target"]
        verdict = "PASS" if t["pass"] else "FAIL"
        lines.append(
            f"target (embedded): p50 submit->start < {t['p50_limit_s']} s: "
            f"{verdict} (p50 = {t['p50_s'] * 1000:.1f} ms)"
        )
    lines.append(f"run time: {results['run_time_s']:.1f} s")
    return "\n".join(lines)


def _side_by_side(results: dict[str, Any]) -> list[str]:
    be = results["backends"]
    names = [b for b in BACKENDS if b in be]
    cmp_ = results["comparison"]
    head = f"  {'':34}" + "".join(f"{LABELS[b]:>16}" for b in names)
    lines = [
        "side by side (same run; latency = submit -> first instruction of the command)",
        head,
    ]

    def row(label: str, fmt: Any, key: str) -> str:
        cells = [cmp_[b].get(key) for b in names]
        return f"  {label:<34}" + "".join(f"{fmt(v) if v is not None else '-':>16}" for v in cells)

    def rate(v: float) -> str:
        return f"{v:.1f}"

    lines += [
        row("latency p50", _fmt_ms, "latency_p50_s"),
        row("latency p95", _fmt_ms, "latency_p95_s"),
        row("  Slurm allocated -> first, p50", _fmt_ms, "after_allocation_p50_s"),
        row("  Slurm allocated -> first, p95", _fmt_ms, "after_allocation_p95_s"),
        row("latency jobs", str, "latency_jobs"),
        row("burst dispatch+complete (jobs/s)", rate, "burst_rate_jobs_s"),
        row("  one job per node (--exclusive)", rate, "burst_exclusive_rate_jobs_s"),
        row("burst jobs", str, "burst_jobs"),
    ]
    pairs = [("slurm", "sbatch"), ("slurm", "local"), ("sbatch", "local")]
    for a, b in pairs:
        if a in be and b in be:
            x, y = cmp_[a], cmp_[b]
            text = (
                f"  {LABELS[a]} vs {LABELS[b]}: latency p50 "
                f"{_ratio(x['latency_p50_s'], y['latency_p50_s'])}, p95 "
                f"{_ratio(x['latency_p95_s'], y['latency_p95_s'])}"
            )
            if "after_allocation_p50_s" in x and "after_allocation_p50_s" in y:
                after = _ratio(x["after_allocation_p50_s"], y["after_allocation_p50_s"])
                text += f" (after allocation p50 {after})"
            text += f"; burst rate {_ratio(x['burst_rate_jobs_s'], y['burst_rate_jobs_s'])}"
            if "burst_exclusive_rate_jobs_s" in x and "burst_exclusive_rate_jobs_s" in y:
                ex = _ratio(x["burst_exclusive_rate_jobs_s"], y["burst_exclusive_rate_jobs_s"])
                text += f" ({ex} one job per node)"
            lines.append(text)
    lines.append("")
    return lines


def latency_results(
    samples: list[LatencySample],
    floors: list[float] | None = None,
    agent_floors: list[float] | None = None,
) -> dict[str, Any]:
    ok = [s for s in samples if s.submit_to_first_instruction_s is not None and not s.error]

    def column(name: str) -> list[float]:
        return [v for s in ok if (v := getattr(s, name)) is not None]

    floor_keys = {"floor_s", "agent_import_s"}
    keys = sorted({k for _, k in [*LOCAL_ROWS, *SLURM_ROWS, *SBATCH_ROWS]} - floor_keys)
    stats = {k: summary(values) for k in keys if (values := column(k))}
    if agent_floors:
        stats["agent_import_s"] = summary(agent_floors)
    out: dict[str, Any] = {"jobs": len(samples), "failed": len(samples) - len(ok)}
    if agent_floors:
        out["agent_import_samples_s"] = agent_floors
    if floors is not None:
        stats["floor_s"] = summary(floors)
        p50 = stats.get("submit_to_first_instruction_s", summary([]))["p50"]
        floor = statistics.median(floors) if floors else float("nan")
        out["vs_floor"] = {
            "floor_median_s": floor,
            "ratio": p50 / floor if floor else float("nan"),
            "overhead_ms": (p50 - floor) * 1000,
        }
        out["floor_samples_s"] = floors
    out["summary"] = stats
    out["samples"] = [asdict(s) for s in samples]
    return out


def comparison(backends: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, r in backends.items():
        s = r["latency"]["summary"].get("submit_to_first_instruction_s", summary([]))
        out[name] = {
            "latency_p50_s": s["p50"],
            "latency_p95_s": s["p95"],
            "latency_jobs": r["latency"]["jobs"],
            "burst_rate_jobs_s": r["burst"]["dispatch_complete_rate_jobs_s"],
            "burst_jobs": r["burst"]["jobs"],
        }
        after = r["latency"]["summary"].get("allocated_to_first_instruction_s")
        if after:
            out[name]["after_allocation_p50_s"] = after["p50"]
            out[name]["after_allocation_p95_s"] = after["p95"]
        # One job per node: trainpod's Slurm jobs always are (--exclusive); plain sbatch's
        # exclusive burst is the like-for-like reference.
        if name == "slurm":
            out[name]["burst_exclusive_rate_jobs_s"] = out[name]["burst_rate_jobs_s"]
        elif "burst_exclusive" in r:
            rate = r["burst_exclusive"]["dispatch_complete_rate_jobs_s"]
            out[name]["burst_exclusive_rate_jobs_s"] = rate
    ratios: dict[str, Any] = {}
    for a, b in [("slurm", "sbatch"), ("slurm", "local"), ("sbatch", "local")]:
        if a in out and b in out:
            keys = ["latency_p50_s", "latency_p95_s", "burst_rate_jobs_s"]
            for k in ("after_allocation_p50_s", "burst_exclusive_rate_jobs_s"):
                if k in out[a] and k in out[b]:
                    keys.append(k)
            ratios[f"{a}_vs_{b}"] = {
                k: (out[a][k] / out[b][k] if out[b][k] else None) for k in keys
            }
    out["ratios"] = ratios
    return out
