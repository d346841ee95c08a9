"""What an agent's heartbeat says about its node's state: a pure function."""

from __future__ import annotations

from trainpod.api.models import Heartbeat, LifecycleResult
from trainpod.controller.transitions import HELD_NODE_STATES
from trainpod.model.states import NodeState
from trainpod.store.rows import NodeRow


def lifecycle_failure(results: list[LifecycleResult]) -> str:
    """A one-paragraph reason naming the failed script, how it failed, and its log tail."""
    for r in results:
        if r.state in ("failed", "timeout"):
            how = (
                f"timed out after {r.duration_s:.1f}s"
                if r.state == "timeout"
                else f"exited with code {r.exit_code}"
            )
            tail = "\n".join(r.tail.strip().splitlines()[-5:])
            return f"lifecycle script {r.script} {how} (log: {r.log_path})\n{tail}".rstrip()
    return "lifecycle failed"


def node_state_after_heartbeat(node: NodeRow, hb: Heartbeat) -> tuple[NodeState | None, str]:
    """The state the node should be in given this heartbeat, and why; None = leave it."""
    if node.state in HELD_NODE_STATES:
        return None, ""
    if hb.leaving:
        return NodeState.STOPPED, "agent stopped"
    lc = hb.lifecycle
    if lc.state == "running":
        return NodeState.SETTING_UP, "running lifecycle scripts"
    if lc.state == "failed":
        return NodeState.FAILED, lifecycle_failure(lc.results)
    if node.job_id is not None:
        return NodeState.ALLOCATED, ""
    return NodeState.IDLE, ""
