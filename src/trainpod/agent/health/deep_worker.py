"""One rank of the deep health check: a checked matrix product, then an all-reduce.

Run only as a subprocess by :mod:`trainpod.agent.health.deep`; it imports torch, which the
agent process never does. Prints JSON objects on stdout, one line per finished step (the
reader merges them), and exits 0 whenever it got that far; a failing step is reported in
the JSON, not by the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import numpy as np

REL_TOL = 3e-5  # of max |reference|; float32 products of size 1024 err ~1e-6 of it


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainpod.agent.health.deep_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init-file", required=True, help="rendezvous file, must not exist yet")
    p.add_argument("--kind", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--simulated-fault", default=None, help="make the product fail, saying why")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    import torch  # here, not at import time: only this subprocess pays for torch

    result: dict[str, Any] = {"rank": args.rank, "import_s": round(time.monotonic() - t0, 3)}
    kind = args.kind
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    result.update(kind=kind, simulated=kind == "cpu")
    try:
        device = _device(torch, kind, args.rank)
        result["device"] = f"{kind}:{args.rank}"  # a CPU slot is named by its index too
    except Exception as exc:
        result["device"] = f"{kind}:{args.rank}"
        result["matmul"] = {"ok": False, "reason": f"no device: {exc}"}
        result["allreduce"] = {"ok": False, "reason": "skipped: no device"}
        print(json.dumps(result), flush=True)
        return 0
    result["matmul"] = _step(lambda: _matmul(torch, device, args))
    print(json.dumps(result), flush=True)  # reported even if the all-reduce then hangs
    print(json.dumps({"allreduce": _step(lambda: _allreduce(torch, device, kind, args))}))
    return 0


def _device(torch: Any, kind: str, rank: int) -> Any:
    if kind == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    found = torch.cuda.device_count()
    if rank >= found:
        raise RuntimeError(f"CUDA device {rank} does not exist ({found} visible)")
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would fail the float32 tolerance
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _step(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        out: dict[str, Any] = fn()
    except Exception as exc:
        tail = traceback.format_exc().strip().splitlines()[-1]
        out = {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "trace": tail}
    out["seconds"] = round(time.monotonic() - start, 3)
    return out


def _matmul(torch: Any, device: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Compare the device's float32 product with numpy's float64 one on the CPU."""
    rng = np.random.default_rng(1234 + args.rank)
    a = rng.uniform(-1, 1, (args.size, args.size)).astype(np.float32)
    b = rng.uniform(-1, 1, (args.size, args.size)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    tol = REL_TOL * float(np.abs(ref).max())
    ta, tb = torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)
    worst = 0.0
    for _ in range(args.iterations):
        got = (ta @ tb).cpu().numpy().astype(np.float64)
        worst = max(worst, float(np.abs(got - ref).max()))
    out: dict[str, Any] = {"size": args.size, "iterations": args.iterations}
    out.update(max_abs_err=worst, tolerance=tol, ok=worst <= tol)
    if worst > tol:
        out["reason"] = f"result differs from the float64 reference by {worst:.3g} (> {tol:.3g})"
    if args.simulated_fault:
        out.update(ok=False, reason=f"simulated: {args.simulated_fault}")
    return out


def _allreduce(torch: Any, device: Any, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Each rank contributes its index; every element must come back as the sum."""
    import torch.distributed as dist

    backend = "nccl" if kind == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout_s),
    )
    try:
        tensor = torch.full((1024,), float(args.rank), device=device)
        dist.all_reduce(tensor)
        values = sorted(set(tensor.cpu().tolist()))
    finally:
        dist.destroy_process_group()
    expected = args.world * (args.world - 1) / 2
    out: dict[str, Any] = {"backend": backend, "expected": expected, "got": values}
    out["ok"] = values == [expected]
    if not out["ok"]:
        out["reason"] = f"sum was {values}, expected {expected}"
    return out


if __name__ == "__main__":
    sys.exit(main())
