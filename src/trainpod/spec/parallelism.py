"""A job's Megatron-style parallel layout: tensor (TP), pipeline (PP) and data (DP) sizes.

``parallelism: {tensor: 2, pipeline: 1}`` in a job spec (``trainpod submit --tensor-parallel
2``) is a hint trainpod checks and hands to the ranks; the script builds its own process
groups from it, as Megatron-LM's ``initialize_model_parallel`` does. ADR 0038.

Ranks are numbered as Megatron numbers them (its default order ``tp-dp-pp``: tensor-parallel
rank fastest, then data-parallel, then pipeline stage)::

    rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

and trainpod places ranks node by node (``rank = node_index * procs_per_node +
local_rank``), so a TP group is ``TP`` consecutive ranks and stays on one node when ``TP``
divides the processes per node: its all-reduces, one per layer in each direction, never
cross the network. DP is what is left: ``world / (TP * PP)``.

A leaf of the spec layer: pydantic only.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

ENV_TP = "TRAINPOD_TP"
ENV_PP = "TRAINPOD_PP"
ENV_DP = "TRAINPOD_DP"
ENV_ARGS = "TRAINPOD_PARALLEL_ARGS"
"""Megatron-LM's own flags for the layout, for a launch script: ``python pretrain_gpt.py
$TRAINPOD_PARALLEL_ARGS ...``."""


class Parallelism(BaseModel):
    """The sizes a job asks for; DP follows from the world size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor: int = Field(default=1, ge=1, le=256, description="tensor-parallel size (TP)")
    pipeline: int = Field(default=1, ge=1, le=1024, description="pipeline-parallel size (PP)")


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the layout."""

    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """A checked layout of ``world`` ranks, ``procs_per_node`` a node."""

    tp: int
    pp: int
    dp: int
    procs_per_node: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        """The (tp, dp, pp) ranks of global ``rank``, Megatron's ``tp-dp-pp`` order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world} ranks")
        tp, dp = self.tp, self.dp
        return Coords(tp=rank % tp, dp=rank // tp % dp, pp=rank // (tp * dp))

    def tp_group(self, rank: int) -> list[int]:
        """The ranks ``rank`` shares a tensor-parallel group with (itself included)."""
        first = rank - rank % self.tp
        return list(range(first, first + self.tp))

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node

    def env(self) -> dict[str, str]:
        """The variables every rank gets: the sizes, and Megatron's flags for them."""
        flags = [
            "--tensor-model-parallel-size",
            str(self.tp),
            "--pipeline-model-parallel-size",
            str(self.pp),
        ]
        return {
            ENV_TP: str(self.tp),
            ENV_PP: str(self.pp),
            ENV_DP: str(self.dp),
            ENV_ARGS: shlex.join(flags),
        }


def layout(parallelism: Parallelism, *, nodes: int, procs_per_node: int) -> Layout:
    """The layout of ``nodes`` x ``procs_per_node`` ranks, or a ValueError naming the numbers
    and what to change."""
    tp, pp = parallelism.tensor, parallelism.pipeline
    world = nodes * procs_per_node
    if procs_per_node % tp:
        fits = [d for d in range(1, procs_per_node + 1) if procs_per_node % d == 0]
        raise ValueError(
            f"tensor parallel size {tp} does not divide the {procs_per_node} processes per "
            f"node, so a TP group would span nodes (its all-reduces run every layer); use "
            f"--tensor-parallel one of {', '.join(map(str, fits))}, or --procs-per-node a "
            f"multiple of {tp}"
        )
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} ({nodes} nodes x {procs_per_node} processes) is not "
            f"divisible by tensor x pipeline = {tp} x {pp} = {tp * pp}; data parallel size "
            f"is world / (TP x PP): use a node count that makes {nodes} x {procs_per_node} "
            f"a multiple of {tp * pp}, or a smaller --pipeline-parallel"
        )
    return Layout(tp=tp, pp=pp, dp=world // (tp * pp), procs_per_node=procs_per_node)


def check_shape(
    parallelism: Parallelism, *, nodes: int, min_nodes: int | None, procs_per_node: int
) -> None:
    """Every size a job may run at, ``min_nodes`` to ``nodes``, must take the layout (a job
    that shrinks keeps TP and PP and loses data-parallel replicas); ValueError if not."""
    for n in range(min_nodes or nodes, nodes + 1):
        try:
            layout(parallelism, nodes=n, procs_per_node=procs_per_node)
        except ValueError as exc:
            shrunk = f" (--min-nodes {min_nodes} lets the job shrink to {n} nodes)"
            raise ValueError(f"{exc}{shrunk if n != nodes else ''}") from None
