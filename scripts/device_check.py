#!/usr/bin/env python3
"""The GPU checks of issue 13 in one run, for a machine with an NVIDIA GPU (an H200).

What the CPU machines cannot show, step by step, each guarded (a failing step is recorded
with its exit status and log, and the next one runs):

1. ``nvidia-smi``: the driver, the GPU, its memory;
2. the NVML health checks and the deep check (``scripts/gpu_health_probe.py``);
3. NCCL: the GPT example under ``torchrun`` (one process a GPU), DDP over NCCL, in the GPU
   configuration (``--preset gpu-350m``: bf16, compiled, fused AdamW), checkpointing every
   10 steps through ``trainpod.Checkpointer``: its log has each save's stall, the copy of
   GPU memory into pinned host buffers;
4. the same training through trainpod itself: a one-node local cluster whose node holds
   every GPU (the agent gives its ranks ``CUDA_VISIBLE_DEVICES``, its heartbeats carry NVML's
   telemetry), the GPT example submitted with ``trainpod submit --wait``, then ``trainpod
   show`` and ``trainpod nodes --json`` (the devices as the controller sees them), and the
   cluster deleted;
5. MFU: ``benchmarks/mfu.py`` for the same preset, eager and compiled side by side.

Everything goes under ``--out`` (default ``device-out``): one log per step, ``mfu.json``,
``health.json``, and ``summary.json`` (each step's status and seconds, the MFU figures and
the checkpoint stalls). ``--smoke`` runs the same steps on this machine's CPU with a tiny
model and no GPU steps (SIMULATED; what CI runs, so the script is known to work before a
GPU's minutes are spent on it).

    python scripts/device_check.py [--out DIR] [--smoke] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STALL = re.compile(r"checkpoint step (\d+): snapshot in ([0-9.]+) s")
TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64"]
TINY += ["--batch-size", "4", "--dtype", "bf16", "--fused-adamw"]


def step(
    out: Path, name: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one step; its output to ``out/name.log``; never raises."""
    log = out / f"{name}.log"
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    start = time.monotonic()
    try:
        with log.open("w") as fh:
            rc = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        with log.open("a") as fh:
            fh.write(f"\ndevice_check: {exc}\n")
        rc = None
    took = round(time.monotonic() - start, 1)
    tail = log.read_text(errors="replace").splitlines()[-3:]
    print(f"== {name}: {'rc ' + str(rc) if rc is not None else 'did not finish'} in {took} s")
    for line in tail:
        print(f"   {line}")
    return {"rc": rc, "seconds": took}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("device-out"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, no GPU")
    ap.add_argument("--steps", type=int, default=30, help="training steps of the NCCL run")
    args = ap.parse_args(argv)
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    gpus = shutil.which("nvidia-smi") is not None and not args.smoke
    steps: dict[str, dict[str, Any]] = {}
    if gpus:
        steps["nvidia-smi"] = step(out, "nvidia-smi", ["nvidia-smi"], 60)
        probe = [py, "scripts/gpu_health_probe.py", "--out", str(out / "health.json")]
        steps["health"] = step(out, "health", [*probe, "--deep-timeout-s", "120"], 300)
    model = TINY if args.smoke else ["--preset", "gpu-350m"]
    ckpt = out / "ckpt"
    train = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    train += ["gpu" if gpus else "1", str(ROOT / "examples" / "gpt" / "train.py")]
    train += ["--steps", str(args.steps), "--ckpt-every", "10", "--log-every", "5"]
    train += ["--ckpt-dir", str(ckpt), "--ckpt-memory", str(out / "shm"), *model]
    steps["nccl-train"] = step(out, "nccl-train", train, 900)
    gpt = [str(ROOT / "examples" / "gpt" / "train.py"), *train[train.index("--steps") :]]
    gpt[gpt.index("--ckpt-dir") + 1] = str(out / "ckpt-trainpod")
    gpt[gpt.index("--ckpt-memory") + 1] = str(out / "shm-trainpod")
    steps.update(under_trainpod(out, py, _gpu_count() if gpus else 1, gpt))
    mfu = [py, "benchmarks/mfu.py", "--json", str(out / "mfu.json")]
    mfu += ["--preset", "tiny", "--modes", "eager", "--steps", "2"] if args.smoke else []
    steps["mfu"] = step(out, "mfu", mfu, 900)
    for shm in ("shm", "shm-trainpod"):  # copies of the model's state: not kept
        shutil.rmtree(out / shm, ignore_errors=True)
    train_log = (out / "nccl-train.log").read_text(errors="replace")
    trainpod_log = _text(out / "trainpod-train.log")
    summary = {
        "smoke": args.smoke,
        "gpu": gpus,
        "steps": steps,
        "checkpoint_stalls_s": [float(m.group(2)) for m in STALL.finditer(train_log)],
        "trainpod_checkpoint_stalls_s": [float(m.group(2)) for m in STALL.finditer(trainpod_log)],
        "mfu": _read(out / "mfu.json"),
        "health": _read(out / "health.json"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary: {out / 'summary.json'}")
    return 0 if all(s["rc"] == 0 for s in steps.values()) else 1


def under_trainpod(out: Path, py: str, devices: int, gpt: list[str]) -> dict[str, Any]:
    """The GPT run through trainpod: a local cluster of one node with ``devices`` devices (every
    GPU; on a CPU, simulated slots), ``trainpod submit --wait``, what the controller shows, and
    the cluster deleted whatever happened. Its own ``TRAINPOD_HOME`` under ``out``."""
    home = out / "trainpod-home"
    home.mkdir(parents=True, exist_ok=True)
    spec = home / "cluster.yaml"
    spec.write_text(
        "name: devcheck\nbackend: local\ninstance_groups:\n"
        "  - {name: head, role: head, count: 1, devices_per_node: 0}\n"
        f"  - {{name: gpu, count: 1, devices_per_node: {devices}}}\n"
    )
    env = {"TRAINPOD_HOME": str(home)}
    cli = [py, "-m", "trainpod.cli.main"]
    got: dict[str, dict[str, Any]] = {}
    got["trainpod-cluster"] = step(
        out, "trainpod-cluster", [*cli, "cluster", "create", "-f", str(spec)], 300, env
    )
    try:
        if got["trainpod-cluster"]["rc"] == 0:
            submit = [*cli, "submit", "-N", "1", "--wait", "--", py, *gpt]
            got["trainpod-train"] = step(out, "trainpod-train", submit, 900, env)
            got["trainpod-show"] = step(out, "trainpod-show", [*cli, "show", "1"], 60, env)
            got["trainpod-nodes"] = step(out, "trainpod-nodes", [*cli, "nodes", "--json"], 60, env)
    finally:
        got["trainpod-delete"] = step(
            out, "trainpod-delete", [*cli, "cluster", "delete", "devcheck"], 120, env
        )
    return got


def _gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in listed.stdout.splitlines()))


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
