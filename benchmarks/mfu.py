"""MFU benchmark (issue 13): the GPT example's training step, eager and compiled side by side.

Model FLOP utilisation = the model's FLOPs per second over the device's peak. The model is
``examples/gpt/train.py``'s GPT, built from ``--preset`` (``gpu-350m``: the GPU
configuration, ~0.3B parameters, bf16 autocast, fused AdamW; ``tiny``: a few layers, for a
CPU or a smoke test) with random weights, trained on the stdlib corpus the example uses.
One step is forward, backward, gradient clipping and AdamW, as in the example (no process
group: one device). FLOPs per token are PaLM's (Chowdhery et al. 2022, appendix B):
``6 N + 12 L d T``, N the parameters of every matrix multiply (the blocks' linear layers and
the tied output head; not the embeddings' lookups), L layers, d the width, T the sequence
length (causal attention counted whole, as PaLM and nanoGPT count it).

The peak is the device's dense bf16 (or TF32 for ``--dtype fp32``) rate from the vendor's
data sheet (``PEAKS``), by the name CUDA reports; ``--peak-tflops`` for any other. On a CPU
there is no such figure: the peak is then this CPU's own best matmul rate, measured first
(the same dtype, square matrices): SIMULATED, a stand-in that says how close the step comes
to the machine's matmul speed, not an MFU comparable with a GPU's. The output says so.

Modes (``--modes``, default ``eager,compiled``) alternate window by window: ``--warmup``
steps untimed (compile happens there), then ``--windows`` windows of ``--steps`` steps each,
timed with the device synchronised; the median window's figures, with min and max, and
the compiled/eager ratio. Target (issue 13): at least 45% MFU on an H200 for ``gpu-350m``.

Run it from the repository root, under the shared benchmark lock::

    flock /tmp/bench.lock .venv/bin/python benchmarks/mfu.py [--preset gpu-350m|tiny]
        [--modes eager,compiled] [--windows 5] [--steps 10] [--warmup 3]
        [--batch-size B] [--dtype bf16|fp32] [--peak-tflops X] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt" / "train.py"


def _example() -> Any:
    """examples/gpt/train.py as a module (the model and the step the example trains)."""
    spec = importlib.util.spec_from_file_location("trainpod_example_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpt = _example()

TARGET_MFU = 0.45
TINY = {
    "n_layer": 2,
    "n_embd": 128,
    "n_head": 4,
    "seq_len": 128,
    "batch_size": 8,
    "dtype": "fp32",
    "fused_adamw": True,
    "lr": 1e-3,
}
PRESETS: dict[str, dict[str, Any]] = {**gpt.PRESETS, "tiny": TINY}

PEAKS: dict[str, dict[str, float]] = {
    # Dense TFLOP/s from NVIDIA's data sheets (no sparsity); matched in order, first wins.
    "H200": {"bf16": 989.4, "fp32": 494.7},
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.4, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.1, "fp32": 183.0},
}


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    seq_len: int
    matmul_params: int

    def flops_per_token(self) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.n_layer * self.n_embd * self.seq_len


def shape_of(model: torch.nn.Module, n_layer: int, n_embd: int, seq_len: int) -> Shape:
    """The parameters every token multiplies by: each Linear's weight (the head's is the
    tied embedding, counted once, as a matmul)."""
    weights = {
        id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    }
    return Shape(n_layer, n_embd, seq_len, sum(weights.values()))


def device_peak(device: torch.device, dtype: str, given: float | None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from)."""
    if given is not None:
        return given * 1e12, f"--peak-tflops {given:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = peak_for(name, dtype)
        if tflops is None:
            raise SystemExit(f"no known peak for {name!r}: give --peak-tflops (dense {dtype})")
        return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s dense {dtype}"
    return cpu_matmul_peak(dtype), "SIMULATED: this CPU's own best matmul rate (no GPU here)"


def peak_for(name: str, dtype: str) -> float | None:
    """The dense TFLOP/s of the GPU CUDA names ``name`` (None: not in PEAKS)."""
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks[dtype]
    return None


def cpu_matmul_peak(dtype: str, n: int = 1024, reps: int = 5) -> float:
    """The best of ``reps`` n-by-n matmuls on this CPU, in FLOP/s."""
    t = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=t), torch.randn(n, n, dtype=t)
    torch.mm(a, b)  # warm
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


class Trainer:
    """One mode's model, optimizer and step, as the example builds them."""

    def __init__(self, args: argparse.Namespace, device: torch.device, compiled: bool) -> None:
        self.args, self.device = args, device
        self.model, self.opt = gpt.build(args, device)
        self.forward: Any = torch.compile(self.model) if compiled else self.model
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"
        )
        self.data, _ = gpt.load_corpus()
        self.step_no = 0

    def step(self) -> None:
        self.step_no += 1
        gen = gpt.make_generator("train", self.args.seed, self.step_no, 0)
        x, y = gpt.get_batch(self.data, self.args.batch_size, self.args.seq_len, gen)
        with self.autocast:
            loss = self.forward(x.to(self.device), y.to(self.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def window(self, steps: int) -> float:
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    peak, peak_source = device_peak(device, args.dtype, args.peak_tflops)
    modes = [m for m in args.modes.split(",") if m]
    trainers = {m: Trainer(args, device, compiled=m == "compiled") for m in modes}
    first = next(iter(trainers.values()))
    shape = shape_of(first.model, args.n_layer, args.n_embd, args.seq_len)
    tokens = args.batch_size * args.seq_len * args.steps  # per window
    warm: dict[str, float] = {}
    for mode, t in trainers.items():
        warm[mode] = t.window(args.warmup)  # compile happens here
    windows: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.windows):  # modes alternate: the box's load falls on both
        for mode, t in trainers.items():
            windows[mode].append(t.window(args.steps))
    out: dict[str, Any] = {}
    for mode, secs in windows.items():
        tok_s = [tokens / s for s in secs]
        mfu = [r * shape.flops_per_token() / peak for r in tok_s]
        out[mode] = {
            "tokens_per_s": spread(tok_s, 1),
            "tflops": spread([r * shape.flops_per_token() / 1e12 for r in tok_s], 3),
            "mfu": spread(mfu),
            "warmup_s": round(warm[mode], 2),
        }
    result: dict[str, Any] = {
        "preset": args.preset,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "simulated": device.type != "cuda" and args.peak_tflops is None,
        "dtype": args.dtype,
        "params_m": round(sum(p.numel() for p in first.model.parameters()) / 1e6, 2),
        "matmul_params_m": round(shape.matmul_params / 1e6, 2),
        "flops_per_token": shape.flops_per_token(),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "peak_tflops": round(peak / 1e12, 3),
        "peak_source": peak_source,
        "windows": args.windows,
        "steps_per_window": args.steps,
        "modes": out,
        "target_mfu": TARGET_MFU,
        "load1": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if "eager" in out and "compiled" in out:
        result["compiled_over_eager"] = round(
            out["compiled"]["tokens_per_s"]["median"] / out["eager"]["tokens_per_s"]["median"], 3
        )
    return result


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"MFU of the GPT example ({result['preset']}, {result['params_m']}M params, "
        f"{result['dtype']}, batch {result['batch_size']} x {result['seq_len']}) on "
        f"{result['device']}; peak {result['peak_tflops']} TFLOP/s ({result['peak_source']})"
    ]
    for mode, m in result["modes"].items():
        mfu, tok = m["mfu"], m["tokens_per_s"]
        lines.append(
            f"  {mode}: MFU {mfu['median']:.1%} [{mfu['min']:.1%}-{mfu['max']:.1%}], "
            f"{tok['median']:.0f} tok/s, {m['tflops']['median']} TFLOP/s "
            f"(median of {result['windows']} windows; warm-up {m['warmup_s']} s)"
        )
    if "compiled_over_eager" in result:
        lines.append(f"  compiled / eager: {result['compiled_over_eager']}x")
    if result["simulated"]:
        lines.append("  SIMULATED: no GPU here; the peak is this CPU's matmul rate")
    lines.append(f"  load1 {result['load1']}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu-350m")
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled, or both")
    ap.add_argument("--windows", type=int, default=5, help="timed windows per mode (>= 5)")
    ap.add_argument("--steps", type=int, default=10, help="steps per window")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    for key, value in preset.items():
        if key not in ("compile",) and getattr(args, key, None) is None:
            setattr(args, key, value)
    args.fused_adamw = preset.get("fused_adamw", False)
    bad = [m for m in args.modes.split(",") if m not in ("eager", "compiled")]
    if bad or not args.modes:
        ap.error(f"--modes takes eager and/or compiled, not {','.join(bad) or 'nothing'}")
    if args.windows < 5:
        ap.error("--windows must be at least 5 (the median of fewer says little)")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    print(summary(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
