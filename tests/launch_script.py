"""Run by tests/test_launch.py: fit under start_method=fork/spawn, then inspect the parent's model."""

from __future__ import annotations

import sys
import warnings

import lightning as L
import torch

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from tests.models import MultiModalModel, make_loader
from tests.test_materialize import MetaBuiltModel

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
STEPS = 3


def _kwargs(devices, strategy=None, limit_val_batches=0):
    kwargs = dict(accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=limit_val_batches)
    if strategy is not None:
        kwargs["strategy"] = strategy
    return kwargs


def main(start_method: str) -> None:
    reference = MultiModalModel(TOPOLOGY)
    L.Trainer(**_kwargs(1)).fit(reference, make_loader(TOPOLOGY, 8, 8 * STEPS))
    reference_val = L.Trainer(**_kwargs(1, limit_val_batches=1.0)).validate(reference, make_loader(TOPOLOGY, 8, 16), verbose=False)

    model = MultiModalModel(TOPOLOGY)
    placements = {"enc_a": ModulePlacement(), "llm": ModulePlacement(pp=2)}
    strategy = MultiModulePipelineStrategy(placements, TOPOLOGY, 4, start_method=start_method)
    trainer = L.Trainer(**_kwargs(3, strategy))
    trainer.fit(model, make_loader(TOPOLOGY, 8, 8 * STEPS))
    worst = max((p - dict(reference.named_parameters())[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"GLOBAL_STEP {trainer.global_step}")
    print(f"MAX_DIFF {worst:.3g}")
    # the parent's model is whole: it validates like the reference, on one process
    val = L.Trainer(**_kwargs(1, limit_val_batches=1.0)).validate(model, make_loader(TOPOLOGY, 8, 16), verbose=False)
    print(f"VAL {val[0]['val_loss']:.6f} REFERENCE {reference_val[0]['val_loss']:.6f}")

    if start_method == "spawn":  # spawn re-imports everything per process: the whole-model case only
        return
    meta = MetaBuiltModel(TOPOLOGY)
    strategy = MultiModulePipelineStrategy(placements, TOPOLOGY, 4, start_method=start_method)
    trainer = L.Trainer(**_kwargs(3, strategy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(meta, make_loader(TOPOLOGY, 8, 8 * STEPS))
    said = [str(w.message) for w in caught if "holds no weights" in str(w.message)]
    print(f"META_WARNINGS {len(said)} GLOBAL_STEP {trainer.global_step}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
