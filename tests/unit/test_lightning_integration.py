"""trainpod.integrations.lightning in one process: the callback's save on a notice (a real
notice file, a real single-process Trainer), its beacons, and the choice of the newest
*verified* checkpoint (a torn newer file is passed over)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from trainpod.integrations.lightning import (
    TrainpodCallback,
    _batch_size,
    newest_verified,
    resume_path,
    run,
)
from trainpod.notice import ENV_FILE, ENV_SIGNAL, NoticeWatcher


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(tmp_path: Path, *callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            *callbacks[:-1],
            ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=2),
            callbacks[-1],
        ],
    )


def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)


def test_a_notice_saves_last_trainpod_ckpt_stops_training_and_is_the_resume_point(
    tmp_path: Path,
) -> None:
    sent: list[tuple[int, dict[str, Any]]] = []
    notice_file = tmp_path / "notice.json"
    watcher = NoticeWatcher({ENV_FILE: str(notice_file), ENV_SIGNAL: "SIGUSR2"})
    cb = TrainpodCallback(watcher=watcher, report=lambda step, **m: sent.append((step, m)))

    class NoticeAtStep3(pl.Callback):  # the agent writes the file; here, at the end of step 3
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == 2:
                notice_file.write_text("{}")

    t = trainer(tmp_path, NoticeAtStep3(), cb)
    try:
        t.fit(Tiny(), loader())
    finally:
        watcher.uninstall()
    saved = tmp_path / "ck" / "last-trainpod.ckpt"
    assert (cb.noticed_at, t.global_step, saved.exists()) == (3, 3, True)
    assert [s for s, _ in sent] == [1, 2, 3]
    assert all(m["loss"] >= 0 and m["samples_per_s"] > 0 for _, m in sent[1:])
    # ModelCheckpoint's saves at step 2 (Lightning runs checkpoint callbacks last, in order)
    assert [m.get("checkpoint_step") for _, m in sent] == [None, 2, None]
    assert resume_path(t) == saved  # newer than last.ckpt (step 2)
    assert torch.load(saved, weights_only=False)["global_step"] == 3


def test_the_newest_verified_checkpoint_passes_over_a_torn_one(tmp_path: Path) -> None:
    old, new = tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt"
    torch.save({"global_step": 1}, old)
    torch.save({"global_step": 2}, new)
    os.utime(old, (1, 1))
    assert newest_verified([old, new, tmp_path / "gone.ckpt"]) == new
    new.write_bytes(new.read_bytes()[:-30])  # torn: the zip's central directory is cut
    assert newest_verified([old, new]) == old
    old.write_text("not a checkpoint")
    assert newest_verified([old, new]) is None


def test_batch_sizes_count_tokens_from_input_ids_else_samples() -> None:
    assert _batch_size({"input_ids": torch.zeros(4, 16, dtype=torch.long)}) == (64, 4)
    assert _batch_size((torch.zeros(8, 3), torch.zeros(8))) == (None, 8)
    assert _batch_size("text") == (None, None)


def test_the_runner_names_a_missing_script_and_its_usage(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no script .*nope\.py.*usage: python -m trainpod"):
        run([str(tmp_path / "nope.py")])
    with pytest.raises(SystemExit, match="usage"):
        run([])


STANDALONE = """
import sys
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
trainer = pl.Trainer(
    max_steps=int(sys.argv[1]), accelerator="cpu", devices=1, logger=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[2],
    callbacks=[ModelCheckpoint(dirpath=sys.argv[2] + "/ck", save_last=True, every_n_train_steps=2)],
)
trainer.fit(Tiny(), data)
names = sorted(type(c).__name__ for c in trainer.callbacks)
print("callbacks", names, "step", trainer.global_step)
"""


@pytest.mark.timeout(300)  # two interpreters that import lightning: slow on a loaded box
def test_a_standalone_pytorch_lightning_script_runs_and_resumes_under_the_runner(
    tmp_path: Path,
) -> None:
    """``import pytorch_lightning`` (the standalone package) under the runner gets
    ``lightning.pytorch``: the callback is added to its Trainer, and a second run resumes
    from the first one's ``last.ckpt``."""
    script = tmp_path / "standalone.py"
    script.write_text(STANDALONE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "SLURM_"))}
    runner = [sys.executable, "-m", "trainpod.integrations.lightning", str(script)]

    def run_for(steps: int) -> str:
        proc = subprocess.run(
            [*runner, str(steps), str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    first = run_for(4)
    assert "trainpod: pytorch_lightning is run as lightning.pytorch" in first
    assert "TrainpodCallback" in first and "step 4" in first, first
    assert "trainpod: resuming" not in first
    second = run_for(6)
    assert f"trainpod: resuming from {tmp_path / 'ck' / 'last.ckpt'}" in second, second
    assert "step 6" in second
