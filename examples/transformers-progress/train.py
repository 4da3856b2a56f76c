"""A tiny Hugging Face Trainer run whose progress reaches the TrainingJob's status.

The model is a small torch module built here and the data are synthetic, so nothing is fetched
from the hub; it trains on CPU over gloo under torchrun (any number of processes)::

    torchrun --nproc-per-node 2 examples/transformers-progress/train.py --steps 60

In a phalanx job the callback pushes rank 0's step, the total and the logged loss, learning rate
and gradient norm to the job's rendezvous store, and the operator writes them into
``status.progress`` (docs/worker.md). Run outside a job, it trains the same and pushes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from phalanx.worker.progress import transformers_callback

FEATURES = 16


class Regression(torch.nn.Module):
    """Two layers fitting a fixed random linear map; returns its loss as the Trainer expects."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.layers(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}


def synthetic_data(samples: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)  # every rank sees the same data set
    weights = torch.randn(FEATURES, generator=generator)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    labels = inputs @ weights + 0.1 * torch.randn(samples, generator=generator)
    return [{"x": x, "labels": y} for x, y in zip(inputs, labels, strict=True)]


class Pace(TrainerCallback):
    """Sleeps after each step, so a demo's progress can be watched (the model trains in milliseconds)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train")
    parser.add_argument("--logging-steps", type=int, default=5, help="steps between logged (and reported) metrics")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per step and process")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step (slows the demo)")
    parser.add_argument("--output-dir", default="/tmp/transformers-progress", help="the Trainer's output directory")
    options = parser.parse_args()
    arguments = TrainingArguments(
        output_dir=options.output_dir,
        max_steps=options.steps,
        logging_steps=options.logging_steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,  # the model's forward names its inputs; keep them all
    )
    trainer = Trainer(
        model=Regression(),
        args=arguments,
        train_dataset=synthetic_data(512),
        callbacks=[transformers_callback(), *([Pace(options.step_seconds)] if options.step_seconds else [])],
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"transformers-progress: done steps={result.global_step} loss={result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
