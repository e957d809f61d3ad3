"""Train a tiny vision + audio -> language model with multi-module pipeline parallelism.

Layout (5 CPU processes, gloo; the model and data are in ``multimodal_model.py``):

    rank 0  vision  (replica 0 of 2) --.
    rank 1  vision  (replica 1 of 2) --+--> rank 3  llm stage 0 --> rank 4  llm stage 1 (loss)
    rank 2  audio                    --'

The vision encoder is data-parallel (each replica sees half of every microbatch; the bridge
concatenates them for the LM), the audio encoder runs beside it, and the language model is
split into two pipeline stages. The task is synthetic but learnable: an image shows one of
four bright quadrants, a clip is a tone of one of four pitches, and the "caption" spells out
(quadrant, pitch, their sum) as tokens. The loss falls from ln(16) ~ 2.8 towards 0.

Run: ``python examples/train_multimodal.py`` (Lightning starts the 5 processes itself).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mmpp import MultiModulePipelineStrategy

from multimodal_model import PLACEMENTS, TOPOLOGY, SyntheticCaptions, VisionAudioModel


class VisionAudioLM(VisionAudioModel, L.LightningModule):
    """The model of :mod:`multimodal_model` as a LightningModule: its modules and pipeline hooks,
    plus the optimizer."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # single-process use only
        from lightning_mmpp import run_unpipelined

        loss, _ = run_unpipelined(self, TOPOLOGY, batch)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def sample_batch(batch_size: int) -> dict[str, torch.Tensor]:
    """One collated batch: what ``python -m lightning_mmpp.plan`` profiles the model on."""
    return next(iter(DataLoader(SyntheticCaptions(batch_size), batch_size=batch_size)))


class PrintLoss(L.Callback):
    def __init__(self, every: int) -> None:
        self.every = every
        self.first: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        loss = float(trainer.callback_metrics["train_loss"])
        if self.first is None:
            self.first = loss
        if trainer.is_global_zero and (step % self.every == 0 or step == trainer.max_steps):
            acc = float(trainer.callback_metrics.get("train_accuracy", float("nan")))
            print(f"step {step:4d}  train_loss {loss:.4f}  train_accuracy {acc:.3f}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            last = float(trainer.callback_metrics["train_loss"])
            print(f"loss {self.first:.4f} -> {last:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zero_bubble"])
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # more ranks than cores: one thread per rank
    strategy = MultiModulePipelineStrategy(
        placements=PLACEMENTS,
        topology=TOPOLOGY,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        # CPU workers forked from this process skip re-importing torch and Lightning (seconds
        # each); on GPUs keep the default "popen" (CUDA does not survive a fork).
        start_method="fork",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=strategy.layout.world_size,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PrintLoss(every=20)],
    )
    if trainer.is_global_zero:
        print(strategy, flush=True)
    data = DataLoader(SyntheticCaptions(4096), batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer.fit(VisionAudioLM(), data)


if __name__ == "__main__":
    main()
