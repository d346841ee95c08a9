"""A tiny causal language model trained with the Hugging Face ``Trainer``.

Written as for ``torchrun --nnodes 2 --nproc-per-node 1 train.py --output_dir out ...`` and
nothing else: it knows nothing of trainpod. The model is GPT-2 built from a config (random
weights, nothing downloaded), the data synthetic token ids, so it runs offline on CPU.
Every ``TrainingArguments`` field is a command-line flag (``HfArgumentParser``, as in
Hugging Face's own example scripts), ``--resume_from_checkpoint`` included: that flag is
how trainpod hands it its newest complete ``checkpoint-N`` (``{resume:out}`` in the
submitted command; see the README's "Hugging Face Trainer and accelerate" section)::

    trainpod submit --nodes 2 --auto-resume -- python examples/hf/train.py \\
        --output_dir out --max_steps 30 --save_steps 10 --use_cpu --report_to none \\
        --resume_from_checkpoint={resume:out}

``--trainpod-callback`` adds ``trainpod.integrations.hf.TrainpodCallback`` (beacons, a save
on a preemption notice, TensorBoard where trainpod keeps it): the one line the integration
asks of a script.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    vocab_size: int = field(default=128, metadata={"help": "token ids are drawn below this"})
    seq_len: int = field(default=32, metadata={"help": "tokens a sample"})
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 2
    samples: int = field(default=1024, metadata={"help": "size of the synthetic data set"})
    step_delay_s: float = field(
        default=0.0, metadata={"help": "simulated compute per step (the model is tiny)"}
    )
    trainpod_callback: bool = field(
        default=False, metadata={"help": "add trainpod.integrations.hf.TrainpodCallback"}
    )


class SimulatedCompute(TrainerCallback):
    """Sleeps after each step: the tiny model's steps take as long as a real one's would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(
        self, args: TrainingArguments, state: object, control: object, **kw: object
    ) -> None:
        time.sleep(self.seconds)


class SyntheticTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token ids drawn once from a fixed generator: the same data on every rank and run."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab_size, (samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts labels


def main() -> None:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))  # type: ignore[arg-type]
    margs, targs = parser.parse_args_into_dataclasses()
    set_seed(targs.seed)
    config = GPT2Config(
        vocab_size=margs.vocab_size,
        n_positions=margs.seq_len,
        n_embd=margs.n_embd,
        n_layer=margs.n_layer,
        n_head=margs.n_head,
    )
    model = GPT2LMHeadModel(config)
    callbacks: list[TrainerCallback] = []
    if margs.step_delay_s > 0:
        callbacks.append(SimulatedCompute(margs.step_delay_s))
    if margs.trainpod_callback:
        from trainpod.integrations.hf import TrainpodCallback

        callbacks.append(TrainpodCallback())
    data = SyntheticTokens(margs.samples, margs.seq_len, margs.vocab_size)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    if trainer.is_world_process_zero():
        print(f"world size {targs.world_size}, resume from {targs.resume_from_checkpoint}")
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    if trainer.is_world_process_zero():
        step, loss = losses[-1]
        # repr-exact JSON: a resumed run is compared with an undisturbed one bit for bit
        print("final " + json.dumps({"step": step, "loss": loss, "world_size": targs.world_size}))


if __name__ == "__main__":
    main()
