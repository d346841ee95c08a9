"""A private Slurm with preemption, for the scheduling benchmark (``benchmarks/scheduling.py``).

``scripts/slurm-ci`` writes a fixed ``slurm.conf`` (partitions ``debug`` and ``high``, no
preemption) and has no option for one, so this starts its own Slurm in the same style
(the same settings as slurm-ci's, from /work/shared/notes/slurm.md, one node per line,
private munged, everything under one directory) with these differences:

* ``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``: one partition per
  priority class over the same nodes, ``PriorityTier`` high 3 > normal 2 > low 1; a job of a
  higher tier preempts (requeues) lower-tier jobs; ``high`` itself is ``PreemptMode=OFF``
  (trainpod's ``high`` class is not preemptible). Without slurmdbd there is no QOS, so the
  classes are partitions (slurm.md: the QOS and fair-share factors need slurmdbd).
* ``GraceTime`` on the preemptible partitions: 0 (Slurm's default) or the trainpod
  cluster's grace (the "trainpod kind of notice": signal, grace, then kill).
* ``priority/multifactor`` with ``PriorityWeightPartition`` (the class) and
  ``PriorityWeightAge``: Slurm 22.05 ignores the age weight without slurmdbd (it says so in
  its log), so within a class jobs run in submit order, as trainpod's age order does.
* nodes of 1 CPU (one device each, as trainpod's nodes), so a job holds whole nodes.
* ``cred_expire=5``, the least Slurm accepts: a requeued job waits cred_expire+1 = 6 s
  before it may start again (slurm.md, gotcha 1); trainpod requeues at once.

Stopping kills exactly what was started: the daemons by their pids, and the job processes
and slurmstepds that carry this cluster's ``SLURM_CONF`` or marker in their environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainpod.testing.wait import wait_until

MARKER = "TRAINPOD_BENCH_SLURM"
CLASSES = (("low", 1), ("normal", 2), ("high", 3))

CONF = """\
# Written by benchmarks/schedulingslurm.py: slurm-ci's settings plus preemption.
ClusterName=benchsched
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket,cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/log/jobcomp.log
PriorityType=priority/multifactor
PriorityWeightPartition=1000
PriorityWeightAge=100
PriorityWeightJobSize=0
PriorityWeightQOS=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
ReturnToService=2
SlurmdTimeout=5
SlurmctldTimeout=10
MessageTimeout=3
InactiveLimit=0
KillWait=2
MinJobAge=600
Waittime=0
SlurmdParameters=config_overrides
"""


@dataclass(frozen=True)
class SlurmCluster:
    dir: Path
    nodes: int
    grace_s: int

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout_s: float = 30) -> str:
        out = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout_s
        )
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr}")
        return out.stdout


def _free_ports(count: int) -> list[int]:
    """Free TCP ports below the ephemeral range (srun and slurmstepd draw from that)."""
    ports: list[int] = []
    port = 24000 + os.getpid() % 4000
    while len(ports) < count:
        port = port + 1 if port < 31999 else 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def write_conf(cluster: SlurmCluster, ports: list[int]) -> None:
    text = CONF.format(dir=cluster.dir, ctld_port=ports[0])
    names = f"node[1-{cluster.nodes}]"
    for i, port in enumerate(ports[1:], start=1):
        text += (
            f"NodeName=node{i} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            "CPUs=1 RealMemory=1000 State=UNKNOWN\n"
        )
    for name, tier in CLASSES:
        mode = "OFF" if name == "high" else "REQUEUE"
        grace = 0 if name == "high" else cluster.grace_s
        default = "YES" if name == "normal" else "NO"
        text += (
            f"PartitionName={name} Nodes={names} Default={default} MaxTime=INFINITE State=UP "
            f"PriorityTier={tier} PriorityJobFactor={tier} PreemptMode={mode} "
            f"GraceTime={grace}\n"
        )
    cluster.conf.write_text(text)


def _daemon(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip


def _cluster_processes(cluster: SlurmCluster) -> list[psutil.Process]:
    """Job processes, slurmstepds and client commands of this cluster (by environment)."""
    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(MARKER) == str(cluster.dir) or env.get("SLURM_CONF") == str(cluster.conf):
            found.append(p)
    return found


def _stop(procs: list[subprocess.Popen[bytes]], cluster: SlurmCluster) -> None:
    for p in _cluster_processes(cluster):
        if p.pid not in {d.pid for d in procs}:
            try:
                p.kill()
            except psutil.Error:
                pass
    for d in procs:
        if d.poll() is None:
            d.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for d in procs:
        try:
            d.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait(timeout=5)
    for p in _cluster_processes(cluster):  # a slurmstepd may have forked meanwhile
        try:
            p.kill()
        except psutil.Error:
            pass


@contextmanager
def private_slurm(root: Path, nodes: int, grace_s: int) -> Iterator[SlurmCluster]:
    """A fresh Slurm of ``nodes`` 1-CPU nodes under ``root`` (kept afterwards: its logs)."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "squeue"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise RuntimeError(
                f"{tool} is not installed: run `scripts/slurm-ci up` once (it installs "
                "Slurm with apt-get), or `--sides trainpod`"
            )
    if os.geteuid() != 0:
        raise RuntimeError("the Slurm side needs root (slurmd runs jobs as their user)")
    cluster = SlurmCluster(root, nodes, grace_s)
    if len(str(root)) > 60:
        raise RuntimeError(f"Slurm's state dir must be at most 60 characters, got {root}")
    for sub in ("state", "spool", "run", "log", "munge"):
        shutil.rmtree(root / sub, ignore_errors=True)
        (root / sub).mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o755)
    ports = _free_ports(nodes + 1)
    write_conf(cluster, ports)
    env = {**cluster.env(), MARKER: str(root)}
    path = env.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
    env["PATH"] = path
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    procs: list[subprocess.Popen[bytes]] = []
    sock = root / "munge" / "munge.socket"
    try:
        procs.append(
            _daemon(
                [
                    "munged", "--foreground", "--force", f"--socket={sock}",
                    f"--key-file={key}", f"--pid-file={root}/munge/munged.pid",
                    f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/seed",
                ],
                root / "log" / "munged.out", env,
            )
        )  # fmt: skip
        wait_until(lambda: sock.exists(), timeout_s=20, what="munged's socket")
        procs.append(
            _daemon(
                ["slurmctld", "-D", "-f", str(cluster.conf)], root / "log" / "slurmctld.out", env
            )
        )
        for i in range(1, nodes + 1):
            (root / "spool" / f"node{i}").mkdir(exist_ok=True)
            procs.append(
                _daemon(
                    ["slurmd", "-D", "-N", f"node{i}", "-f", str(cluster.conf)],
                    root / "log" / f"slurmd-node{i}.out", env,
                )
            )  # fmt: skip

        def idle() -> bool:
            for d in procs:
                if d.poll() is not None:
                    raise RuntimeError(f"{d.args!r} exited ({d.returncode}); see {root}/log/")
            try:
                out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", timeout_s=10)
            except (RuntimeError, subprocess.TimeoutExpired):
                return False
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return len(states) == nodes and all(s == "idle" for s in states.values())

        wait_until(idle, timeout_s=60, what=f"{nodes} Slurm nodes idle")
        yield cluster
    finally:
        _stop(procs, cluster)
