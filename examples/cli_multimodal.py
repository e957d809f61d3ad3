"""The model of ``examples/train_multimodal.py`` trained through ``LightningCLI`` and a YAML config.

    python examples/cli_multimodal.py fit --config examples/cli_multimodal.yaml
    python examples/cli_multimodal.py fit --config examples/cli_multimodal.yaml --trainer.max_steps 20

The strategy is a class path in the config, its placements plain mappings that ``jsonargparse``
turns into ``ModulePlacement``s::

    trainer:
      strategy:
        class_path: lightning_mmpp.MultiModulePipelineStrategy
        init_args:
          placements:
            vision: {pp: 1, dp: 2}

Needs ``jsonargparse[signatures]`` (the ``examples`` extra: ``pip install -e ".[examples]"``, or
``scripts/install.sh examples``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import lightning as L
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling examples, wherever this runs from

from multimodal_model import SyntheticCaptions  # noqa: E402
from train_multimodal import VisionAudioLM  # noqa: E402


class SyntheticCaptionsData(L.LightningDataModule):
    """The synthetic captions of ``multimodal_model.py`` (an image quadrant and a tone pitch, spelled as tokens).

    Args:
        size: samples in the training set.
        batch_size: the global batch; it must divide by ``num_microbatches x lcm(dp sizes)``.
        seed: the seed the samples are drawn with.
    """

    def __init__(self, size: int = 4096, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.size = size
        self.batch_size = batch_size
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SyntheticCaptions(self.size, self.seed), batch_size=self.batch_size, shuffle=True,
                          drop_last=True)


class ReportLoss(L.Callback):
    """Prints the first and the last training loss on rank 0 (``loss A -> B after N steps``)."""

    def __init__(self) -> None:
        self.first: Optional[float] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = float(trainer.callback_metrics["train_loss"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.first is not None:
            last = float(trainer.callback_metrics["train_loss"])
            print(f"loss {self.first:.4f} -> {last:.4f} after {trainer.global_step} steps", flush=True)


def main(args: Optional[list[str]] = None) -> None:
    from lightning.pytorch.cli import LightningCLI

    # save_config_callback=None: no config.yaml copy in the working directory (logger=False leaves no log dir)
    LightningCLI(VisionAudioLM, SyntheticCaptionsData, args=args, save_config_callback=None,
                 trainer_defaults={"callbacks": [ReportLoss()]})


if __name__ == "__main__":
    main()
