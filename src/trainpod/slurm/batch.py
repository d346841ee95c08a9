"""The batch script trainpod submits with ``sbatch``: one trainpod agent per allocated node.

Slurm places the job (partition, priority, time, dependencies); inside the allocation
``srun`` starts one agent per node, and the agents join the controller exactly as local
agents do. The controller then launches the workers on the first ``nodes`` of them; the
rest (``--spares K``) are hot spares inside the allocation. The script is deterministic
for a given input, so ``trainpod submit --dry-run`` output can be golden-tested.

Slurm's own preemption (``PreemptMode=REQUEUE`` with ``GraceTime`` and
``SlurmctldParameters=preempt_send_user_signal``; 23.02+: ``PreemptParameters=send_user_signal``)
sends the job's ``--signal=B:SIG@LEAD`` to the batch shell when the job is chosen, then
SIGTERM and SIGKILL when the grace is over, and requeues it (``--requeue``). The script traps
the signal (bash would otherwise die of it) and writes the allocation's notice file
(``TRAINPOD_SLURM_NOTICE``, one per Slurm job and restart; whole or absent); every agent of
the allocation watches for it, gives its ranks trainpod's notice and reports it, so the
controller records a preemption rather than lost nodes. A file, not a signal forwarded to
the agents: the agents ignore the notice signal (their ranks inherit SIG_IGN, ADR 0013).
The same ``--signal`` goes out LEAD seconds before ``--time`` runs out; the agents ask Slurm
which it is and take only a preemption for one. Without ``preempt_send_user_signal`` Slurm
sends SIGTERM to the tasks (the agents) when it chooses the job: the agents take that as the
notice (see :mod:`trainpod.agent.slurmnotice`).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from trainpod.errors import SpecError

_LINE_BREAK = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class BatchRequest:
    """Everything the batch script says, in Slurm's terms."""

    cluster: str
    job_id: int
    nodes: int
    spares: int
    partition: str
    output: str
    """Slurm's ``--output`` path (``%j`` is the Slurm job id); appended to on requeue."""
    agent_argv: tuple[str, ...]
    """The agent command each ``srun`` task runs (``SLURMD_NODENAME`` names the node)."""
    env: tuple[tuple[str, str], ...] = ()
    time_limit: str | None = None
    nice: int | None = None
    dependency: str | None = None
    exclude: tuple[str, ...] = ()
    priority: int | None = None
    notice_signal: str | None = None
    """The signal Slurm sends the batch shell on preemption (``USR1``); None: none asked."""
    notice_lead_s: int = 30
    """``--signal``'s lead: also sent this long before ``--time`` runs out."""
    extra: tuple[str, ...] = field(default=())
    """Further ``sbatch`` options verbatim (``--account=x``), for sites that need them."""

    @property
    def job_name(self) -> str:
        return f"tp-{self.cluster}-{self.job_id}"

    def directives(self) -> list[str]:
        """The ``sbatch`` options, in a fixed order."""
        opts = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes + self.spares}",
            "--ntasks-per-node=1",
            # Whole nodes: a trainpod node is a machine, with one agent (two agents on one
            # node would fight over its beacon socket, GPUs and scratch).
            "--exclusive",
            f"--partition={self.partition}",
            # A node failure must not end the allocation: trainpod moves the ranks to a
            # spare, or requeues the job itself without the bad node.
            "--no-kill",
            "--requeue",
            "--open-mode=append",
            f"--output={self.output}",
        ]
        if self.notice_signal is not None:
            opts.append(f"--signal=B:{self.notice_signal}@{self.notice_lead_s}")
        if self.time_limit is not None:
            opts.append(f"--time={self.time_limit}")
        if self.nice is not None:
            opts.append(f"--nice={self.nice}")
        if self.priority is not None:
            opts.append(f"--priority={self.priority}")
        if self.dependency:
            opts.append(f"--dependency={self.dependency}")
        if self.exclude:
            opts.append(f"--exclude={','.join(self.exclude)}")
        opts.extend(self.extra)
        return opts


def render(req: BatchRequest) -> str:
    """The batch script for ``req`` (bash). Every value from a spec stays inert: ``#SBATCH``
    lines and the header comment must be one line each (a line break would start a shell
    line of its own), so a control character in one is refused; env keys must be names;
    env values and the agent's argv are shell-quoted."""
    for value in (req.cluster, *req.directives()):
        if bad := _LINE_BREAK.search(value):
            raise SpecError(
                f"the sbatch option {value!r} holds the control character {bad.group()!r}: "
                "it would break the batch script's line; remove it from the spec"
            )
    for key, _ in req.env:
        if not _ENV_KEY.fullmatch(key):
            raise SpecError(
                f"the batch script's variable {key!r} is not a name; use letters, digits and "
                "underscores, not starting with a digit"
            )
    lines = [
        "#!/bin/bash",
        f"# trainpod job {req.job_id} on cluster {req.cluster}: {req.nodes} node(s)"
        + (f" + {req.spares} hot spare(s)" if req.spares else "")
        + ".",
        "# One trainpod agent per allocated node; the trainpod controller launches the",
        "# workers and heals the job (rendered by trainpod; do not edit).",
        *(f"#SBATCH {opt}" for opt in req.directives()),
        "",
        "set -euo pipefail",
        *(f"export {k}={shlex.quote(v)}" for k, v in req.env),
        f"export TRAINPOD_ALLOCATION={req.job_id}",
        *_notice_trap(req),
        'echo "trainpod: allocation $SLURM_JOB_ID on $SLURM_JOB_NODELIST'
        ' (restart ${SLURM_RESTART_COUNT:-0})"',
        # One step per node, each --no-kill: a node that dies ends only its own step (Slurm
        # would otherwise end the whole step, and with it every agent). The job succeeded
        # when an agent was told so (exit 0 on the controller's "leave" order).
        "pids=()",
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        '  srun --nodes=1 --ntasks=1 --nodelist="$node" --no-kill --unbuffered \\',
        "    " + " ".join(shlex.quote(a) for a in req.agent_argv) + " &",
        '  pids+=("$!")',
        "done",
        # A trapped signal ends `wait` early (status > 128): wait again while it runs.
        "status=1",
        'for pid in "${pids[@]}"; do',
        "  while :; do",
        '    rc=0 && wait "$pid" || rc=$?',
        '    [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null || break',
        "  done",
        '  [ "$rc" -ne 0 ] || status=0',
        "done",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def notice_path(output: str) -> str:
    """The allocation's notice file (a bash word): next to the job's Slurm output, one per
    Slurm job id and restart, so a requeued job's agents never read the last round's."""
    folder = shlex.quote(os.path.dirname(output) or ".")
    return folder + '"/slurm-notice-${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"'


def _notice_trap(req: BatchRequest) -> list[str]:
    if req.notice_signal is None:
        return []
    return [
        f"export TRAINPOD_SLURM_NOTICE={notice_path(req.output)}",
        "# Slurm's preemption notice: tell the agents (a file; see trainpod.slurm.batch).",
        'trap \'echo "trainpod: Slurm preemption notice ($(date +%s))";'
        ' date +%s >"$TRAINPOD_SLURM_NOTICE.tmp"'
        ' && mv -f "$TRAINPOD_SLURM_NOTICE.tmp" "$TRAINPOD_SLURM_NOTICE"\' ' + req.notice_signal,
    ]
