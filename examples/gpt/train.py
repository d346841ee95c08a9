"""Train a small byte-level GPT on the Python standard library with DistributedDataParallel.

A self-contained example workload for trainpod: a decoder-only transformer in plain torch
(token + position embedding, pre-LN blocks with causal ``scaled_dot_product_attention`` and an
MLP, output head tied to the token embedding) trained on the stdlib's own ``.py`` files,
tokenised as bytes (vocab 256). Gloo on CPU; NCCL on ``cuda:LOCAL_RANK`` when CUDA is available.

The same file runs three ways, with no code changes:

1. standalone -- ``python examples/gpt/train.py --steps 20``. Without ``WORLD_SIZE`` in the
   environment it trains as a single process with no process group.
2. under torchrun -- ``torchrun --nproc-per-node 2 examples/gpt/train.py --steps 20``. RANK,
   LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are read by ``init_process_group``
   (``env://``).
3. under trainpod -- as torchrun; checkpoint locations come from the environment
   (``TRAINPOD_CHECKPOINT_DIR``, the default ``--ckpt-dir``, and node scratch), and
   ``TRAINPOD_JOB_ID``/``TRAINPOD_ATTEMPT`` are logged.
4. under trainpod with ``--recovery in-process`` -- the loop runs in ``trainpod.elastic.run``
   (it always does with a process group; without the opt-in it is a plain loop): when a rank
   dies, the healthy ranks keep their processes, re-form the group with its replacement,
   which takes their state, rebind the Checkpointer and the DDP wrapper, and go on from the
   newest step every rank holds (ADR 0026, ADR 0046).

Checkpoints go through ``trainpod.Checkpointer`` (trainpod must be installed, also for 1 and
2): the model and the AdamW state (moments and step counts) as PyTorch Distributed
Checkpoint shards, first into shared memory (``--ckpt-memory``), then in the background to
node scratch, a peer node and the durable ``--ckpt-dir``, committed with a checksummed
manifest. Every rank saves and loads (the calls are collective). On start, every rank loads
the newest checkpoint that verifies, from the fastest tier that holds it, falling back to
another tier or an older step (and says why); a torn or corrupt checkpoint is never loaded.
By default (``--ckpt-every auto``) it saves as often as the costs call for: Young/Daly's
``sqrt(2 x stall x MTBF)`` from its own measured save stall and the failure rate trainpod
has observed, every few seconds when a save is cheap; the slower tiers take the newest step
whenever they are free and skip the rest.

Batches are a pure function of (seed, step, rank) and the learning rate a function of the
step, so the step is all the data position there is: a run resumed from a checkpoint sees
the same data as an uninterrupted one and ends with bitwise the same loss. SIGTERM keeps its
default behaviour (exit at once); a checkpoint whose save was cut short has no manifest and
is passed over.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import sysconfig
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import trainpod
from trainpod import elastic
from trainpod.ckpt import IntervalBounds

CORPUS_CAP_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.1
EVAL_BATCHES = 8
CLOSE_TIMEOUT_S = 300.0
"""How long the end of the run waits for checkpoint copies still in flight."""
MAX_REASONS_SHOWN = 8


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only byte-level transformer with a tied output head."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd {n_embd} is not divisible by --n-head {n_head}")
        self.wte = nn.Embedding(256, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 256, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2 init, residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- data


def load_corpus(cap: int = CORPUS_CAP_BYTES) -> tuple[Tensor, Tensor]:
    """Stdlib ``*.py`` (top level + one package level), sorted, capped; returns (train, val)."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))
    skip = ("site-packages", "dist-packages")
    rel = sorted(os.path.relpath(f, root) for f in files if not any(s in f for s in skip))
    chunks: list[bytes] = []
    size = 0
    for name in rel:
        with open(os.path.join(root, name), "rb") as fh:
            chunk = fh.read() + b"\n"
        chunks.append(chunk[: cap - size])
        size += len(chunks[-1])
        if size >= cap:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    if len(data) < 1024:
        raise RuntimeError(f"corpus under {root} is too small ({len(data)} bytes)")
    n_val = int(len(data) * VAL_FRACTION)
    return data[:-n_val], data[-n_val:]


def make_generator(tag: str, seed: int, step: int, rank: int) -> torch.Generator:
    """A generator whose state depends only on its arguments (never on history)."""
    digest = hashlib.sha256(f"{tag}:{seed}:{step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def get_batch(
    data: Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    starts = torch.randint(len(data) - seq_len - 1, (batch,), generator=gen)
    chunk = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------- checkpoints


class TrainState:
    """Model and optimizer as one ``Stateful`` for ``trainpod.Checkpointer``.

    DCP's ``get_state_dict`` keys the optimizer state by parameter name (so it reshards and
    survives a different world size) and, for an optimizer that has not stepped yet, creates
    its state with a zero-lr step so that a load has tensors to fill in place. The
    parameters are untouched by that, but the optimizer is not fresh any more: a run that
    loads nothing must rebuild it (see ``main``).
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.opt,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optimizer"],
        )


def ckpt_every(value: str) -> int | str:
    """``--ckpt-every``: a number of steps (0: no saves) or ``auto``."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"got {value!r}; give a number of steps or 'auto'"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"got {n}; give 0 (no saves), N > 0 or 'auto'")
    return n


def describe_interval(ckpt: trainpod.Checkpointer) -> str:
    """``; next in N steps (S s: stall X s, MTBF M s)``: what the ranks agreed on."""
    costs, steps, seconds = ckpt.costs, ckpt.interval_steps, ckpt.interval_s()
    if costs is None or steps is None or seconds is None:
        return "; interval: still timing the steps"
    return (
        f"; interval {steps} steps ({seconds:.1f} s: stall {costs.stall_s:.3f} s, "
        f"MTBF {costs.mtbf_s:.0f} s)"
    )


def memory_tier(value: str) -> bool | str:
    """``--ckpt-memory``: ``on`` (/dev/shm), ``off`` or a directory."""
    return {"on": True, "off": False}.get(value, value)


def describe_tiers(ckpt: trainpod.Checkpointer) -> str:
    return ", ".join(f"{t.name} {getattr(t, 'root', '')}".strip() for t in ckpt.tiers)


def describe_load(ckpt: trainpod.Checkpointer, start: int, distributed: bool) -> list[str]:
    """The resume line (step, tier per rank, seconds) and one line per fallback reason.

    Collective when ``distributed``: every rank's tier is gathered (they differ when a rank
    moved to another node and reads a peer or durable copy).
    """
    res = ckpt.last_load
    assert res is not None
    tiers = [res.tier or "?"]
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res.tier or "?")
        tiers = [str(t) for t in gathered]
    if len(set(tiers)) == 1:
        where = f"tier {tiers[0]},"
    else:  # "memory+peer": this rank read some files from each
        where = "tiers " + ", ".join(f"rank {r} {t}" for r, t in enumerate(tiers)) + ";"
    lines = [
        f"resuming from step {res.step} ({where} {res.seconds:.2f} s); continuing at step {start}"
    ]
    return lines + describe_reasons(res.reasons)


def describe_reasons(reasons: tuple[str, ...]) -> list[str]:
    lines = [f"  fell back: {why}" for why in reasons[:MAX_REASONS_SHOWN]]
    if len(reasons) > MAX_REASONS_SHOWN:
        lines.append(f"  ... and {len(reasons) - MAX_REASONS_SHOWN} more reasons")
    return lines


def write_summary(ckpt_dir: str, summary: dict[str, Any]) -> None:
    """``summary.json`` next to the checkpoints (a local directory or an fsspec URL)."""
    body = json.dumps(summary, indent=2)
    if "://" in ckpt_dir and not ckpt_dir.startswith("file://"):
        import fsspec  # a trainpod dependency

        with fsspec.open(f"{ckpt_dir.rstrip('/')}/summary.json", "w") as fh:
            fh.write(body)
        return
    local = ckpt_dir.removeprefix("file://")
    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, "summary.json"), "w") as fh:
        fh.write(body)


# ----------------------------------------------------------------------------- training


PRESETS: dict[str, dict[str, Any]] = {
    # The GPU configuration (issue 13): ~0.3B parameters, bf16 autocast, compiled, fused
    # AdamW; sized for one H100/H200-class GPU per rank. Any flag given after it wins.
    "gpu-350m": {
        "n_layer": 24,
        "n_embd": 1024,
        "n_head": 16,
        "seq_len": 1024,
        "batch_size": 16,
        "dtype": "bf16",
        "compile": True,
        "fused_adamw": True,
        "lr": 3e-4,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named configuration (gpu-350m: the GPU one); flags given too override it",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the forward and backward under bf16 autocast (weights, grads and the "
        "optimizer stay fp32, so checkpoints are the same either way)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW's fused kernel")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak lr (short warmup + cosine)")
    p.add_argument(
        "--ckpt-every",
        type=ckpt_every,
        default="auto",
        help="auto (default): save at the Young/Daly interval sqrt(2 x stall x MTBF) from the "
        "measured save stall (running median) and the MTBF trainpod observed "
        "($TRAINPOD_MTBF_S, set at launch; default 4 h), within --ckpt-min-interval-s and "
        "--ckpt-max-interval-s; N: every N steps; 0: never (a checkpoint is still resumed "
        "from). Always after the last step.",
    )
    p.add_argument(
        "--ckpt-min-interval-s",
        type=float,
        default=1.0,
        help="auto: never save more often than this (seconds)",
    )
    p.add_argument(
        "--ckpt-max-interval-s",
        type=float,
        default=1800.0,
        help="auto: save at least this often (seconds)",
    )
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("TRAINPOD_CHECKPOINT_DIR")
        or os.environ.get("TRAINPOD_CHECKPOINT_URI")
        or "./checkpoints/gpt",
        help="durable checkpoint store, a directory or fsspec URL (s3://...); default: "
        "$TRAINPOD_CHECKPOINT_DIR, else $TRAINPOD_CHECKPOINT_URI, else ./checkpoints/gpt",
    )
    p.add_argument(
        "--ckpt-memory",
        type=memory_tier,
        default="on",
        help="shared-memory tier: on (/dev/shm/trainpod), off, or a directory to use instead",
    )
    p.add_argument(
        "--ckpt-scratch-dir",
        default=None,
        help="node-local scratch tier root; default: $TRAINPOD_JOB_SCRATCH_DIR (under "
        "trainpod), else none",
    )
    p.add_argument(
        "--collective-timeout-s",
        type=float,
        default=10.0,
        help="with --recovery in-process: how long a collective waits for a peer before this "
        "rank calls its group lost (a peer that hangs is replaced in process once its "
        "peers say so); more than the slowest step's wait at a collective",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--progress-dir",
        default=None,
        help="append a line per step to DIR/progress-rank<r>.log (gen=<restart count> "
        "rank= pid= step= t=<time.time()>): when each rank stepped, for benchmarks",
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=0, help="0: evaluate only at the end")
    p.add_argument(
        "--threads", type=int, default=None, help="default: 1 if several ranks share a machine"
    )
    known, _ = p.parse_known_args(argv)
    if known.preset is not None:
        p.set_defaults(**PRESETS[known.preset])
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak (steps are 1-based)."""
    warmup = max(1, min(20, args.steps // 10))
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def mean_over_ranks(value: float, device: torch.device, distributed: bool) -> float:
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: nn.Module, val: Tensor, args: argparse.Namespace, rank: int, dev: Any) -> float:
    model.eval()
    losses = []
    for i in range(EVAL_BATCHES):
        gen = make_generator("val", args.seed, i, rank)
        x, y = get_batch(val, args.batch_size, args.seq_len, gen)
        losses.append(model(x.to(dev), y.to(dev)).item())
    model.train()
    return sum(losses) / len(losses)


def build(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, initialised from ``--seed`` (identical on every rank), and its AdamW."""
    torch.manual_seed(args.seed)
    model = GPT(args.n_layer, args.n_embd, args.n_head, args.seq_len).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = {"fused": True} if args.fused_adamw else {}
    return model, torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **fused)


def open_progress(directory: str | None, rank: int) -> Any:
    """A function that appends ``step``'s line to this rank's progress file (None: no
    ``--progress-dir``). ``gen`` is torchrun's restart count (trainpod: attempt - 1), so a
    restarted generation's first line is its first step, under either launcher."""
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    out = open(os.path.join(directory, f"progress-rank{rank}.log"), "a")  # noqa: SIM115
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def line(step: int) -> None:
        out.write(f"gen={gen} rank={rank} pid={os.getpid()} step={step} t={time.time():.6f}\n")
        out.flush()

    return line


def make_checkpointer(args: argparse.Namespace, log: Any) -> trainpod.Checkpointer:
    """The run's Checkpointer, as ``--ckpt-*`` say. Every rank, same point: collective."""
    auto = args.ckpt_every == "auto"
    ckpt = trainpod.Checkpointer(
        args.ckpt_dir,
        every=None if auto or not args.ckpt_every else int(args.ckpt_every),
        interval="auto" if auto else None,
        memory=args.ckpt_memory,
        scratch_dir=args.ckpt_scratch_dir,
        bounds=IntervalBounds(min_s=args.ckpt_min_interval_s, max_s=args.ckpt_max_interval_s),
    )
    mtbf = os.environ.get("TRAINPOD_MTBF_SOURCE") or (
        f"MTBF {os.environ['TRAINPOD_MTBF_S']} s"
        if "TRAINPOD_MTBF_S" in os.environ
        else "no fault seen yet, MTBF 4 h assumed"
    )
    every = f"at the Young/Daly interval ({mtbf})" if auto else f"every {args.ckpt_every} steps"
    log(f"checkpoints: {every if args.ckpt_every else 'not saved'}; tiers {describe_tiers(ckpt)}")
    return ckpt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if args.threads is None and local_world > 1:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # With --recovery in-process, trainpod.elastic.run makes (and re-makes) the process group.
    in_process = distributed and os.environ.get("TRAINPOD_RECOVERY") == "in-process"
    if distributed and not in_process:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", "0")) if distributed else 0

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    job = os.environ.get("TRAINPOD_JOB_ID")
    attempt = os.environ.get("TRAINPOD_ATTEMPT")
    log(
        f"gpt: world {world}, device {device}, threads {torch.get_num_threads()}, "
        f"ckpt dir {args.ckpt_dir}"
        + (f", job {job} attempt {attempt}" if job else "")
        + (", in-process recovery" if in_process else "")
    )

    train_data, val_data = load_corpus()
    model, opt = build(args, device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"model: {n_params / 1e6:.2f}M params, corpus {len(train_data) + len(val_data)} bytes")
    # What a step changes, for elastic.run's in-memory copies (plain state dicts: DCP's
    # get_state_dict would prime an optimizer that has not stepped yet, see TrainState).
    live: dict[str, Any] = {"model": model, "optim": opt}
    state: dict[str, Any] = {"train": TrainState(model, opt), "loss": float("nan")}
    auto = args.ckpt_every == "auto"
    box: dict[str, Any] = {}  # the Checkpointer and the forward module of the current group
    # Where this run started, the newest step it saved (which steps log, and so all-reduce
    # the loss: every rank must agree), steps done and logged since the last line.
    run = {"start": 1, "loss": float("nan"), "saved": 0, "done": 0, "since_log": 0}

    def on_group() -> None:
        """Once per process group: the first time the Checkpointer (every rank, same point,
        same order: its calls are collective), after an in-process recovery its rebind; and
        the DDP wrapper, which is bound to its group."""
        if "ckpt" in box:
            box["ckpt"].rebind()
        else:
            box["ckpt"] = make_checkpointer(args, log)
        wrap()
        if distributed:  # a rank started fresh into a running group learns where it stands
            at = torch.tensor([run["start"], run["saved"]], dtype=torch.int64, device=device)
            dist.all_reduce(at, op=dist.ReduceOp.MAX)
            run["start"], run["saved"] = (int(v) for v in at.tolist())

    def wrap() -> None:
        m = live["model"]
        ddp: nn.Module = (
            DDP(m, device_ids=[local_rank] if device.type == "cuda" else None) if distributed else m
        )
        # Checkpoints always hold `model`'s own state (no `_orig_mod.` prefix from compile), so
        # a compiled run and an eager one resume from each other's checkpoints.
        box["forward"] = torch.compile(ddp) if args.compile else ddp

    def resume() -> int:
        """Load the newest checkpoint that verifies (a rank started fresh into a running
        group takes its peers' state instead, and does not come here)."""
        ckpt = box["ckpt"]
        loaded = ckpt.load_latest(state)
        if loaded is None:
            assert ckpt.last_load is not None
            reasons = ckpt.last_load.reasons
            if reasons:
                log("no checkpoint could be loaded; starting from scratch")
                for line in describe_reasons(reasons):
                    log(line)
            if reasons or live["optim"].state:
                # A candidate was planned (which primes the optimizer, see TrainState) or even
                # partly read: start from a fresh model and optimizer, as an uninterrupted run.
                m, o = build(args, device)
                live.update(model=m, optim=o)
                state["train"] = TrainState(m, o)
                wrap()
            start = 1
        else:
            start = loaded + 1
            run["loss"] = float(state["loss"])
            for line in describe_load(ckpt, start, distributed):
                log(line)
        run["start"], run["saved"] = start, start - 1  # saved: the newest checkpoint's step
        return start

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    log(
        f"precision {args.dtype}, {'compiled' if args.compile else 'eager'}, "
        f"AdamW {'fused' if args.fused_adamw else 'foreach'}"
        + ("" if device.type == "cuda" else " (CPU: no GPU here)")
    )

    tokens_per_step = args.batch_size * args.seq_len * world
    t_start = t_log = time.perf_counter()
    progress = open_progress(args.progress_dir, rank)

    def train_step(step: int) -> None:
        nonlocal t_log
        m, o, ckpt = live["model"], live["optim"], box["ckpt"]
        x, y = get_batch(
            train_data,
            args.batch_size,
            args.seq_len,
            make_generator("train", args.seed, step, rank),
        )
        for group in o.param_groups:
            group["lr"] = lr_at(step, args)
        with autocast:
            loss = box["forward"](x.to(device), y.to(device))
        o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        run["done"] += 1
        run["since_log"] += 1
        last = step == args.steps
        # Also the first step after a checkpoint: a run resumed from it logs that step first,
        # so the two lines can be compared (`trainpod demo` does).
        logged = (
            last
            or step in (run["start"], run["saved"] + 1)
            or bool(args.log_every and step % args.log_every == 0)
        )
        metrics = {"tokens": args.batch_size * args.seq_len, "lr": lr_at(step, args)}
        if logged:
            run["loss"] = mean_over_ranks(loss.item(), device, distributed)
            metrics["loss"] = run["loss"]
        # A datagram; never blocks. lr and loss become the job's TensorBoard scalars
        # (metrics/lr, metrics/loss); loss only on logged steps: loss.item() waits for the
        # step on a GPU, so reading it every step would stall the pipeline.
        trainpod.report(step, **metrics)
        if progress is not None:
            progress(step)
        if logged:
            now = time.perf_counter()
            tok_s = run["since_log"] * tokens_per_step / max(now - t_log, 1e-9)
            loss_s = f"loss {run['loss']:.4f} tok/s {tok_s:.0f}"
            log(f"step {step}/{args.steps} {loss_s} (world {world})")
            t_log, run["since_log"] = now, 0
        if args.eval_every and step % args.eval_every == 0 and not last:
            val = mean_over_ranks(evaluate(m, val_data, args, rank, device), device, distributed)
            log(f"step {step}/{args.steps} val_loss {val:.4f}")
        due = ckpt.due(step)  # every step: it also times them for --ckpt-every auto
        if args.ckpt_every and (due or last):
            loss_now = run["loss"] if logged else mean_over_ranks(loss.item(), device, distributed)
            state["loss"] = loss_now
            ckpt.save(step, state)  # returns after the copy into staging memory
            run["saved"] = step
            nxt = describe_interval(ckpt) if auto else ""
            log(f"checkpoint step {step}: snapshot in {ckpt.last_stall_s or 0.0:.3f} s{nxt}")

    if distributed:
        # A plain loop over the process group made above, or (--recovery in-process) one
        # whose healthy ranks survive a peer's fault: they re-form the group with its
        # replacement, which takes their state, and go on (ADR 0026).
        elastic.run(
            train_step,
            live,
            steps=args.steps + 1,
            start_step=1,
            on_group=on_group,
            resume=resume,
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout_s=args.collective_timeout_s,
        )
    else:
        on_group()
        for step in range(resume(), args.steps + 1):
            train_step(step)
    model, ckpt, start, loss_val = live["model"], box["ckpt"], run["start"], run["loss"]
    steps_done = run["done"]
    elapsed = time.perf_counter() - t_start
    tok_s = steps_done * tokens_per_step / elapsed if steps_done else 0.0

    val_loss = mean_over_ranks(evaluate(model, val_data, args, rank, device), device, distributed)
    complete = ckpt.close(CLOSE_TIMEOUT_S)  # the copies in flight; collective
    progress = ckpt.progress()
    if progress.committed and any(s is not None for s in progress.committed.values()):
        tiers = ", ".join(f"{t} step {s}" for t, s in progress.committed.items())
        log(f"checkpoints committed: {tiers}")
    for tier, err in progress.errors.items():
        log(f"checkpoint copy to {tier} failed: {err}")
    if not complete:
        log(f"checkpoint copies still in flight after {CLOSE_TIMEOUT_S:.0f} s were abandoned")
    final_step = max(args.steps, start - 1)
    if rank == 0:
        summary = {
            "final_step": final_step,
            "steps_this_run": steps_done,
            "final_loss": loss_val,
            "val_loss": val_loss,
            "world_size": world,
            "tokens_per_s": tok_s,
            "wall_s": elapsed,
        }
        write_summary(args.ckpt_dir, summary)
    log(f"done: steps={final_step} final_loss={loss_val:.4f} val_loss={val_loss:.4f}")
    if distributed:
        # Every rank leaves together: a rank that tears down Gloo while a peer is still
        # writing the summary can abort in the transport's destructor.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
