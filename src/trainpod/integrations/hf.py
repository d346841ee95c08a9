"""trainpod for the Hugging Face ``Trainer``: one line, ``callbacks=[TrainpodCallback()]``.

What it adds (ADR 0030):

* **Progress beacons** (``trainpod.report``) at every optimizer step: the step, the last
  logged ``loss`` and ``tokens`` (this rank's share of the step's input tokens, from HF's
  own count, ``include_num_input_tokens_seen``, which the callback turns on when the script
  left it off: one small all-gather a step). trainpod's hang and straggler detection,
  ``jobs show``, metrics and TensorBoard (``metrics/loss``, ``trainpod/tokens_per_s``) read
  them.
* **A save on a preemption notice** (``trainpod.preempted``, ADR 0013): at the end of the
  step in which any rank got it (every rank agrees, an all-reduce), it sets
  ``control.should_save`` and ``control.should_training_stop``, so HF writes its own
  ``checkpoint-N`` and ``train()`` returns; the job resumes from it.
* **Resume from the newest complete checkpoint**: :func:`last_checkpoint` is HF's
  ``get_last_checkpoint`` that skips a ``checkpoint-N`` a kill left half-written (see
  :func:`trainpod.resume.incomplete`); an unmodified script gets the same from the
  ``{resume:DIR}`` placeholder in its command.
* **TensorBoard where trainpod keeps it**: rank 0 writes everything HF logs (loss,
  learning rate, grad norm, ...) to ``$TRAINPOD_TENSORBOARD_DIR/hf`` (ADR 0021), with
  ``purge_step`` at the resumed step so that no step shows twice after a restart.

Outside trainpod every part is a no-op but :func:`last_checkpoint`. Importing this module
imports ``transformers``; without it the import fails saying how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpod import beacon, notice, resume
from trainpod.telemetry.tensorboard import ENV as TENSORBOARD_ENV

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the frameworks extra is installed in CI
    raise ImportError(
        "trainpod.integrations.hf needs the transformers package: "
        "pip install 'trainpod[frameworks]' (or pip install transformers accelerate)"
    ) from exc

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["TENSORBOARD_RUN", "TrainpodCallback", "last_checkpoint"]

TENSORBOARD_RUN = "hf"  # the run under the job's TensorBoard logdir


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None (start from scratch).

    ``trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))``: unlike HF's
    ``get_last_checkpoint``, a checkpoint a kill left half-written is skipped."""
    world = int(os.environ.get("WORLD_SIZE", "0")) or None
    found = resume.newest_complete(Path(output_dir), world_size=world)
    return None if found.path is None else str(found.path)


class TrainpodCallback(TrainerCallback):
    """Beacons, a save on a preemption notice and TensorBoard for a ``Trainer`` (module doc).

    ``watcher``: where the notice comes from (default: the process's, ``trainpod.notice``).
    ``tensorboard_dir``: default ``$TRAINPOD_TENSORBOARD_DIR``; None outside trainpod."""

    def __init__(
        self,
        *,
        watcher: notice.NoticeWatcher | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._watcher = watcher or notice.watcher()
        tb = tensorboard_dir or os.environ.get(TENSORBOARD_ENV)
        self._tb_dir = Path(tb) / TENSORBOARD_RUN if tb else None
        self._writer: SummaryWriter | None = None
        self._pending: dict[str, float] = {}  # this step's beacon, until HF logs its loss
        self._last: dict[str, float] = {}  # the last beacon's metrics but its tokens
        self._tokens_seen = 0
        self.saved_on_notice: int | None = None  # the step it asked HF to save at

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if args.include_num_input_tokens_seen in ("no", False):
            args.include_num_input_tokens_seen = "all"  # HF's own count feeds ``tokens``

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._tokens_seen = state.num_input_tokens_seen
        self._watcher.preempted()  # installs the notice handler (HF calls us on the main thread)
        if state.is_world_process_zero and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # Resumed at step S: TensorBoard drops what an earlier attempt wrote after S.
            purge = state.global_step + 1 if state.global_step > 0 else None
            self._writer = SummaryWriter(log_dir=str(self._tb_dir), purge_step=purge)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        seen = state.num_input_tokens_seen
        self._pending = {"tokens": (seen - self._tokens_seen) / max(args.world_size, 1)}
        self._tokens_seen = seen
        if not control.should_log:  # else HF logs this step's loss next: report it with it
            self._report(state.global_step)
        # A collective on every rank at the same point: all stop at the same step.
        if self._watcher.preempted(sync=True) and not control.should_training_stop:
            control.should_save = True
            control.should_training_stop = True
            self.saved_on_notice = state.global_step
            if state.is_world_process_zero:
                print(f"trainpod: notice received: saving checkpoint-{state.global_step}, stopping")

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        logs = logs or {}
        if isinstance(logs.get("loss"), (int, float)):
            self._pending["loss"] = float(logs["loss"])
        self._report(state.global_step)
        if self._writer is None:
            return
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"train/{key}", value, state.global_step)
        self._writer.flush()

    def _report(self, step: int) -> None:
        if self._pending:
            beacon.report(step, **self._pending)
            self._last = {k: v for k, v in self._pending.items() if k != "tokens"}
            self._pending = {}

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # The agent keeps a rank's last metrics: repeat the loss (not the additive tokens).
        beacon.report(state.global_step, **self._last, checkpoint_step=state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
