"""``trainpod tensorboard JOB``: a TensorBoard on the job's logdir, until Ctrl-C.

The logdir is ``<shared dir>/tensorboard/job-<id>/`` (ADR 0021): trainpod's ``trainpod`` and
``trainpod-goodput`` runs and whatever the script wrote with its own ``SummaryWriter`` into
``$TRAINPOD_TENSORBOARD_DIR``. The program is the ``tensorboard`` of the installed package,
bound to one address (127.0.0.1 unless ``--host`` says otherwise; never ``--bind_all``), on a
free port unless ``--port`` names one, with the Python loader (``--load_fast=false``): it
applies the ``SessionLog.START`` purge that hides the steps a resumed attempt redid.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx
import typer

from trainpod.cli.context import client_for
from trainpod.cli.render import console
from trainpod.controller.ports import free_port
from trainpod.errors import Fatal
from trainpod.telemetry.tensorboard import tensorboard_dir

CLUSTER_OPT = typer.Option(None, "--cluster", help="cluster name (default: the current one)")
START_TIMEOUT_S = 120.0


def tensorboard_program() -> str:
    """The ``tensorboard`` script beside this Python (its venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "tensorboard"
    found = str(beside) if beside.exists() else shutil.which("tensorboard")
    if not found:
        raise Fatal(
            "the `tensorboard` program is not installed: `pip install tensorboard` into the "
            f"environment of {sys.executable}"
        )
    return found


def tensorboard_argv(logdir: Path, host: str, port: int) -> list[str]:
    return [
        tensorboard_program(),
        "--logdir",
        str(logdir),
        "--host",
        host,
        "--port",
        str(port),
        "--load_fast=false",
        "--reload_interval",
        "2",
    ]


def tensorboard(
    job_id: int = typer.Argument(..., help="the job whose TensorBoard to start"),
    host: str = typer.Option("127.0.0.1", "--host", help="the one address to listen on"),
    port: int = typer.Option(0, "--port", help="port to listen on (0: a free one)"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """Start a TensorBoard on a job's logdir and print its URL; Ctrl-C stops it."""
    with client_for(cluster) as client:
        job = client.job(job_id)  # NotFound names the job
        shared = Path(client.cluster().shared_dir)
    logdir = tensorboard_dir(shared, job.id)
    if not logdir.is_dir():  # TensorBoard shows it once it appears
        console.print(
            f"no TensorBoard data for job {job.id} at {logdir} yet: it appears with the job's "
            "first step (the cluster's shared dir must be mounted where this command runs)"
        )
    port = port or free_port(host)
    url = f"http://{host}:{port}/"
    # TensorBoard logs to stderr all along: a file, not a pipe nobody drains once it runs.
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  # closed below
    proc = subprocess.Popen(
        tensorboard_argv(logdir, host, port), stdout=subprocess.DEVNULL, stderr=log, text=True
    )
    try:
        _wait_ready(proc, url, log)
        console.print(f"TensorBoard for job {job.id} ({logdir}):\n  {url}\nCtrl-C stops it.")
        sys.stdout.flush()
        proc.wait()
        raise Fatal(f"tensorboard exited with status {proc.returncode}")
    except KeyboardInterrupt:
        console.print("stopping TensorBoard")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _wait_ready(proc: subprocess.Popen[str], url: str, log: IO[str]) -> None:
    """Until ``url`` answers; a tensorboard that exits first is an error with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise Fatal(f"TensorBoard did not answer at {url} within {START_TIMEOUT_S:g}s")
        time.sleep(0.2)
    log.seek(0)
    tail = "".join(log.read().splitlines(True)[-20:])
    raise Fatal(f"tensorboard exited with status {proc.returncode}:\n{tail}")
