"""The demo's closing lines say where to look: the dashboard, Prometheus, TensorBoard."""

from __future__ import annotations

from pathlib import Path

from trainpod.cli.demo import where_to_look
from trainpod.paths import ClusterRecord


def test_the_demo_ends_with_the_dashboard_the_metrics_and_the_tensorboard_command(
    tmp_path: Path,
) -> None:
    record = ClusterRecord(
        name="demo",
        backend="local",
        spec={},
        spec_path=str(tmp_path / "cluster.yaml"),
        host="127.0.0.1",
        port=8123,
        created_at=0.0,
        shared_dir=str(tmp_path / "shared"),
        scratch_root=str(tmp_path / "scratch"),
        checkpoint_uri=f"file://{tmp_path / 'shared' / 'checkpoints'}",
    )
    text = "\n".join(where_to_look(record, 4))
    assert "http://127.0.0.1:8123/ui" in text
    assert "http://127.0.0.1:8123/metrics" in text
    assert "trainpod tensorboard 4" in text
    assert str(tmp_path / "shared" / "tensorboard" / "job-4") in text
