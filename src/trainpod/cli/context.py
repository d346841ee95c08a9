"""Finding the cluster a command is about, and a client for its controller.

Precedence: ``--cluster`` > ``$TRAINPOD_CLUSTER`` > the cluster made current by the last
``cluster create`` > the only cluster there is.
"""

from __future__ import annotations

import os

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


def client_for(name: str | None) -> TrainpodClient:
    paths = resolve_cluster(name)
    record = ClusterRecord.load(paths)
    return TrainpodClient(record.url, read_secret(paths.admin_token))
