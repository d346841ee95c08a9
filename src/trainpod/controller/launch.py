"""Turning an attempt into per-node launch orders with torchrun's environment contract."""

from __future__ import annotations

from pathlib import Path

from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.controller.config import ControllerConfig
from trainpod.elastic import protocol as elastic_protocol
from trainpod.spec.job import JobSpec
from trainpod.spec.parallelism import layout
from trainpod.telemetry.tensorboard import ENV as TENSORBOARD_ENV
from trainpod.telemetry.tensorboard import tensorboard_dir

MAX_LOG_CHUNK = 256 * 1024


def attempt_log_dir(cfg: ControllerConfig, job_id: int, attempt_number: int) -> Path:
    return cfg.jobs_dir / str(job_id) / f"attempt-{attempt_number}"


def rank_log_path(cfg: ControllerConfig, job_id: int, attempt_number: int, rank: int) -> Path:
    return attempt_log_dir(cfg, job_id, attempt_number) / f"rank-{rank}.log"


def read_log_chunk(path: Path, offset: int) -> tuple[str, int]:
    """Up to a chunk of ``path`` from ``offset``: the text and the offset after it."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            raw = f.read(MAX_LOG_CHUNK)
    except FileNotFoundError:
        return "", offset
    if len(raw) == MAX_LOG_CHUNK:
        # Stop before a UTF-8 sequence cut in half; the next read starts at its first byte.
        cut = len(raw)
        while cut > 0 and len(raw) - cut < 4 and (raw[cut - 1] & 0xC0) == 0x80:
            cut -= 1
        if cut > 0 and raw[cut - 1] >= 0xC0:
            raw = raw[: cut - 1]
    return raw.decode("utf-8", errors="replace"), offset + len(raw)


def node_env(
    cfg: ControllerConfig,
    *,
    job_id: int,
    spec: JobSpec,
    attempt_number: int,
    nodes: list[str],
    node_index: int,
    procs_per_node: int,
    master_addr: str,
    master_port: int,
    restart_reason: str = "",
) -> dict[str, str]:
    """The environment common to every rank on one node (RANK and LOCAL_RANK are per rank).

    The job's own ``env`` comes first, so the contract variables always win.
    """
    nnodes = len(nodes)
    ckpt_uri, ckpt_dir = cfg.checkpoint_for(job_id)
    env = dict(spec.env)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does when it starts several ranks
    env.update(
        {
            "WORLD_SIZE": str(nnodes * procs_per_node),
            "LOCAL_WORLD_SIZE": str(procs_per_node),
            "GROUP_RANK": str(node_index),
            "NODE_RANK": str(node_index),
            "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nnodes * procs_per_node),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": f"{cfg.cluster}-job-{job_id}",
            "TORCHELASTIC_RESTART_COUNT": str(attempt_number - 1),
            "TORCHELASTIC_MAX_RESTARTS": str(
                spec.max_restarts if spec.max_restarts is not None else cfg.max_restarts
            ),
            # The node leader's agent hosts the store at MASTER_ADDR:MASTER_PORT, as
            # torchrun's does: every rank is a client, any may exit first (ADR 0028). An
            # allocation's hold has no ranks to meet; its steps' rank 0 hosts theirs.
            "TORCHELASTIC_USE_AGENT_STORE": str(not spec.interactive),
            "TRAINPOD_CLUSTER": cfg.cluster,
            # A cluster deleted and created again under its name is another cluster: its
            # job 1 must not find the old job 1's files in /dev/shm.
            "TRAINPOD_CLUSTER_ID": cfg.extra.get("cluster_id", cfg.cluster),
            "TRAINPOD_JOB_ID": str(job_id),
            "TRAINPOD_JOB_NAME": spec.display_name(),
            "TRAINPOD_ATTEMPT": str(attempt_number),
            "TRAINPOD_RESTART_REASON": restart_reason,
            "TRAINPOD_NNODES": str(nnodes),
            "TRAINPOD_NODES": ",".join(nodes),
            "TRAINPOD_SHARED_DIR": str(cfg.shared_dir),
            "TRAINPOD_CHECKPOINT_URI": ckpt_uri,
            # trainpod's scalars and the script's own SummaryWriter output (ADR 0021)
            TENSORBOARD_ENV: str(tensorboard_dir(cfg.shared_dir, job_id)),
        }
    )
    if ckpt_dir is not None:
        env["TRAINPOD_CHECKPOINT_DIR"] = ckpt_dir
    if spec.parallelism is not None:  # TP/PP as asked, DP from this attempt's size (ADR 0038)
        env.update(layout(spec.parallelism, nodes=nnodes, procs_per_node=procs_per_node).env())
    if spec.recovery == "in-process":  # the agent adds where its recover file is (ADR 0026)
        env[elastic_protocol.ENV_RECOVERY] = elastic_protocol.IN_PROCESS
    return env


def launch_order(
    cfg: ControllerConfig,
    *,
    job_id: int,
    attempt_id: int,
    spec: JobSpec,
    attempt_number: int,
    nodes: list[str],
    node_index: int,
    procs_per_node: int,
    master_addr: str,
    master_port: int,
    restart_reason: str = "",
) -> LaunchOrder:
    env = node_env(
        cfg,
        job_id=job_id,
        spec=spec,
        attempt_number=attempt_number,
        nodes=nodes,
        node_index=node_index,
        procs_per_node=procs_per_node,
        master_addr=master_addr,
        master_port=master_port,
        restart_reason=restart_reason,
    )
    env["TRAINPOD_ATTEMPT_ID"] = str(attempt_id)  # the progress beacon's address
    first = node_index * procs_per_node
    return LaunchOrder(
        attempt_id=attempt_id,
        job_id=job_id,
        attempt_number=attempt_number,
        argv=list(spec.command),
        workdir=spec.workdir or str(cfg.shared_dir),
        env=env,
        ranks=[RankSlot(rank=first + i, local_rank=i) for i in range(procs_per_node)],
        log_dir=str(attempt_log_dir(cfg, job_id, attempt_number)),
        account=spec.account,
        preload=list(spec.preload),
    )
