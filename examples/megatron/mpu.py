"""Megatron-LM's model-parallel pieces, in plain torch: process groups, TP layers, P2P.

What Megatron's ``megatron.core.parallel_state`` and ``tensor_parallel`` do, small enough to
read: ``initialize_model_parallel`` numbers the ranks ``tp-dp-pp`` (tensor-parallel rank
fastest), ``ColumnParallelLinear`` splits a weight's output rows across the TP group (its
input's gradient all-reduced on the way back), ``RowParallelLinear`` splits its input columns
(its output all-reduced on the way forward). Here they run **on CPU over Gloo**, where
Megatron runs on GPUs over NCCL; the arithmetic is the same.

The process groups come from a ``DeviceMesh`` of shape (PP, DP, TP): the same groups
Megatron builds, and what lets a TP shard be saved as a ``DTensor`` that
``torch.distributed.checkpoint`` writes once (not once per DP replica) with its offset in the
full tensor, so a checkpoint can be read back at another TP size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

TP_SHARD_DIM = "tp_shard_dim"
"""Attribute on a parameter split across the TP group: the dimension it is split along."""


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the layout and its groups (``parallel_state`` in Megatron)."""

    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    mesh: DeviceMesh

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_peer(self, offset: int) -> int:
        """The global rank with the same TP and DP ranks ``offset`` stages on."""
        return self.rank + offset * self.tp * self.dp


def initialize_model_parallel(tp: int, pp: int) -> ParallelState:
    """Build the TP, DP and PP groups over the initialised default group (collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * pp):
        raise SystemExit(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; data parallel size is world / (TP x PP)"
        )
    dp = world // (tp * pp)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local % tp:
        raise SystemExit(
            f"--tensor-model-parallel-size {tp} does not divide the {local} processes per "
            "node: a TP group would span nodes; use a TP size that divides them"
        )
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelState(
        rank=rank,
        world=world,
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=rank % tp,
        dp_rank=rank // tp % dp,
        pp_rank=rank // (tp * dp),
        mesh=mesh,
    )


# ----------------------------------------------------------------------------- TP regions


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _shard(full: Tensor, dim: int, ps: ParallelState) -> nn.Parameter:
    """This TP rank's slice of ``full`` (initialised whole on every rank, as Megatron's
    ``--use-cpu-initialization`` does, so the model is the same at any TP size)."""
    part = full.chunk(ps.tp, dim=dim)[ps.tp_rank].clone()
    p = nn.Parameter(part)
    setattr(p, TP_SHARD_DIM, dim)
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's output rows split across the TP group (no gather)."""

    def __init__(self, full_weight: Tensor, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.weight = _shard(full_weight, 0, ps)
        self.bias = _shard(torch.zeros(full_weight.shape[0]), 0, ps)

    def forward(self, x: Tensor) -> Tensor:
        if self.ps.tp > 1:
            x = _CopyToTP.apply(x, self.ps.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's input columns split; the partial outputs all-reduced, then
    the (replicated) bias added once."""

    def __init__(self, full_weight: Tensor, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.weight = _shard(full_weight, 1, ps)
        self.bias = nn.Parameter(torch.zeros(full_weight.shape[0]))

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.ps.tp > 1:
            y = _ReduceFromTP.apply(y, self.ps.tp_group)
        return y + self.bias


# ----------------------------------------------------------------------------- gradients


def allreduce_dp_grads(params: list[nn.Parameter], ps: ParallelState) -> None:
    """Average the gradients over the DP group, in one flat buffer (Megatron's DDP buckets)."""
    if ps.dp == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ps.dp_group)
    flat /= ps.dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, ps: ParallelState) -> float:
    """Clip by the norm of the whole model's gradient: TP shards summed over the TP group,
    replicated parameters counted once, stages summed over the PP group."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None and (hasattr(p, TP_SHARD_DIM) or ps.tp_rank == 0):
            sq += p.grad.double().pow(2).sum()
    if ps.tp > 1:
        dist.all_reduce(sq, group=ps.tp_group)
    if ps.pp > 1:
        dist.all_reduce(sq, group=ps.pp_group)
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


# ----------------------------------------------------------------------------- checkpoints


def sharded(t: Tensor, p: nn.Parameter, ps: ParallelState) -> Tensor:
    """``t`` (``p``'s value or optimizer state) as DCP should see it: a ``DTensor`` on the TP
    mesh where ``p`` is a TP shard (its offset in the full tensor recorded), else as is (the
    same tensor on every rank that holds it; DCP writes one copy)."""
    dim = getattr(p, TP_SHARD_DIM, None)
    if dim is None or ps.tp == 1:
        return t
    return DTensor.from_local(t, ps.mesh["tp"], [Shard(dim)], run_check=False)


def local(t: Any) -> Tensor:
    """A state-dict value back as this rank's plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t
