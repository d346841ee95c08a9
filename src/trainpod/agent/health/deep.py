"""The deep health check (burn-in), run before a node (re)joins the pool.

``python -m trainpod.agent.health.deep --devices N --scratch DIR [--simulated-state FILE]
[--json-out FILE]`` runs, and :func:`run_deep_check` spawns and reads:

a. on each device, a float32 matrix product checked against numpy's float64 product on
   the CPU (real ``cuda:i`` on GPUs; on CPU slots a one-thread CPU product, marked
   ``simulated``);
b. an all-reduce across the node's devices: one process per device (Gloo on CPU, NCCL on
   CUDA), each contributing its index, and the sum checked;
c. a disk test on the scratch directory: write 64 MiB, fsync, read back, compare sha256;
d. with ``--simulated-state``, a simulated GPU with an active fault (lost, a node-fault XID
   not cleared, uncorrectable ECC, a remap failure) fails its matrix product, saying why.

Steps (a)+(b) run in the device processes while this process does (c). The result is one
JSON object: ``status`` ("ok" or "fault"), ``reason``, ``simulated``, per-step results
and timings. Exit status 0 when ok, 1 on a fault, 2 on bad arguments. This module does not
import torch; only the device processes do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainpod.agent.health.base import CheckResult, Status
from trainpod.agent.health.simgpu import simulated_faults

MIB = 2**20
_WORKER = "trainpod.agent.health.deep_worker"
ABORT_GRACE_S = 10.0


def run_deep_check(
    devices: int,
    scratch: Path,
    simulated_state: Path | None,
    timeout_s: float = 120,
    *,
    kind: str = "auto",
    disk_mib: int = 64,
) -> CheckResult:
    """Run the deep check in a subprocess and return its verdict as a ``CheckResult``.

    Blocking, up to ``timeout_s``; the subprocess and its device processes are killed
    after that (FAULT "timed out"). Never raises for a failing node: a crash or garbled
    output is a FAULT whose reason carries the subprocess's last error line.
    """
    with tempfile.TemporaryDirectory(prefix="trainpod-deep-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", __name__, "--devices", str(devices)]
        cmd += ["--scratch", str(scratch), "--json-out", str(out), "--kind", kind]
        cmd += ["--disk-mib", str(disk_mib), "--timeout-s", str(max(timeout_s - 2, 1))]
        if simulated_state is not None:
            cmd += ["--simulated-state", str(simulated_state)]
        proc = subprocess.Popen(
            cmd,
            env=dict(os.environ, TMPDIR=tmp),  # its scratch is removed with ours, even if killed
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            reason = f"deep check timed out after {timeout_s:g} s"
            return CheckResult("deep", Status.FAULT, reason, {"timeout_s": timeout_s})
        try:
            report: dict[str, Any] = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = (stderr or "").strip().splitlines()[-1:] or ["no output"]
            reason = f"deep check crashed (exit {proc.returncode}): {tail[0]}"
            return CheckResult("deep", Status.FAULT, reason, {"exit": proc.returncode})
    status = Status.OK if report.get("status") == "ok" else Status.FAULT
    simulated = bool(report.get("simulated", False))
    return CheckResult("deep", status, str(report.get("reason", "")), report, simulated)


def deep_check(args: argparse.Namespace) -> dict[str, Any]:
    """Run steps (a)-(d) and return the report. Blocking, up to ``args.timeout_s``."""
    start = time.monotonic()
    faults = simulated_faults(args.simulated_state) if args.simulated_state else {}
    work = Path(tempfile.mkdtemp(prefix="trainpod-deep-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(args.devices):
            cmd = [sys.executable, "-m", _WORKER, "--rank", str(rank)]
            cmd += ["--world", str(args.devices), "--init-file", str(work / "rendezvous")]
            cmd += ["--kind", args.kind, "--timeout-s", str(args.timeout_s)]
            if rank in faults:
                cmd += ["--simulated-fault", f"GPU {rank}: {faults[rank]}"]
            # files, not pipes: a chatty device process can never block on a full pipe
            with open(work / f"{rank}.out", "wb") as out, open(work / f"{rank}.err", "wb") as err:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
        disk = disk_step(args.scratch, args.disk_mib)
        killed = _wait_all(procs, start + args.timeout_s)
        ranks = [_result(work, rank, p, killed.get(rank)) for rank, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    return _report(args, ranks, disk, time.monotonic() - start)


def _wait_all(procs: list[subprocess.Popen[bytes]], deadline: float) -> dict[int, str]:
    """Wait for every device process; kill the rest at the deadline, or ABORT_GRACE_S after
    one of them ended while others still run (they would wait for it in the all-reduce).
    Returns rank -> why it was killed."""
    abort_at: float | None = None
    while True:
        running = [rank for rank, p in enumerate(procs) if p.poll() is None]
        if not running:
            return {}
        now = time.monotonic()
        if abort_at is None and len(running) < len(procs):
            abort_at = now + ABORT_GRACE_S
        if now >= deadline or (abort_at is not None and now >= abort_at):
            why = "timed out (hung device or all-reduce)"
            if now < deadline:
                why = "aborted: another device process ended first, so the all-reduce hung"
            for rank in running:
                procs[rank].kill()
                procs[rank].wait()
            return dict.fromkeys(running, why)
        try:
            procs[running[0]].wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass


def _result(
    work: Path, rank: int, proc: subprocess.Popen[bytes], killed: str | None
) -> dict[str, Any]:
    """Merge the JSON lines a device process printed; fill in what it never reported."""
    result: dict[str, Any] = {"rank": rank}
    for line in (work / f"{rank}.out").read_text(errors="replace").splitlines():
        try:
            result.update(json.loads(line))
        except ValueError:
            continue  # stray output (a library's print): not ours
    err = (work / f"{rank}.err").read_text(errors="replace").strip().splitlines()
    why = killed or f"device process died (exit {proc.returncode}): {(err or ['no output'])[-1]}"
    if "matmul" not in result:
        result["error"] = why
    elif "allreduce" not in result:
        result["allreduce"] = {"ok": False, "reason": why}
    return result


def disk_step(scratch: Path, mib: int) -> dict[str, Any]:
    """Write ``mib`` MiB of random data to ``scratch``, fsync, read back, compare sha256."""
    path = scratch / f".trainpod-deep-{os.getpid()}"
    block = os.urandom(MIB)
    out: dict[str, Any] = {"path": str(path), "mib": mib}
    written = hashlib.sha256()
    t0 = time.monotonic()
    try:
        with open(path, "wb") as f:
            for i in range(mib):
                chunk = block[i % 997 :] + block[: i % 997]  # distinct blocks, cheaply
                written.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read from disk
        t1 = time.monotonic()
        read = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(4 * MIB):
                read.update(chunk)
        t2 = time.monotonic()
    except OSError as exc:
        out.update(ok=False, reason=f"disk test failed in {scratch}: {exc}")
        return out
    finally:
        path.unlink(missing_ok=True)
    out.update(write_s=round(t1 - t0, 3), read_s=round(t2 - t1, 3), sha256=written.hexdigest())
    out["ok"] = read.hexdigest() == written.hexdigest()
    if not out["ok"]:
        out["reason"] = f"disk test: data read back from {scratch} differs (sha256 mismatch)"
    return out


def _report(
    args: argparse.Namespace, ranks: list[dict[str, Any]], disk: dict[str, Any], total_s: float
) -> dict[str, Any]:
    kinds = {r.get("kind", "?") for r in ranks}
    simulated = any(r.get("simulated", False) for r in ranks)
    problems: list[str] = []
    for r in ranks:
        where = f"device {r.get('device', r['rank'])}"
        if "error" in r:
            problems.append(f"{where}: {r['error']}")
            continue
        if not r["matmul"].get("ok"):
            problems.append(f"{where}: matrix product failed ({r['matmul'].get('reason')})")
        if not r["allreduce"].get("ok") and not r["allreduce"].get("reason", "").startswith(
            "skipped"
        ):
            problems.append(f"{where}: all-reduce failed ({r['allreduce'].get('reason')})")
    if not disk.get("ok"):
        problems.append(str(disk.get("reason")))
    label = "CPU slots (simulated)" if simulated else f"{'/'.join(sorted(kinds))} devices"
    reason = "; ".join(problems) or f"deep check passed on {args.devices} {label}"
    return {
        "status": "fault" if problems else "ok",
        "reason": reason,
        "simulated": simulated,
        "devices": args.devices,
        "kind": "/".join(sorted(kinds)),
        "total_s": round(total_s, 3),
        "steps": {"ranks": ranks, "disk": disk},
    }


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, required=True, help="devices to check (>= 1)")
    p.add_argument("--scratch", type=Path, required=True, help="directory for the disk test")
    p.add_argument("--simulated-state", type=Path, default=None, help="simulated GPU state")
    p.add_argument("--json-out", type=Path, default=None, help="write the report here")
    p.add_argument("--kind", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--disk-mib", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=110.0)
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error(f"--devices must be at least 1, got {args.devices}")
    report = deep_check(args)
    text = json.dumps(report, indent=1)
    if args.json_out is not None:
        tmp = args.json_out.with_name(args.json_out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.json_out)
    else:
        print(text)
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
