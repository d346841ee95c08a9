"""Write this rank's pid to a file, then wait for a release file (or fail on demand).

argv: DIR [FAIL_RANK [CODE]] [--ignore-term]. With FAIL_RANK, that rank prints a message
and exits with CODE once every rank has written its pid.
"""

import os
import signal
import sys
import time
from pathlib import Path

d = Path(sys.argv[1])
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
args = [a for a in sys.argv[2:] if not a.startswith("--")]
(d / f"pid-{rank}").write_text(str(os.getpid()))
print(f"rank {rank} holding", flush=True)
while True:
    if args and int(args[0]) == rank and len(list(d.glob("pid-*"))) == world:
        print(f"rank {rank}: something went wrong, exiting with {args[1]}", flush=True)
        sys.exit(int(args[1]))
    if (d / "release").exists():
        print(f"rank {rank} released", flush=True)
        sys.exit(0)
    time.sleep(0.02)
