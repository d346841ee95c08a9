"""trainpod for PyTorch Lightning (``lightning.pytorch``): beacons, notices, resume, TensorBoard.

Two ways in (ADR 0029):

* **Unmodified scripts**: ``python -m trainpod.integrations.lightning train.py ARGS...`` runs
  the script as ``python train.py ARGS...`` would, with :class:`TrainpodCallback` added to
  every ``Trainer`` it builds and, when the script calls ``fit`` without a ``ckpt_path``, the
  newest *verified* ``last*.ckpt`` of its own ``ModelCheckpoint`` callbacks handed to ``fit``
  as ``ckpt_path`` (none on a first run). ``-m package.module`` works in place of a path.
  A script written for the standalone ``pytorch_lightning`` package runs too: under the
  runner that name imports ``lightning.pytorch`` (:class:`_StandaloneAlias`).
* **One line in a script**: ``Trainer(callbacks=[..., TrainpodCallback()])``. The callback is
  an ``OnExceptionCheckpoint``, so Lightning's own rule makes ``fit(ckpt_path=None)`` mean
  ``ckpt_path="last"`` (the newest ``last*.ckpt`` of the script's ``ModelCheckpoint``).

The callback, on every rank:

* sends a progress beacon (:mod:`trainpod.beacon`) after each training batch: the step, the
  loss, and ``tokens`` when the batch carries ``input_ids`` (trainpod turns it into tokens/s),
  else ``samples_per_s``; ``checkpoint_step`` after each checkpoint Lightning writes;
* asks :func:`trainpod.notice.watcher` after each batch, with every rank agreeing, whether a
  preemption notice came; if so it saves ``last-trainpod.ckpt`` beside ``last.ckpt`` through
  ``trainer.save_checkpoint`` (Lightning's own save: checkpoint IO plugin, atomic write) and
  sets ``trainer.should_stop``, so ``fit`` returns at that step and the rank can exit;
* on rank 0, writes ``callback_metrics`` to ``$TRAINPOD_TENSORBOARD_DIR/lightning`` (the job's
  TensorBoard dir, ADR 0021), purging the steps a resumed attempt runs again.

Outside trainpod the callback does nothing but checkpoint on a notice it will never get.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
except ImportError as exc:  # pragma: no cover - the frameworks extra installs it
    raise ImportError(
        f"trainpod.integrations.lightning needs PyTorch Lightning ({exc}); install it with "
        "`pip install 'trainpod[frameworks]'` or `pip install 'lightning>=2.2'`"
    ) from exc

from trainpod import beacon, notice
from trainpod.telemetry.tensorboard import ENV as TENSORBOARD_ENV

__all__ = ["NOTICE_NAME", "TrainpodCallback", "newest_verified", "resume_path", "run", "verified"]

NOTICE_NAME = "last-trainpod"
"""The notice save's file name (no extension): it starts with ``last``, so Lightning's
``ckpt_path="last"`` rule and :func:`resume_path` both count it among the last checkpoints."""
TENSORBOARD_RUN = "lightning"


def verified(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` file: a zip whose central directory (written
    last) is there and names the pickle. Cheap: reads the directory, not the tensors."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def newest_verified(paths: Iterable[Path]) -> Path | None:
    """The newest (by mtime) of ``paths`` that exists and is :func:`verified`, else None."""
    dated = []
    for p in set(paths):
        try:
            dated.append((p.stat().st_mtime_ns, str(p), p))
        except OSError:
            continue
    for _, _, p in sorted(dated, reverse=True):
        if verified(p):
            return p
    return None


def resume_path(trainer: pl.Trainer) -> Path | None:
    """The newest verified last checkpoint of ``trainer``'s ``ModelCheckpoint`` callbacks
    (``last.ckpt``, ``last-v1.ckpt``, ``last-trainpod.ckpt``...), or None."""
    found: list[Path] = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            found += [Path(p) for p in cb._find_last_checkpoints(trainer)]
    return newest_verified(found)


class TrainpodCallback(OnExceptionCheckpoint):
    """Beacons, a save on trainpod's notice, and TensorBoard in the job's dir (module doc).

    ``dirpath``: where the notice save goes; default: the trainer's first ``ModelCheckpoint``
    directory (so that its ``last`` rule finds the save), else ``default_root_dir``.
    ``watcher``: the notice flag (default: the process's, :func:`trainpod.notice.watcher`).
    ``tensorboard_dir``: default ``$TRAINPOD_TENSORBOARD_DIR``; None outside trainpod.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        *,
        watcher: notice.NoticeWatcher | None = None,
        tensorboard_dir: str | Path | None = None,
        report: Callable[..., None] = beacon.report,
    ) -> None:
        super().__init__(dirpath=str(dirpath or "."), filename=NOTICE_NAME)
        self._dirpath_given = dirpath is not None
        self._watcher = watcher or notice.watcher()
        tb = tensorboard_dir or os.environ.get(TENSORBOARD_ENV)
        self._tb_dir = Path(tb) / TENSORBOARD_RUN if tb else None
        self._report = report
        self._writer: Any = None
        self._last_t: float | None = None
        self._saved_step: int | None = None
        self.noticed_at: int | None = None
        """The step whose end saw the notice (and saved), else None."""

    @property
    def ckpt_path(self) -> str:
        # Unset until setup() found the directory: Lightning's "last" rule skips a falsy path.
        return super().ckpt_path if self._dirpath_given else ""

    # -- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self._dirpath_given:
            mc = next(
                (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None
            )
            self.dirpath = (
                str(mc.dirpath) if mc is not None and mc.dirpath else trainer.default_root_dir
            )
            self._dirpath_given = True
        self._watcher.preempted()  # installs the notice handler now, from the main thread
        env = getattr(trainer.strategy, "cluster_environment", None)
        if env is not None and trainer.is_global_zero:  # where Lightning took the world from
            print(
                f"trainpod: Lightning's cluster environment is {type(env).__name__}, "
                f"world size {trainer.world_size}",
                flush=True,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_t = time.monotonic()
        if self._tb_dir is not None and trainer.is_global_zero:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed attempt's steps replace those the earlier one wrote past its checkpoint.
            self._writer = SummaryWriter(str(self._tb_dir), purge_step=trainer.global_step + 1)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        metrics: dict[str, float | int] = {}
        loss = _loss(outputs)
        if loss is not None:
            metrics["loss"] = loss
        now = time.monotonic()
        tokens, samples = _batch_size(batch)
        if tokens is not None:
            metrics["tokens"] = tokens
        elif samples is not None and self._last_t is not None and now > self._last_t:
            metrics["samples_per_s"] = samples / (now - self._last_t)
        self._last_t = now
        if self._saved_step is not None:
            metrics["checkpoint_step"] = self._saved_step
            self._saved_step = None
        self._report(step, **metrics)
        if self._writer is not None:  # every step: a few scalars, a few bytes each
            for name, value in trainer.callback_metrics.items():
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    self._writer.add_scalar(name, value.item(), step)
        if self.noticed_at is None and self._watcher.preempted(sync=True):
            self.noticed_at = step
            trainer.save_checkpoint(self.ckpt_path)  # every rank: Lightning's save is collective
            trainer.should_stop = True
            if trainer.is_global_zero:
                print(f"trainpod: notice at step {step}: saved {self.ckpt_path}", flush=True)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._saved_step = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        # Not OnExceptionCheckpoint's save: after a fault a peer is usually gone, and a
        # collective save would hang until teardown. The periodic last.ckpt covers faults.
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Keep the notice save (OnExceptionCheckpoint would delete it): it is the resume point.
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _loss(outputs: Any) -> float | None:
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().item())
    return None


def _batch_size(batch: Any) -> tuple[int | None, int | None]:
    """(tokens, samples) of a batch: tokens from ``input_ids`` when it has them, samples
    from the first tensor's first dimension."""
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel()), int(ids.shape[0])
        batch = list(batch.values())
    if isinstance(batch, torch.Tensor):
        return None, int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor) and item.dim():
                return None, int(item.shape[0])
    return None, None


# -- the runner: python -m trainpod.integrations.lightning SCRIPT ARGS... ---------------------
def _patch_trainer(trainer_cls: type[pl.Trainer]) -> None:
    """Add the callback to every Trainer, and hand ``fit`` the newest verified last checkpoint
    when the script passes no ``ckpt_path``. Idempotent."""
    if getattr(trainer_cls, "_trainpod_patched", False):
        return
    init, fit = trainer_cls.__init__, trainer_cls.fit

    def __init__(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        cbs = kwargs.get("callbacks") or []
        cbs = list(cbs) if isinstance(cbs, Sequence) else [cbs]
        if not any(isinstance(c, TrainpodCallback) for c in cbs):
            cbs.append(TrainpodCallback())
        kwargs["callbacks"] = cbs
        init(self, *args, **kwargs)

    def fit_(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if len(args) < 5 and kwargs.get("ckpt_path") is None:  # ckpt_path is fit's 5th
            found = resume_path(self)
            kwargs["ckpt_path"] = str(found) if found is not None else None
            if found is not None and os.environ.get("RANK", "0") == "0":
                print(f"trainpod: resuming from {found}", flush=True)
        fit(self, *args, **kwargs)

    trainer_cls.__init__ = __init__  # type: ignore[method-assign]
    trainer_cls.fit = fit_  # type: ignore[method-assign]
    trainer_cls._trainpod_patched = True  # type: ignore[attr-defined]


class _StandaloneAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``pytorch_lightning`` (the standalone package) imported as ``lightning.pytorch``.

    The two are one code base published twice, as separate class hierarchies: a
    ``pytorch_lightning.Trainer`` takes no ``lightning.pytorch`` callback. Under the runner a
    script that imports ``pytorch_lightning`` (``import pytorch_lightning as pl``,
    ``from pytorch_lightning.callbacks import ModelCheckpoint``) gets ``lightning.pytorch``'s
    modules instead, the same API, so its Trainer is the one patched and the callback fits.
    Its checkpoints are Lightning's either way. Whether the standalone package is installed
    does not matter; its version is then ``lightning``'s."""

    PREFIX = "pytorch_lightning"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.PREFIX and not fullname.startswith(self.PREFIX + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        real = "lightning.pytorch" + spec.name[len(self.PREFIX) :]
        if spec.name == self.PREFIX and os.environ.get("RANK", "0") == "0":
            print("trainpod: pytorch_lightning is run as lightning.pytorch", flush=True)
        return importlib.import_module(real)

    def exec_module(self, module: Any) -> None:
        pass  # the real module is imported already


def _alias_standalone() -> None:
    """Install :class:`_StandaloneAlias` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _StandaloneAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandaloneAlias())


USAGE = "usage: python -m trainpod.integrations.lightning SCRIPT.py [ARGS...] | -m MODULE [ARGS...]"


def run(argv: Sequence[str]) -> None:
    """Run a Lightning script unmodified, as ``python SCRIPT ARGS`` (or ``python -m MODULE``)."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help") or (args[:1] == ["-m"] and len(args) < 2):
        raise SystemExit(USAGE)
    _patch_trainer(pl.Trainer)
    _alias_standalone()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = Path(args[0])
    if not script.is_file():
        raise SystemExit(f"trainpod: no script {script} (from {Path.cwd()}); {USAGE}")
    sys.argv = [str(script), *args[1:]]
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT` puts it first
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":  # run the real module's run(), not this __main__ copy's classes
    from trainpod.integrations.lightning import run as _run

    _run(sys.argv[1:])
