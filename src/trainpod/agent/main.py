"""The agent process: ``python -m trainpod.agent.main --state-dir DIR --node NAME``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from trainpod.agent.agent import Agent
from trainpod.agent.facts import device_facts, node_facts
from trainpod.agent.lifecycle import LifecycleRunner, Script
from trainpod.client.http import TrainpodClient
from trainpod.controller.daemon import load_recorded_spec
from trainpod.errors import NotFound
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainpod-agent")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpus", default="", help="comma-separated GPU indices of this node")
    parser.add_argument("--address", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRAINPOD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{args.node}] %(name)s: %(message)s",
    )
    state_dir: Path = args.state_dir.absolute()
    paths = ClusterPaths(state_dir.parent.parent, state_dir.name)
    record = ClusterRecord.load(paths)
    spec = load_recorded_spec(record)
    groups = dict(spec.node_names())
    if args.node not in groups:
        raise NotFound(f"node {args.node!r} is not in cluster {spec.name}")
    group = groups[args.node]
    node_dir = paths.node_dir(args.node)
    scratch = Path(record.scratch_root) / args.node
    scratch.mkdir(parents=True, exist_ok=True)
    Path(record.shared_dir).mkdir(parents=True, exist_ok=True)
    gpus = [g for g in args.gpus.split(",") if g]
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
        return node_facts(scratch, devices)

    client = TrainpodClient(record.url, read_secret(paths.agent_token))
    agent = Agent(
        node=args.node,
        address=args.address,
        client=client,
        lifecycle=lifecycle,
        node_env=node_env,
        facts=facts,
        heartbeat_interval_s=spec.health.heartbeat_interval_s,
        teardown_grace_s=spec.recovery.teardown_grace_s,
    )

    def stop(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        assert agent is not None
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.current_thread().name = f"agent-{args.node}"
    agent.run()


if __name__ == "__main__":
    main()
