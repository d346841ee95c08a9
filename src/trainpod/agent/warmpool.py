"""The agent's zygotes: its own (torch preloaded), and one per job that asks ``--preload``.

A job's ``preload`` (``trainpod submit --preload transformers,datasets``) names modules its
ranks import that take seconds (transformers ~3 s, lightning ~2 s): the agent starts a
zygote for the job that imports them once, beside torch, and every later start of the job's
ranks on this node (a restart after a fault, an in-process replacement) forks from it, with
the modules already imported. The first start cannot wait for it and starts cold (or from
the agent's zygote): the job's zygote warms up meanwhile.

A job's zygote runs in the job's working directory with the job's environment (a module
that reads, say, ``HF_HOME`` at import sees the job's value) and as the agent's account: a
job that runs as its owner's account (``account``) has no preload zygote, since the modules
it names would run in the agent's account; its ranks start cold, as every account's do.
Zygotes of ended jobs are closed (:meth:`WarmPool.retain`, with the controller's list of
active jobs); at most ``max_jobs`` run at once (the oldest goes first).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

from trainpod.agent.warmstart import DEFAULT_PRELOAD, WarmProcess, WarmStarter
from trainpod.api.models import LaunchOrder

log = logging.getLogger(__name__)

MAX_JOB_ZYGOTES = 4
"""Job zygotes an agent runs at once (each holds an interpreter with torch: ~300 MB)."""

MakeStarter = Callable[[str, list[str], str, Mapping[str, str]], WarmStarter]
"""(name, modules, cwd, env) -> a zygote, not started."""


class WarmPool:
    """Chooses the zygote a rank starts from: the job's own when it has one and it is ready,
    else the agent's."""

    def __init__(
        self,
        default: WarmStarter | None,
        make: MakeStarter | None,
        *,
        max_jobs: int = MAX_JOB_ZYGOTES,
    ) -> None:
        """``make``: builds a job's zygote (None: no job zygotes, only ``default``)."""
        self.default = default
        self._make = make
        self.max_jobs = max_jobs
        self._jobs: OrderedDict[int, WarmStarter] = OrderedDict()
        self._lock = threading.Lock()
        self._refused: set[int] = set()  # jobs whose zygote could not be made

    def spawn(
        self, order: LaunchOrder, *, env: Mapping[str, str], log_path: Path
    ) -> WarmProcess | str:
        """A rank of ``order`` forked by a zygote, or why it must start cold. Never raises."""
        with self._lock:
            job = self._for_job(order)
        if job is not None and job.ready:
            return job.spawn(order.argv, cwd=order.workdir, env=env, log_path=log_path)
        if self.default is None:
            return "warm starts are off (TRAINPOD_WARM_START=0)"
        got = self.default.spawn(order.argv, cwd=order.workdir, env=env, log_path=log_path)
        if job is not None and isinstance(got, str):
            return f"{got}; the job's --preload server is still importing"
        return got

    def _for_job(self, order: LaunchOrder) -> WarmStarter | None:
        """The job's zygote (started on first sight), or None if it has or can have none."""
        if not order.preload or self._make is None:
            return None
        if order.account is not None:
            if order.job_id not in self._jobs:
                log.info(
                    "job %d: --preload is not served for ranks that run as account %s "
                    "(the modules would be imported in the agent's account); they start cold",
                    order.job_id,
                    order.account,
                )
            return None
        starter = self._jobs.get(order.job_id)
        if starter is None and order.job_id not in self._refused:
            modules = list(dict.fromkeys([*DEFAULT_PRELOAD, *order.preload]))
            try:
                starter = self._make(f"job-{order.job_id}", modules, order.workdir, order.env)
            except ValueError as exc:  # its socket's path is too long for a Unix socket
                log.warning("job %d: no --preload server: %s", order.job_id, exc)
                self._refused.add(order.job_id)
                return None
            starter.start()
            self._jobs[order.job_id] = starter
            log.info("job %d: a warm-start server importing %s", order.job_id, ",".join(modules))
            while len(self._jobs) > self.max_jobs:
                old, gone = self._jobs.popitem(last=False)
                log.info("job %d: its warm-start server closed (%d at most)", old, self.max_jobs)
                _close_soon(gone)
        return starter

    def retain(self, active: set[int]) -> None:
        """Close the zygotes of jobs no longer active (in the background: returns at once)."""
        with self._lock:
            ended = [j for j in self._jobs if j not in active]
            gone = [self._jobs.pop(j) for j in ended]
            self._refused &= active
        for job_id, starter in zip(ended, gone, strict=True):
            log.info("job %d has ended: its warm-start server closed", job_id)
            _close_soon(starter)

    def jobs(self) -> list[int]:
        """The jobs that have a zygote now."""
        with self._lock:
            return list(self._jobs)

    def close(self) -> None:
        with self._lock:
            starters = list(self._jobs.values())
            self._jobs.clear()
        for starter in starters:
            starter.close()
        if self.default is not None:
            self.default.close()


def job_zygotes(agents: WarmStarter, runtime_dir: Path, log_dir: Path, node: str) -> MakeStarter:
    """How this agent makes a job's zygote: the agent's zygote's environment with the job's
    over it (its PYTHONPATH before the agent's, which finds trainpod), in the job's working
    directory, its socket beside the agent's and its log in the node's dir."""

    def make(name: str, modules: list[str], cwd: str, env: Mapping[str, str]) -> WarmStarter:
        path = os.pathsep.join(
            p for p in (env.get("PYTHONPATH"), agents.env.get("PYTHONPATH")) if p
        )
        return WarmStarter(
            socket_path=runtime_dir / f"{node}.{name}.zygote.sock",
            log_path=log_dir / f"zygote-{name}.log",
            env={**agents.env, **env, **({"PYTHONPATH": path} if path else {})},
            preload=modules,
            later=agents.later,
            cwd=Path(cwd),
        )

    return make


def _close_soon(starter: WarmStarter) -> None:
    """Close a zygote without holding up the caller (the agent's heartbeat)."""
    threading.Thread(target=starter.close, name="zygote-close", daemon=True).start()
