"""The agent process: ``python -m trainpod.agent.main --state-dir DIR --node NAME``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from trainpod.agent.accounts import Grants
from trainpod.agent.agent import Agent
from trainpod.agent.beacons import BeaconServer
from trainpod.agent.chaos import DIE_IN_HANDOFF_ENV, ChaosExecutor, die_in_handoff
from trainpod.agent.checks import build_checks
from trainpod.agent.devices import DeviceTelemetry, device_reader
from trainpod.agent.facts import device_facts, node_facts
from trainpod.agent.jobsockets import AccountSockets
from trainpod.agent.launcher import Launcher, inheritance
from trainpod.agent.lifecycle import LifecycleRunner, Script
from trainpod.agent.monitor import DeepChecker, HealthMonitor, deep_runner
from trainpod.agent.persisters import CheckpointHub
from trainpod.agent.ranks import Notice, ignore_notice_signal
from trainpod.agent.slurmnotice import ENV as SLURM_NOTICE_ENV
from trainpod.agent.slurmnotice import SlurmNoticeWatch, ask_slurm
from trainpod.agent.tensorboard import TensorBoardTap
from trainpod.agent.warmpool import WarmPool, job_zygotes
from trainpod.agent.warmstart import AGENT_WARM_LATER, WarmStarter, zygote_env
from trainpod.client.http import TrainpodClient
from trainpod.errors import NotFound
from trainpod.notice import ENV_SIGNAL, parse_signal
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.loading import load_recorded_spec

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainpod-agent")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--node", help="default: $SLURMD_NODENAME (inside a Slurm job)")
    parser.add_argument("--gpus", default="", help="comma-separated GPU indices of this node")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--allocation", type=int, help="Slurm: the trainpod job it serves")
    parser.add_argument("--group", help="Slurm: the instance group this node belongs to")
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="also write the log to DIR/agent-NODE.log (appended; Slurm: the job's dir, so "
        "that the last lines are on disk when the allocation ends, whatever srun relays)",
    )
    args = parser.parse_args(argv)
    slurm = slurm_allocation(args)
    slurm_notice_file = os.environ.pop(SLURM_NOTICE_ENV, None)  # the batch script's trap
    args.node = args.node or os.environ.get("SLURMD_NODENAME")
    if not args.node:
        parser.error("--node is required outside a Slurm job ($SLURMD_NODENAME is not set)")
    if not _NODE_NAME.fullmatch(args.node):
        parser.error(
            f"node name {args.node!r}: use letters, digits, '.', '_' and '-' (it names the "
            "node's directory and log file)"
        )
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(args.log_dir / f"agent-{args.node}.log"))
    logging.basicConfig(
        level=os.environ.get("TRAINPOD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{args.node}] %(name)s: %(message)s",
        handlers=handlers,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat is noise
    state_dir: Path = args.state_dir.absolute()
    paths = ClusterPaths(state_dir.parent.parent, state_dir.name)
    record = ClusterRecord.load(paths)
    spec = load_recorded_spec(record)
    groups = dict(spec.node_names())
    if args.group is not None:
        by_name = spec.groups_by_name()
        if args.group not in by_name:
            raise NotFound(f"group {args.group!r} is not in cluster {spec.name}")
        groups[args.node] = by_name[args.group]
    if args.node not in groups:
        raise NotFound(f"node {args.node!r} is not in cluster {spec.name}")
    group = groups[args.node]
    node_dir = paths.node_dir(args.node)
    scratch = Path(record.scratch_root) / args.node
    scratch.mkdir(parents=True, exist_ok=True)
    Path(record.shared_dir).mkdir(parents=True, exist_ok=True)
    gpus = [g for g in args.gpus.split(",") if g]
    if slurm is not None:
        slurm.update(group=group.name, devices=group.devices_per_node)
    devices = device_facts(group.devices_per_node, gpus)

    identity = {
        "TRAINPOD_CLUSTER": spec.name,
        "TRAINPOD_NODE": args.node,
        "TRAINPOD_GROUP": group.name,
        "TRAINPOD_ROLE": group.role,
        "TRAINPOD_SHARED_DIR": record.shared_dir,
        "TRAINPOD_SCRATCH_DIR": str(scratch),
    }
    node_env = dict(identity)
    # Preemption notices: ranks (and the zygote that forks some) inherit SIG_IGN for the
    # notice signal, so only a script that asks for notices handles it (trainpod.preempted).
    notice_signal = parse_signal(spec.preemption.signal)
    ignore_notice_signal(notice_signal)
    node_env[ENV_SIGNAL] = notice_signal.name
    if gpus:
        node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        # CPU devices stand in for GPUs here: say so to every worker.
        node_env["TRAINPOD_SIMULATED_DEVICES"] = str(group.devices_per_node)

    agent: Agent | None = None

    def on_change() -> None:
        if agent is not None:
            agent.notify()

    lifecycle = LifecycleRunner(
        [Script(s.script, s.timeout_s, tuple(s.args)) for s in group.lifecycle],
        log_dir=node_dir / "lifecycle",
        marker=node_dir / "lifecycle.ok",
        env=identity,
        on_change=on_change,
    )

    def facts() -> dict[str, Any]:
        # "env": what every rank here gets from this node (its scratch dir, its devices as
        # CUDA_VISIBLE_DEVICES or the simulated count, the sockets); `trainpod shell` and
        # `trainpod run` give the same to a shell or a step (controller/allocations.py).
        return {**node_facts(scratch, devices), "env": dict(node_env)}

    client = TrainpodClient.for_record(record, read_secret(paths.agent_token))
    paths.runtime_dir.mkdir(mode=0o700, exist_ok=True)
    beacon_path = paths.runtime_dir / f"{args.node}.sock"
    tensorboard = TensorBoardTap()
    grants = Grants()  # what the ranks of each POSIX account may speak for (accounts.py)
    server = BeaconServer(beacon_path, tap=tensorboard.offer, grants=grants)
    node_env["TRAINPOD_BEACON_SOCKET"] = str(beacon_path)
    # Checkpoints: workers hand committed shared-memory steps to this agent, whose persister
    # processes copy them to scratch, peer and durable (they outlive a crashed worker).
    hub = CheckpointHub(
        paths.runtime_dir / f"{args.node}.ckpt.sock",
        log_dir=node_dir / "persist",
        state_file=node_dir / "checkpoints.json",
        on_change=on_change,
        grants=grants,
        scratch_root=scratch,  # an ended job's copies there go once durable holds them
        # The interpreter of the persisters; an account's runs as it, so it must be one that
        # account may execute (the agent's own may sit in root's home).
        python=os.environ.get("TRAINPOD_PERSIST_PYTHON") or sys.executable,
        # A test seam (off unless the variable is set): die in the middle of a hand-off.
        on_forwarded=die_in_handoff(
            os.environ.get(DIE_IN_HANDOFF_ENV), lambda: launcher.kill_everything()
        ),
    )
    accounts = AccountSockets(
        paths.runtime_dir, args.node, beacons=server, checkpoints=hub, grants=grants
    )
    node_env["TRAINPOD_CKPT_SOCKET"] = str(hub.path)
    # Warm starts: a zygote that has imported torch forks ranks (it warms up in the
    # background; until then ranks start cold). TRAINPOD_WARM_START=0 turns it off.
    warm = None
    inherited = inheritance(os.environ, spec.env_allow)  # nothing else of ours (ADR 0032)
    if os.environ.get("TRAINPOD_WARM_START", "1") != "0":
        agents = WarmStarter(
            socket_path=paths.runtime_dir / f"{args.node}.zygote.sock",
            log_path=node_dir / "zygote.log",
            env={**zygote_env(os.environ, inherited), **node_env},
            later=AGENT_WARM_LATER,
        )
        agents.start()
        warm = WarmPool(agents, job_zygotes(agents, paths.runtime_dir, node_dir, args.node))
    launcher = Launcher(
        node_env=node_env,
        on_change=on_change,
        inherited=inherited,
        warm=warm,
        accounts=accounts,
    )
    gpu_state = None if gpus else node_dir / "simgpu.json"
    quota = spec.storage.node_scratch_quota_gib
    checks = build_checks(
        devices=group.devices_per_node,
        gpus=gpus,
        gpu_state=gpu_state,
        scratch=scratch,
        shared=Path(record.shared_dir),
        quota_gib=quota,
        min_free_gib=spec.storage.min_free_gib,
        max_temperature_c=spec.health.max_temperature_c,
        controller=(record.advertise or record.host, record.port),
        reference=lambda: agent.controller_time() if agent else None,
    )
    slurm_notice = None
    if slurm is not None:  # the batch trap's file, or SIGTERM where Slurm sends no signal
        slurm_notice = SlurmNoticeWatch(
            Path(slurm_notice_file) if slurm_notice_file else None,
            Notice(notice_signal, spec.preemption.grace_s, "preempted by Slurm"),
            launcher,
            teardown_grace_s=spec.recovery.teardown_grace_s,
            on_notice=on_change,
            ask=ask_slurm(str(slurm["external_id"])),
        )
    # Device telemetry for every heartbeat: NVML on GPUs, SIMULATED figures on CPU slots.
    reader = device_reader(group.devices_per_node, gpus, gpu_state)
    telemetry = DeviceTelemetry(reader) if reader is not None else None
    monitor = HealthMonitor(checks, interval_s=spec.health.check_interval_s, on_change=on_change)
    agent = Agent(
        node=args.node,
        address=args.address,
        client=client,
        lifecycle=lifecycle,
        node_env=node_env,
        facts=facts,
        launcher=launcher,
        heartbeat_interval_s=spec.health.heartbeat_interval_s,
        teardown_grace_s=spec.recovery.teardown_grace_s,
        beacons=server.book,
        health=monitor,
        deep=DeepChecker(
            deep_runner(group.devices_per_node, scratch, gpu_state),
            on_change=on_change,
            on_pass=monitor.reset,
        ),
        chaos=ChaosExecutor(
            launcher=launcher, gpu_state=gpu_state, scratch=scratch, scratch_quota_gib=quota
        ),
        allocation=slurm,
        checkpoints=hub,
        slurm_notice=slurm_notice,
        tensorboard=tensorboard,
        telemetry=telemetry,
    )

    def stop(signum: int, _frame: FrameType | None) -> None:
        assert agent is not None
        if signum == signal.SIGTERM and slurm_notice and slurm_notice.takes_sigterm():
            # Slurm's SIGTERM may be its preemption notice (no user signal configured).
            logging.getLogger(__name__).info("SIGTERM: asking Slurm whether it preempts")
            slurm_notice.sigterm(agent.stopping.set)
            return
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.current_thread().name = f"agent-{args.node}"
    try:
        agent.run()
    finally:
        server.close()
        tensorboard.close()
        hub.close()
    if agent.exit_code:
        raise SystemExit(agent.exit_code)


# Where a process runs and for which job (for tools that look), but nothing from which a
# framework would derive ranks (SLURM_NTASKS, SLURM_PROCID, ...).
_SLURM_KEPT = {"SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_CONF"}


def slurm_allocation(args: argparse.Namespace) -> dict[str, Any] | None:
    """Inside a Slurm allocation: what the heartbeat says about it. Slurm's own variables
    are then dropped, so workers see only the torchrun contract (a framework that finds
    SLURM_NTASKS would otherwise take its ranks from Slurm instead of from trainpod)."""
    if args.allocation is None:
        return None
    round_ = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    for key in [k for k in os.environ if k.startswith("SLURM") and k not in _SLURM_KEPT]:
        del os.environ[key]
    os.environ["TRAINPOD_SLURM_JOB_ID"] = slurm_job
    return {"allocation": args.allocation, "allocation_round": round_, "external_id": slurm_job}


if __name__ == "__main__":
    main()
