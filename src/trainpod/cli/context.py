"""Finding the cluster a command is about, and a client for its controller.

Precedence: ``--cluster`` > ``$TRAINPOD_CLUSTER`` > the cluster made current by the last
``cluster create`` > the only cluster there is.

The token a command calls with: ``$TRAINPOD_TOKEN`` > the one ``trainpod login`` saved
(``$TRAINPOD_HOME/tokens/<cluster>.token``, 0600) > the cluster's admin token (readable by
the cluster's creator only).
"""

from __future__ import annotations

import os
from pathlib import Path

from trainpod.client.http import TrainpodClient
from trainpod.errors import NotFound
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret, trainpod_home


def cluster_names() -> list[str]:
    root = trainpod_home() / "clusters"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "cluster.json").exists())


def set_current(name: str) -> None:
    home = trainpod_home()
    home.mkdir(parents=True, exist_ok=True)
    (home / "current").write_text(name)


def resolve_cluster(name: str | None) -> ClusterPaths:
    name = name or os.environ.get("TRAINPOD_CLUSTER") or None
    names = cluster_names()
    if name is None:
        current = trainpod_home() / "current"
        if current.exists() and current.read_text().strip() in names:
            name = current.read_text().strip()
        elif len(names) == 1:
            name = names[0]
        elif not names:
            raise NotFound(
                f"there is no cluster under {trainpod_home()}; create one with "
                "`trainpod cluster create -f examples/cluster.yaml`"
            )
        else:
            raise NotFound(
                f"several clusters exist ({', '.join(names)}); choose one with --cluster NAME "
                "or TRAINPOD_CLUSTER=NAME"
            )
    return ClusterPaths.of(name)


def token_file(cluster: str) -> Path:
    """Where ``trainpod login`` keeps a user's token for ``cluster``."""
    return trainpod_home() / "tokens" / f"{cluster}.token"


def save_token(cluster: str, token: str) -> Path:
    """Write ``token`` for ``cluster``, readable by its owner only (0600, dir 0700)."""
    path = token_file(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


def token_for(paths: ClusterPaths) -> str:
    env = os.environ.get("TRAINPOD_TOKEN", "").strip()
    if env:
        return env
    saved = token_file(paths.name)
    if saved.exists():
        return saved.read_text().strip()
    try:
        return read_secret(paths.admin_token)
    except OSError as exc:
        raise NotFound(
            f"no token for cluster {paths.name}: set TRAINPOD_TOKEN or run "
            f"`trainpod login --cluster {paths.name}` with the token an admin gave you "
            f"(`trainpod users add NAME`)"
        ) from exc


def client_for(name: str | None) -> TrainpodClient:
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    return TrainpodClient.for_record(record, token_for(paths))
