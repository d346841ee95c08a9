"""A Megatron-style GPT pretraining script: tensor, pipeline and data parallelism.

In the shape of Megatron-LM's ``pretrain_gpt.py`` and launched the same way::

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 1 --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 \\
        --global-batch-size 16 --train-iters 20 --lr 1e-3 --mock-data \\
        --save ckpt --load ckpt --save-interval 5

and, unchanged, under trainpod, which sets torchrun's environment and, with ``--tensor-parallel
2`` on ``trainpod submit``, ``TRAINPOD_TP``/``TRAINPOD_PP`` (the defaults of the two size
flags here) after checking that a TP group fits in a node (README, ADR 0038).

Megatron-LM itself needs CUDA and apex; this runs **on CPU over Gloo** where Megatron uses
NCCL on GPUs, with the same layout: ranks numbered tp-dp-pp, QKV and MLP-in column-parallel,
attention-out and MLP-out row-parallel (``mpu.py``), gradients averaged over the DP group,
``--pipeline-model-parallel-size 2`` splits the layers into two stages run with a GPipe
schedule (all forward micro-batches, then all backward) over point-to-point sends. Word and
position embeddings and the output layer are replicated across the TP group and not tied
(Megatron splits the vocabulary and ties them; a 256-token vocabulary gains nothing from it).

Checkpoints (``checkpointing.py``) are Megatron's ``--ckpt-format torch_dist``: ``--save``
holds ``iter_0000005/`` (a ``torch.distributed.checkpoint`` directory; TP shards saved as
DTensors, each written once with its offset in the full tensor) and
``latest_checkpointed_iteration.txt``, which rank 0 rewrites only after every rank's shards
are written: a kill mid-save leaves the previous checkpoint the latest. ``--load`` resumes
from the iteration that file names (model, AdamW moments and step counts); ``--save`` must
be on a filesystem every node sees, as for Megatron. The data (``--mock-data``) is a pure
function of (seed, global sample number), so a resumed run computes what an uninterrupted
one does, and every layout computes the same batches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
from types import FrameType

import mpu
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkpointing import load_checkpoint, save_checkpoint
from torch import Tensor, nn

# ----------------------------------------------------------------------------- model


class ParallelAttention(nn.Module):
    """Causal self-attention, heads split across the TP group. The fused QKV weight is in
    Megatron's layout (per head: its q, k and v rows together), so a contiguous TP slice of
    it is whole heads."""

    def __init__(self, h: int, heads: int, gen: torch.Generator, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.heads, self.head_dim = heads // ps.tp, h // heads
        self.qkv = mpu.ColumnParallelLinear(torch.randn(3 * h, h, generator=gen) * 0.02, ps)
        self.proj = mpu.RowParallelLinear(torch.randn(h, h, generator=gen) * 0.02, ps)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, h: int, gen: torch.Generator, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.fc1 = mpu.ColumnParallelLinear(torch.randn(4 * h, h, generator=gen) * 0.02, ps)
        self.fc2 = mpu.RowParallelLinear(torch.randn(h, 4 * h, generator=gen) * 0.02, ps)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, h: int, heads: int, gen: torch.Generator, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(h), ParallelAttention(h, heads, gen, ps)
        self.ln2, self.mlp = nn.LayerNorm(h), ParallelMLP(h, gen, ps)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """This pipeline stage's share of the GPT: the embeddings on the first, the loss on the
    last. Every rank draws the whole model's weights from ``--seed`` in one order and keeps
    its own, so the model is the same at any TP and PP size. Layers keep their global index
    (``layers.3``) so that checkpoint keys do not depend on the stage."""

    def __init__(self, args: argparse.Namespace, ps: mpu.ParallelState) -> None:
        super().__init__()
        h, n = args.hidden_size, args.num_layers
        gen = torch.Generator().manual_seed(args.seed)
        wte = torch.randn(args.vocab_size, h, generator=gen) * 0.02
        wpe = torch.randn(args.seq_length, h, generator=gen) * 0.02
        per_stage = n // ps.pp
        mine = range(ps.pp_rank * per_stage, (ps.pp_rank + 1) * per_stage)
        layers = {}
        for i in range(n):
            layer = TransformerLayer(h, args.num_attention_heads, gen, ps)
            if i in mine:
                layers[str(i)] = layer
        head = torch.randn(args.vocab_size, h, generator=gen) * 0.02
        self.layers = nn.ModuleDict(layers)
        self.pre, self.post = ps.first_stage, ps.last_stage
        if self.pre:
            self.wte, self.wpe = nn.Embedding(args.vocab_size, h), nn.Embedding(args.seq_length, h)
            self.wte.weight.data.copy_(wte)
            self.wpe.weight.data.copy_(wpe)
        if self.post:
            self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, args.vocab_size, bias=False)
            self.head.weight.data.copy_(head)

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        if self.pre:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for layer in self.layers.values():
            x = layer(x)
        if not self.post:
            return x
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- data


def mock_batch(
    args: argparse.Namespace, it: int, ps: mpu.ParallelState, mb: int
) -> tuple[Tensor, Tensor]:
    """``--mock-data``: sequences of a fixed random bigram chain (learnable). Sample ``s`` of
    the run is a pure function of (seed, s); DP rank ``d`` takes its share of each global
    batch, as Megatron's sampler does, so the batch, and the loss, is the same at any DP
    size."""
    table = torch.Generator().manual_seed(args.seed + 1)
    succ = torch.randint(args.vocab_size, (args.vocab_size, 4), generator=table)
    share = args.global_batch_size // ps.dp
    first = (it - 1) * args.global_batch_size + ps.dp_rank * share + mb * args.micro_batch_size
    t = args.seq_length + 1
    rows = []
    for s in range(first, first + args.micro_batch_size):
        key = hashlib.sha256(f"{args.seed}:{s}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        tok = [int(torch.randint(args.vocab_size, (1,), generator=gen))]
        for c in torch.randint(4, (t - 1,), generator=gen).tolist():
            tok.append(int(succ[tok[-1], c]))
        rows.append(tok)
    batch = torch.tensor(rows)
    return batch[:, :-1], batch[:, 1:]


# ----------------------------------------------------------------------------- schedule


def train_step(model: GPTStage, args: argparse.Namespace, it: int, ps: mpu.ParallelState) -> Tensor:
    """Forward and backward of one global batch (GPipe over the stages); the DP-rank's mean
    loss on the last stage, zero elsewhere."""
    micro = args.global_batch_size // (args.micro_batch_size * ps.dp)
    h = args.hidden_size
    shape = (args.micro_batch_size, args.seq_length, h)
    kept: list[tuple[Tensor | None, Tensor]] = []
    total = torch.zeros(())
    for m in range(micro):
        x, y = mock_batch(args, it, ps, m)
        inp: Tensor | None = None
        if not ps.first_stage:
            inp = torch.empty(shape)
            dist.recv(inp, src=ps.stage_peer(-1))
            inp.requires_grad_()
        out = model(x if inp is None else inp, y)
        if ps.last_stage:
            out = out / micro
            total += out.detach()
        else:
            dist.send(out.detach().contiguous(), dst=ps.stage_peer(1))
        kept.append((inp, out))
    for inp, out in reversed(kept):
        if ps.last_stage:
            out.backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, src=ps.stage_peer(1))
            out.backward(grad)
        if inp is not None:
            assert inp.grad is not None
            dist.send(inp.grad.contiguous(), dst=ps.stage_peer(-1))
    return total


def global_loss(loss: Tensor, ps: mpu.ParallelState) -> float:
    """The batch's loss (mean over DP), on every rank: the last stage's ranks hold it."""
    t = loss.double().reshape(1).clone()
    dist.all_reduce(t)
    return float(t.item()) / (ps.tp * ps.dp)


def lr_at(it: int, args: argparse.Namespace) -> float:
    """Linear warmup over ``--lr-warmup-iters``, then cosine decay to ``--min-lr``."""
    if it <= args.lr_warmup_iters:
        return args.lr * it / max(1, args.lr_warmup_iters)
    frac = (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


# ----------------------------------------------------------------------------- main


class ExitSignalHandler:
    """``--exit-signal-handler``: note the signal; every iteration the ranks agree whether any
    got it, and if so save and exit, all at the same iteration (Megatron's
    ``DistributedSignalHandler``). Megatron waits for SIGTERM; under trainpod it waits for
    the preemption notice (``$TRAINPOD_NOTICE_SIGNAL``, SIGUSR1 by default), which comes a
    grace period before the teardown's SIGTERM."""

    def __init__(self) -> None:
        self.signum = signal.Signals[os.environ.get("TRAINPOD_NOTICE_SIGNAL", "SIGTERM")]
        self.received = False
        signal.signal(self.signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def any_rank(self) -> bool:
        flag = torch.tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def size_flag(env: str) -> int:
    """A parallel size's default: trainpod's hint (``TRAINPOD_TP``/``TRAINPOD_PP``), else 1."""
    return int(os.environ.get(env, "1"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=size_flag("TRAINPOD_TP"))
    g.add_argument("--pipeline-model-parallel-size", type=int, default=size_flag("TRAINPOD_PP"))
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=256)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=2)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--mock-data", action="store_true", help="synthetic data (the only kind)")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--iter-delay-s", type=float, default=0.0, help="simulated compute per iter")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="where iter_NNNNNNN/ checkpoints go")
    g.add_argument("--load", default=None, help="resume from its latest checkpoint")
    g.add_argument("--save-interval", type=int, default=0, help="iterations between saves")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist"])
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM (under trainpod: the preemption notice signal), save and exit",
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, ps: mpu.ParallelState) -> None:
    for env, flag, value in (
        ("TRAINPOD_TP", "--tensor-model-parallel-size", ps.tp),
        ("TRAINPOD_PP", "--pipeline-model-parallel-size", ps.pp),
    ):
        hint = os.environ.get(env)
        if hint is not None and int(hint) != value:
            raise SystemExit(
                f"{flag} {value} but the job's parallelism hint says {env}={hint}: drop the "
                f"flag or submit with the same size"
            )
    if args.num_attention_heads % ps.tp or args.hidden_size % args.num_attention_heads:
        raise SystemExit(
            f"--num-attention-heads {args.num_attention_heads} must divide --hidden-size "
            f"{args.hidden_size} and be divisible by TP {ps.tp}"
        )
    if args.num_layers % ps.pp:
        raise SystemExit(f"--num-layers {args.num_layers} is not divisible by PP {ps.pp}")
    if args.global_batch_size % (args.micro_batch_size * ps.dp):
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x DP {ps.dp}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")  # Megatron: nccl on GPUs; here CPU
    ps = mpu.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    )
    check_args(args, ps)
    coords = [None] * ps.world
    node = (os.environ.get("GROUP_RANK", "0"), os.uname().nodename)  # torchrun's node rank
    dist.all_gather_object(coords, (node, ps.tp_rank, ps.dp_rank, ps.pp_rank))
    model = GPTStage(args, ps)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    if ps.rank == 0:
        print(
            f"> megatron-style GPT on CPU over Gloo (Megatron-LM would use NCCL on GPUs): "
            f"world {ps.world} = TP {ps.tp} x PP {ps.pp} x DP {ps.dp}"
        )
        for r, ((node_rank, host), t, d, s) in enumerate(coords):
            print(f">   rank {r}: tp {t} dp {d} pp {s} on node {node_rank} ({host})")
    exit_handler = ExitSignalHandler() if args.exit_signal_handler else None
    start = load_checkpoint(model, opt, args, ps)
    loss = float("nan")
    for it in range(start + 1, args.train_iters + 1):
        t0 = time.perf_counter()
        lr = lr_at(it, args)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        local_loss = train_step(model, args, it, ps)
        mpu.allreduce_dp_grads(params, ps)
        norm = mpu.clip_grad_norm(params, args.clip_grad, ps)
        opt.step()
        if args.iter_delay_s:
            time.sleep(args.iter_delay_s)
        if it % args.log_interval == 0 or it == args.train_iters:
            loss = global_loss(local_loss, ps)
            if ps.rank == 0:
                ms = (time.perf_counter() - t0) * 1000
                print(
                    f" iteration {it:8d}/{args.train_iters:8d} | elapsed time per iteration "
                    f"(ms): {ms:.1f} | learning rate: {lr:.3E} | lm loss: {loss!r} | "
                    f"grad norm: {norm:.3f}",
                    flush=True,
                )
        saved = bool(args.save and args.save_interval and it % args.save_interval == 0)
        if saved:
            save_checkpoint(it, model, opt, args, ps)
        if exit_handler is not None and exit_handler.any_rank():
            if args.save and not saved:
                save_checkpoint(it, model, opt, args, ps)
            if ps.rank == 0:
                print(f"exiting program after receiving {exit_handler.signum.name}", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)
    if ps.rank == 0:
        print("final " + json.dumps({"iteration": args.train_iters, "lm_loss": loss}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
