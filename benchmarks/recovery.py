"""Recovery benchmark: how fast trainpod gets a job back to work after a fault, vs torchrun.

It creates a throwaway local cluster (``bench-recovery``) in a temporary ``$TRAINPOD_HOME``
and always deletes it again (``purge=True``), on errors and Ctrl-C too; torchrun runs are
started in their own sessions and killed (group and workers) in ``finally`` blocks.

The cluster: partition ``main`` = group ``workers`` (2 nodes) + group ``spares`` (1 hot spare),
``devices_per_node: 1``; plus partition ``duo`` = one node with 2 devices, only for the
trainpod 1 node x 2 procs crash run (it has no spare and no other job ever lands on it). Fast
health settings: heartbeat 0.5 s, heartbeat timeout 3 s, health checks every 0.5 s, hang
timeout 3 s, node scratch quota 0.25 GiB (the GPT chaos job holds ~0.07 GiB a node: at 0.05
the disk check took nodes out mid-run); recovery settings are the defaults (teardown grace 5
s, auto repair on). The worker is ``benchmarks/workers/steps.py``: ~0.05 s per step, one
Gloo all-reduce per step, ``trainpod.report(step)``, a tiny checkpoint every 10 steps and a
timestamped line per step in a progress file.

What it measures, in one run:

1. MTTR per fault class. One 2-node ``--auto-resume`` job of steps.py per class; each
   injection, into the node running rank 1, waits for a restarted attempt's first progress
   beacon, then ~1 s of steps, before the next. Before each node fault it waits (with a
   deadline) until every node of ``main`` that the job does not hold is idle again, so the
   spare (or the repaired node) is there. Classes: kill-worker -> crash, hang (SIGSTOP) ->
   hang, xid79 -> gpu_fault (spare), kill-agent -> node_lost (spare), disk-full ->
   node_fault (spare), all chaos orders (``client.chaos``). At the end, one more kill-agent
   into the idle ``duo`` node checks that the order is not replayed on the agent that the
   repair starts (``kill_agent_replay``; before f538e7c it was, killing the node for
   good). From the events of each injection: detect (injection -> fault_detected, and fault_at ->
   fault_detected, fault_at being an estimate for some classes), node out (injection -> the
   node turned suspect/quarantined), teardown (fault_detected -> attempt failed), restart
   (attempt failed -> the next attempt's first rank_started), to first beacon (-> its
   first_beacon) and total (injection -> that first beacon); plus injection -> the first
   step line of the new attempt (progress file) and the node's repair time. Medians, p90 and
   max per class, and what fault_detected (and fault_classified) called each fault.
   ``slow`` (a straggler) is observed once: trainpod's straggler check judges a rank against
   at least 2 peers, so a 2-rank job cannot have one; the benchmark records the slow-down
   and any detection.
2. Crash vs torchrun: the same steps.py under ``python -m torch.distributed.run --standalone
   --nproc-per-node 2 --max-restarts 3`` (no trainpod; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
   see Torchrun), rank 1 SIGKILLed after ~1 s of steps, up to 3 kills per torchrun run;
   kill -> the first step line of the next generation (``TORCHELASTIC_RESTART_COUNT``), split
   into kill -> spawn, imports, process group + resume, first step. trainpod's figure is the
   same line from the crash class (2 nodes x 1 rank), from a 1 node x 2 procs job on ``duo``
   and from a 2 x 1 job with ``TRAINPOD_WARM_START=0`` (ranks started cold, without the
   agent's preloaded interpreter). Ratios trainpod/torchrun (target <= 0.5).
3. Goodput of a chaos run (skip with ``--skip-chaos``): the GPT example
   (``examples/gpt/train.py``) on 2 nodes with ``--auto-resume``; a short calibration job
   first gives the step time, which sizes ``--steps`` to 3x ``--chaos-minutes`` (the pace
   follows the machine's load); the job saves with ``--ckpt-every auto`` (the Checkpointer's
   Young/Daly interval from its measured stall and the MTBF trainpod observed, given at each
   launch; ``--chaos-ckpt-every sized`` restores the old one save per ~20 s, or N steps);
   the job is cancelled once ``--chaos-minutes`` have passed and it runs again. A seeded
   fault every ~``--fault-every-s`` (uniform 0.5x-1.5x, counted from the previous injection)
   from {kill-worker, xid79, kill-agent, hang}, into a random node of the job, never the
   same fault twice in a row (two SIGKILLs in a row of a rank that prints nothing have the
   same crash signature, which trainpod's policy fails as a user error), and only while the
   job runs. Then ``compute_goodput(job, events, now)`` and the first-order model
   ETTR ~ 1 - sqrt(2 delta / M) - R / M (delta: measured checkpoint stall per save, M: wall /
   faults, R: mean detection + teardown + restart + waiting for a spare + reload per fault),
   which assumes the optimal interval tau* = sqrt(2 delta M), and with the actual interval
   tau: 1 - delta / tau - (R + tau / 2) / M.

4. Full restart vs in-process recovery (``--in-process``): the same steps.py job (with
   ``--in-process`` its loop is ``trainpod.elastic.run``, the job ``--recovery in-process``),
   the same injections (kill-worker into rank 1, kill-agent into its node: the spare takes
   its place in process, ADR 0035), ``--repeats`` each: fault -> every rank stepping again.

5. GPT crash -> first step (``--gpt-crash``, ``recoverykit/gptcrash.py``): the GPT example's
   rank 1 SIGKILLed ``--repeats`` times under ``torchrun --max-restarts``, a trainpod job that
   restarts and one that recovers in process (each also with ``--preload``); from the killed
   rank's last step line to its successor's first.

Targets (PASS/FAIL printed): crash detected < 1 s (median, injection -> fault_detected);
hang detected within hang_timeout_s + 1 s (median, injection -> fault_detected);
crash -> first step <= 0.5 x torchrun's (medians); GPU fault -> the spare's first step
< 10 s (median); GPT crash -> first step in process <= 1 s (median).

Run it from the repository root::

    .venv/bin/python benchmarks/recovery.py [--repeats 5] [--chaos-minutes 10] \\
        [--skip-chaos] [--json benchmarks/results/recovery.json]

It prints a plain-text table and writes every figure and raw sample as JSON to ``--json``
(the load average at start and end included: the machine may be shared). The exit status
is 1 when an injection did not recover (or the chaos job did not complete), else 0 (a
missed target is reported, not an error).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit import raise_interrupt, signals_ignored
from recoverykit.chaos import run_chaos
from recoverykit.common import (
    CLUSTER,
    ROOT,
    SPEC_YAML,
    STEP_S,
    STEPS,
    throwaway_cluster,
)
from recoverykit.gptcrash import gpt_target, render_gpt_crash, run_gpt_crash
from recoverykit.inprocess import render_side_by_side, run_side_by_side
from recoverykit.mttr import (
    CLASSES,
    Injection,
    SlowObservation,
    check_kill_agent_replay,
    class_results,
    observe_slow,
    run_class,
)
from recoverykit.report import (
    _load,
    comparison,
    git_state,
    machine,
    parse_args,
    render,
    summarize_chaos,
    targets,
)
from recoverykit.torchrun_cmp import TorchrunSample, run_torchrun
from trainpod.errors import TrainpodError


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    load_start = _load()
    signal.signal(signal.SIGTERM, raise_interrupt)
    home = Path(tempfile.mkdtemp(prefix="trainpod-bench-"))
    phases: dict[str, float] = {}
    classes: dict[str, Any] = {}
    compared: dict[str, list[Injection]] = {}
    compared_errors: dict[str, list[str]] = {}
    tr_samples: list[TorchrunSample] = []
    slow: SlowObservation | None = None
    replay: dict[str, Any] | None = None
    chaos: dict[str, Any] | None = None
    chaos_in_process: dict[str, Any] | None = None
    side: dict[str, Any] | None = None
    chaos_runs: dict[str, list[dict[str, Any]]] = {}
    gpt_crash: dict[str, Any] | None = None
    chosen = [fc for fc in CLASSES if fc.name in args.classes]
    t = time.monotonic()

    def lap(name: str) -> None:
        nonlocal t
        phases[name] = round(time.monotonic() - t, 1)
        t = time.monotonic()

    try:
        workdir = home / "work"
        workdir.mkdir()
        if "crash" in args.classes:
            tr_samples = run_torchrun(args.repeats, workdir)
            lap("torchrun")
        with throwaway_cluster(home, args.keep_logs) as client:
            lap("cluster_up")
            for fc in chosen:
                samples, errors = run_class(client, fc, args.repeats, workdir)
                classes[fc.name] = class_results(fc, samples, errors)
                if fc.name == "crash":
                    compared["trainpod_2x1"] = samples
                lap(fc.name)
            if "slow" in args.classes:
                slow = observe_slow(client, workdir)
                lap("slow")
            if "crash" in args.classes:
                for key, label, kw in (
                    ("trainpod_1x2", "crash-1x2", {"nodes": 1, "procs": 2, "partition": "duo"}),
                    ("trainpod_2x1_cold", "crash-cold", {"env": {"TRAINPOD_WARM_START": "0"}}),
                ):
                    compared[key], compared_errors[key] = run_class(
                        client, CLASSES[0], args.repeats, workdir, label=label, **kw
                    )
                    lap(label)
            if not args.skip_chaos:
                modes = (
                    ["restart", "in-process"]
                    if args.chaos_recovery == "both"
                    else [args.chaos_recovery]
                )
                for i in range(args.chaos_runs):  # the modes interleaved: the load drifts
                    for mode in modes:
                        try:
                            run = run_chaos(
                                client,
                                workdir,
                                args.chaos_minutes,
                                args.fault_every_s,
                                args.seed + i,
                                args.chaos_ckpt_every,
                                mode,
                                run=i,
                            )
                        except (RuntimeError, TimeoutError, TrainpodError) as exc:
                            run = {"error": f"{type(exc).__name__}: {exc}", "recovery": mode}
                        run["seed"] = args.seed + i
                        chaos_runs.setdefault(mode, []).append(run)
                        if i == 0 and mode == "in-process" and len(modes) == 2:
                            chaos_in_process = run
                        elif i == 0:
                            chaos = run
                        lap(f"chaos_{mode}" + (f"_{i}" if i else ""))
            if args.in_process:
                side = run_side_by_side(client, args.repeats, workdir)
                lap("in_process")
            if args.gpt_crash:
                gpt_crash = run_gpt_crash(client, args.repeats, workdir)
                lap("gpt_crash")
            if "node_lost" in args.classes:
                replay = check_kill_agent_replay(client)
                lap("kill_agent_replay")
        lap("cluster_delete")
    finally:
        with signals_ignored():
            shutil.rmtree(home, ignore_errors=True)
    results: dict[str, Any] = {
        "benchmark": "recovery",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "trainpod": git_state(),
        "load_start": load_start,
        "repeats": args.repeats,
        "cluster": {"name": CLUSTER, "spec": SPEC_YAML},
        "worker": {"script": str(STEPS.relative_to(ROOT)), "step_s": STEP_S},
        "mttr": {
            "classes": classes,
            "slow": asdict(slow) if slow else None,
            "kill_agent_replay": replay,
        },
        "crash_vs_torchrun": comparison(tr_samples, compared, compared_errors),
        "chaos": chaos,
        **({"chaos_in_process": chaos_in_process} if chaos_in_process is not None else {}),
        **(
            {"chaos_runs": chaos_runs, "chaos_summary": summarize_chaos(chaos_runs)}
            if args.chaos_runs > 1
            else {}
        ),
        "in_process": side,
        "gpt_crash": gpt_crash,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    results["targets"] = [*targets(results), gpt_target(gpt_crash)]
    results["load_end"] = _load()
    results["phase_times_s"] = phases
    results["run_time_s"] = time.monotonic() - t_start
    print(render(results))
    if side is not None:
        print("\n".join(render_side_by_side(side)))
    if gpt_crash is not None:
        print("\n".join(render_gpt_crash(gpt_crash)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {args.json}")
    unrecovered = sum(c["injections"] - c["recovered"] for c in classes.values())
    unrecovered += sum(1 for k, v in compared.items() if k != "trainpod_2x1" for s in v if not s.ok)
    unrecovered += sum(1 for s in tr_samples if s.error)
    unrecovered += sum(1 for s in (side or {}).get("samples", []) if s["stepping_s"] is None)
    unrecovered += sum(1 for k in (gpt_crash or {}).get("kills", []) if k["error"])
    chaos_failed = any(
        not g.get("ok") for g in [chaos or {"ok": True}, *chaos_runs.get("restart", [])]
    )
    if unrecovered or chaos_failed:
        why = f"{unrecovered} injection(s) did not recover as expected"
        why += "; the chaos job did not run to its end" if chaos_failed else ""
        print(why, file=sys.stderr)
    return 1 if unrecovered or chaos_failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the benchmark cluster was deleted", file=sys.stderr)
        sys.exit(130)
