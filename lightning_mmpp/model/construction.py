"""Build a rank's own stages: random initialisation and pretrained weights after partitioning.

``plan_construction`` runs on the whole (usually meta) model before partitioning, on every
rank: it opens the pretrained sources (metadata only) and checks every key of every module and
that every meta submodule can be initialised, so a user error fails identically everywhere
before the first collective. ``build_own_stages`` runs after partitioning: the model then holds
only the rank's own layers (under their original names), which are allocated on the rank's
device, initialised by :func:`~lightning_mmpp.model.initialization.materialize` and overwritten with
their pretrained values; nothing else is allocated or read.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.initialization import (
    check_materializable,
    covered_submodules,
    has_meta_tensors,
    initialise_submodule,
    materialize,
)
from lightning_mmpp.model.partition import TiedParameter
from lightning_mmpp.model.pretrained import (
    PathLike,
    PretrainedSource,
    PretrainedWeights,
    check_pretrained,
    covered_names,
    load_pretrained_tensors,
    module_tensor_specs,
    open_source,
)

__all__ = ["ConstructionPlan", "build_own_stages", "load_pretrained", "plan_construction"]


@dataclass
class ConstructionPlan:
    """What ``build_own_stages`` needs: the checked sources and whether the model is on meta."""

    sources: list[PretrainedSource]
    on_meta: bool
    # per module: state-dict key -> other keys of the same (tied) tensor
    aliases: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def _aliases(container: nn.Module) -> dict[str, list[str]]:
    """Keys naming the same tensor (tied weights) inside one module's state dict."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in container.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(key)
    return {key: [k for k in keys if k != key] for keys in by_tensor.values() if len(keys) > 1 for key in keys}


def plan_construction(
    model: nn.Module, pretrained: Mapping[str, Union[PathLike, PretrainedWeights]]
) -> ConstructionPlan:
    """Check pretrained sources against the whole model and that every meta tensor can be filled."""
    sources = []
    aliases = {}
    for module, spec in pretrained.items():
        source = open_source(module, spec)
        container = getattr(model, module)
        aliases[module] = _aliases(container)
        check_pretrained(source, module_tensor_specs(container), aliases[module])
        sources.append(source)
    on_meta = has_meta_tensors(model)
    if on_meta:
        check_materializable(model, covered_names(sources, aliases))
    return ConstructionPlan(sources, on_meta, aliases)


def build_own_stages(
    model: nn.Module, plan: ConstructionPlan, device: torch.device, seed: int, tied: Sequence[TiedParameter] = ()
) -> dict[str, list[str]]:
    """Allocate and initialise the (partitioned) model's meta tensors, then load pretrained values.

    A tied parameter whose first owner (its initialiser in one process) this rank dropped is
    initialised from a throwaway copy of that owner, so every copy starts equal.
    Returns ``{module: module-relative keys read from its source}``.
    """
    if plan.on_meta:
        skip = covered_submodules(model, covered_names(plan.sources, plan.aliases))
        was_meta = {id(t.local) for t in tied if t.local is not None and t.local.is_meta}
        materialize(model, seed, device=device, skip=skip)
        held = {id(m) for m in model.modules()}
        for tie in tied:
            if id(tie.local) in was_meta and id(tie.first_owner) not in held and tie.first_owner_name not in skip:
                owner = copy.deepcopy(tie.first_owner)
                for key, t in list(owner.named_parameters(recurse=False)):
                    if not t.is_meta:  # the copy holds the tied tensor for real: re-create it
                        owner._parameters[key] = nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                initialise_submodule(owner, tie.first_owner_name, seed, device)
                with torch.no_grad():
                    tie.local.copy_(getattr(owner, tie.attribute))  # type: ignore[union-attr]
    read = {}
    for source in plan.sources:
        container = getattr(model, source.module)
        read[source.module] = load_pretrained_tensors(
            source, container.state_dict(keep_vars=True), plan.aliases.get(source.module, {})
        )
        source.release()
    return read


def load_pretrained(
    model: nn.Module,
    pretrained: Mapping[str, Union[PathLike, PretrainedWeights]],
    seed: Optional[int] = None,
    device: Union[torch.device, str, None] = None,
) -> nn.Module:
    """Per-module pretrained weights in one process, as the strategy loads them on each rank.

    On a model with meta tensors, what the sources do not fill is first initialised by
    :func:`~lightning_mmpp.model.initialization.materialize` (``seed``, ``device``: see there), so a
    single process reproduces a pipelined run's initial weights exactly. ``pretrained`` maps
    module attribute names to sources (see :mod:`lightning_mmpp.model.pretrained`). Returns ``model``.
    """
    for module in pretrained:
        if not isinstance(getattr(model, module, None), nn.Module):
            raise PipelineConfigError(f"pretrained weights for {module!r}: the model has no module `{module}`.")
    plan = plan_construction(model, pretrained)
    build_own_stages(model, plan, torch.device(device or "cpu"), torch.initial_seed() if seed is None else seed)
    return model
