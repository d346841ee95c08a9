"""The last step of `cluster stop`/`delete`: whatever still carries the cluster's marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainpod.backends.procs import MARKER_ENV, leftovers, sweep


def _orphan(marker: str, tmp_path: Path, *, ignore_term: bool = False) -> int:
    """A grandchild in a session of its own whose parent is gone: nobody's pid file has it."""
    body = "import signal, time\n"
    if ignore_term:
        body += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    body += "time.sleep(120)\n"
    script = tmp_path / "orphan.py"
    script.write_text(body)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, sys.argv[1]],"
            " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
            " print(p.pid)",
            str(script),
        ],
        env={**os.environ, MARKER_ENV: marker},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_sweep_stops_an_orphan_of_this_cluster_and_spares_another_clusters(
    tmp_path: Path,
) -> None:
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    mine = _orphan(ours, tmp_path, ignore_term=True)  # needs the SIGKILL after the grace
    other = _orphan(theirs, tmp_path)
    try:
        assert [p.pid for p in leftovers(ours)] == [mine]
        assert sweep(ours, grace_s=0.5) == [mine]
        assert leftovers(ours) == []
        assert [p.pid for p in leftovers(theirs)] == [other]
    finally:
        sweep(ours, grace_s=0.5)
        sweep(theirs, grace_s=0.5)
