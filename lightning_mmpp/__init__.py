"""Multi-module pipeline parallelism for PyTorch Lightning.

``Trainer(strategy=MultiModulePipelineStrategy(placements, topology, num_microbatches))``
trains a LightningModule whose modules (vision / audio encoders, a language model, ...) each
get their own ranks, pipeline depth and data-parallel size.

``PipelineEngine`` runs the same pipeline without Lightning (a plain PyTorch loop under
``torchrun``). The strategy (and with it Lightning, several seconds to import) and everything
that needs torch load on first use, so the lower layers (topology, placement, actions, schedule,
simulator) import without torch.
"""

from typing import Any

from lightning_mmpp.errors import PipelineConfigError, PipelineError
from lightning_mmpp.core.kinds import StepKind
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout, StageSlot
from lightning_mmpp.core.topology import ModuleTopology

__all__ = [
    "ModulePlacement",
    "ModuleTopology",
    "MultiModulePipelineStrategy",
    "PipelineConfigError",
    "PipelineError",
    "PipelineEngine",
    "PipelineLayout",
    "PretrainedWeights",
    "Ragged",
    "StepKind",
    "StageSlot",
    "export_checkpoint",
    "load_pretrained",
    "materialize",
    "run_unpipelined",
]


def __getattr__(name: str) -> Any:
    if name == "MultiModulePipelineStrategy":
        from lightning_mmpp.lightning.strategy import MultiModulePipelineStrategy

        return MultiModulePipelineStrategy
    if name == "PipelineEngine":
        from lightning_mmpp.engine.engine import PipelineEngine

        return PipelineEngine
    if name == "run_unpipelined":
        from lightning_mmpp.model.reference import run_unpipelined

        return run_unpipelined
    if name == "materialize":
        from lightning_mmpp.model.initialization import materialize

        return materialize
    if name == "load_pretrained":
        from lightning_mmpp.model.construction import load_pretrained

        return load_pretrained
    if name == "PretrainedWeights":
        from lightning_mmpp.model.pretrained import PretrainedWeights

        return PretrainedWeights
    if name == "Ragged":
        from lightning_mmpp.model.ragged import Ragged

        return Ragged
    if name == "export_checkpoint":
        from lightning_mmpp.state.checkpoint import export_checkpoint

        return export_checkpoint
    raise AttributeError(f"module 'lightning_mmpp' has no attribute {name!r}")
