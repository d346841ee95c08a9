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
3. under trainpod -- as torchrun, plus ``TRAINPOD_CHECKPOINT_DIR`` (the default ``--ckpt-dir``),
   ``TRAINPOD_JOB_ID`` and ``TRAINPOD_ATTEMPT`` (only logged).

Batches are a pure function of (seed, step, rank), so a run resumed from a checkpoint sees the
same data as an uninterrupted one. Rank 0 writes ``step-<8 digits>.pt`` atomically (temp file,
fsync, ``os.replace``) and keeps the newest three. On start, rank 0 picks the newest complete
checkpoint and broadcasts its step, and every rank loads that file (so with several nodes the
directory must be shared). SIGTERM keeps its default behaviour (exit at once); a half-written
temp file is named ``.step-*.pt.tmp`` and never matches ``step-*.pt``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import sysconfig
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # optional: progress beacons for hang detection and goodput when run under trainpod
    from trainpod import report
except ImportError:  # standalone or under plain torchrun without trainpod installed

    def report(step: int, **metrics: float | int | str | bool) -> None:
        pass


CORPUS_CAP_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.1
EVAL_BATCHES = 8
KEEP_CHECKPOINTS = 3
CKPT_RE = re.compile(r"^step-(\d{8})\.pt$")


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


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(m, n) for n in os.listdir(ckpt_dir) if (m := CKPT_RE.match(n))]
    return sorted((int(m.group(1)), os.path.join(ckpt_dir, n)) for m, n in found)


def save_checkpoint(ckpt_dir: str, step: int, state: dict[str, Any]) -> str:
    """Write atomically (temp file in the same dir, fsync, rename) and keep the newest few."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"step-{step:08d}.pt")
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".pt.tmp", dir=ckpt_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for _, old in list_checkpoints(ckpt_dir)[:-KEEP_CHECKPOINTS]:
        os.unlink(old)
    return path


def load_latest(ckpt_dir: str, device: torch.device, distributed: bool) -> dict[str, Any] | None:
    """Load the newest checkpoint, or None; rank 0 picks the step so that all ranks agree."""
    ckpts = list_checkpoints(ckpt_dir)
    step = torch.tensor([ckpts[-1][0] if ckpts else -1], dtype=torch.int64, device=device)
    if distributed:
        dist.broadcast(step, src=0)
    if step.item() < 0:
        return None
    path = os.path.join(ckpt_dir, f"step-{step.item():08d}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"rank 0 resumes from {path}, missing here: is {ckpt_dir} shared?")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    state["path"] = path
    return state


# ----------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak lr (short warmup + cosine)")
    p.add_argument("--ckpt-every", type=int, default=50, help="0 disables checkpoints")
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("TRAINPOD_CHECKPOINT_DIR") or "./checkpoints/gpt",
        help="default: $TRAINPOD_CHECKPOINT_DIR, else ./checkpoints/gpt",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=0, help="0: evaluate only at the end")
    p.add_argument(
        "--threads", type=int, default=None, help="default: 1 if several ranks share a machine"
    )
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
    if distributed:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    job = os.environ.get("TRAINPOD_JOB_ID")
    attempt = os.environ.get("TRAINPOD_ATTEMPT")
    log(
        f"gpt: world {world}, device {device}, threads {torch.get_num_threads()}, "
        f"ckpt dir {args.ckpt_dir}" + (f", job {job} attempt {attempt}" if job else "")
    )

    train_data, val_data = load_corpus()
    torch.manual_seed(args.seed)  # identical init on every rank (DDP also broadcasts it)
    model = GPT(args.n_layer, args.n_embd, args.n_head, args.seq_len).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    n_params = sum(p.numel() for p in params)
    log(f"model: {n_params / 1e6:.2f}M params, corpus {len(train_data) + len(val_data)} bytes")

    start, loss_val = 1, float("nan")
    ckpt = load_latest(args.ckpt_dir, device, distributed)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start, loss_val = ckpt["step"] + 1, float(ckpt.get("loss", float("nan")))
        log(f"resuming from {ckpt['path']} (step {ckpt['step']}); continuing at step {start}")
    del ckpt
    ddp: nn.Module = (
        DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
        if distributed
        else model
    )

    tokens_per_step = args.batch_size * args.seq_len * world
    t_start = t_log = time.perf_counter()
    steps_done = steps_since_log = 0
    for step in range(start, args.steps + 1):
        x, y = get_batch(
            train_data,
            args.batch_size,
            args.seq_len,
            make_generator("train", args.seed, step, rank),
        )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = ddp(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done += 1
        steps_since_log += 1
        report(step, tokens=args.batch_size * args.seq_len)  # a datagram; never blocks
        last = step == args.steps
        logged = last or step == start or bool(args.log_every and step % args.log_every == 0)
        if logged:
            loss_val = mean_over_ranks(loss.item(), device, distributed)
            now = time.perf_counter()
            tok_s = steps_since_log * tokens_per_step / max(now - t_log, 1e-9)
            log(f"step {step}/{args.steps} loss {loss_val:.4f} tok/s {tok_s:.0f} (world {world})")
            t_log, steps_since_log = now, 0
        if args.eval_every and step % args.eval_every == 0 and not last:
            val = mean_over_ranks(
                evaluate(model, val_data, args, rank, device), device, distributed
            )
            log(f"step {step}/{args.steps} val_loss {val:.4f}")
        if rank == 0 and args.ckpt_every and (last or step % args.ckpt_every == 0):
            state = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "loss": loss_val if logged else loss.item(),
                "args": vars(args),
            }
            t_save = time.perf_counter()
            log(f"saved {save_checkpoint(args.ckpt_dir, step, state)}")
            report(step, checkpoint_step=step, checkpoint_stall_s=time.perf_counter() - t_save)
    elapsed = time.perf_counter() - t_start
    tok_s = steps_done * tokens_per_step / elapsed if steps_done else 0.0

    val_loss = mean_over_ranks(evaluate(model, val_data, args, rank, device), device, distributed)
    final_step = max(args.steps, start - 1)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        summary = {
            "final_step": final_step,
            "steps_this_run": steps_done,
            "final_loss": loss_val,
            "val_loss": val_loss,
            "world_size": world,
            "tokens_per_s": tok_s,
            "wall_s": elapsed,
        }
        with open(os.path.join(args.ckpt_dir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
    log(f"done: steps={final_step} final_loss={loss_val:.4f} val_loss={val_loss:.4f}")
    if distributed:
        # Every rank leaves together: a rank that tears down Gloo while a peer is still
        # writing the summary can abort in the transport's destructor.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
