"""Run by tests/test_multinode.py on every rank of two ``torchrun`` agents (2 "nodes" x 2 processes).

Trains the 4-rank layout ``enc_a`` dp=2 (node 0) -> ``llm`` pp=2 (node 1) twice through
Trainer + MultiModulePipelineStrategy: two epochs straight, saving a checkpoint after the first
(``ModelCheckpoint``); then the second epoch again, resumed from that checkpoint. Writes what
this rank saw to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from tests.models import MultiModalModel, make_loader

P = ModulePlacement
TOPOLOGY = {"enc_a": ["llm"], "llm": []}
PLACEMENTS = {"enc_a": P(dp=2), "llm": P(pp=2)}  # ranks 0-1 (node 0): enc_a replicas; ranks 2-3 (node 1): llm
BATCH = 8
M = 2
EPOCH = 2  # batches per epoch; checkpoints at an epoch boundary resume exactly


class _Record(L.Callback):
    """The loss of every step as this rank sees it, and this rank's parameters at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.numel()}


def _fit(out: str, epochs: int, ckpt_path: Optional[str] = None) -> tuple[L.Trainer, _Record]:
    strategy = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=M, timeout=timedelta(seconds=60))
    record = _Record()
    every_epoch = ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_epochs=epochs,
        callbacks=[record, every_epoch], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(MultiModalModel(TOPOLOGY, optimizer="adam"), make_loader(TOPOLOGY, BATCH, BATCH * EPOCH),
                ckpt_path=ckpt_path)
    return trainer, record


def main(out: str) -> None:
    trainer, straight = _fit(out, 2)
    strategy = trainer.strategy
    _, resumed = _fit(out, 2, ckpt_path=os.path.join(out, "checkpoints", "epoch=0.ckpt"))
    rank = strategy.global_rank
    result = {
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MMPP_TEST_AGENT")},
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "global_rank": rank, "local_rank": strategy.local_rank, "node_rank": strategy.node_rank,
        "world_size": strategy.world_size,
        "slots": [(s.module, s.stage, s.replica) for s in strategy.layout.slots(rank)],
        "losses": straight.losses, "params": straight.params,
        "resumed_losses": resumed.losses, "resumed_params": resumed.params,
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    # the result is on disk: leave at once, like tests/dist.py's workers (the interpreter's own
    # shutdown after a fit takes seconds here, and the agents wait for it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
