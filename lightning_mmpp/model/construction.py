"""Build a rank's own stages: random initialisation and pretrained weights after partitioning.

``plan_construction`` runs on the whole (usually meta) model before partitioning, on every
rank: it opens the pretrained sources (metadata only) and checks every key of every module and
that every meta submodule can be initialised, so a user error fails identically everywhere
before the first collective. ``build_own_stages`` runs after partitioning: the model then holds
only the rank's own layers (under their original names), which are allocated on the rank's
device, initialised by :func:`~lightning_mmpp.model.initialization.materialize` and overwritten with
their pretrained values; nothing else is allocated or read.

Sharded while built (``ModulePlacement(shard=True)`` on a meta-built model): a layer of a sharded
stage is handed, still on meta, to a ``shard`` callback (the engine's ``fully_shard`` over the
stage's dp group), which says which of how many row chunks this rank keeps; only the local
shards are allocated. Then, one submodule at a time, :func:`initialise_submodule` runs on a
whole-size temporary copy under the submodule's own RNG (the layout-independent rule) and the
rank keeps its rows; pretrained values are read as those rows only. So a rank holds its own
shards plus at most one submodule's whole tensors, and the values are bitwise those of
:func:`~lightning_mmpp.model.initialization.materialize` in one process.

Split while built (``ModulePlacement(tp=t)`` on a meta-built model): a layer of a tp stage is
allocated whole, initialised and loaded (its pretrained tensors only), then handed at once to a
``split`` callback (the engine's tensor-parallel hook, and ``fully_shard`` too under
``shard=True``), which replaces its parameters by their shards and frees the whole ones before
the next layer is allocated. A rank so holds its own shards plus one whole layer, not its whole
stages, and every value is the one-process value (torch's parallel styles cut the whole tensor).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.initialization import (
    _own_tensors,
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

__all__ = ["ConstructionPlan", "ShardLayer", "SplitLayer", "build_own_stages", "load_pretrained", "plan_construction"]

ShardLayer = Callable[[nn.Module], tuple[int, int]]
"""Shard a meta layer in place (its parameters become row-sharded DTensors, ``torch.chunk`` along
dim 0); returns ``(this rank's chunk index, number of chunks)``."""

SplitLayer = Callable[[str, nn.Module], None]
"""Split a built layer of ``module`` in place (tensor parallelism; its parameters become DTensor
shards, the whole tensors are released)."""


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
    model: nn.Module,
    plan: ConstructionPlan,
    device: torch.device,
    seed: int,
    tied: Sequence[TiedParameter] = (),
    shard_layers: Sequence[tuple[str, str, nn.Module]] = (),
    shard: Optional[ShardLayer] = None,
    split_layers: Sequence[tuple[str, str, nn.Module]] = (),
    split: Optional[SplitLayer] = None,
) -> dict[str, list[str]]:
    """Allocate and initialise the (partitioned) model's meta tensors, then load pretrained values.

    A tied parameter whose first owner (its initialiser in one process) this rank dropped is
    initialised from a throwaway copy of that owner, so every copy starts equal.
    ``shard_layers`` (``(module, layer name, layer)``, every tensor still on meta) are sharded by
    ``shard`` first and built as local shards, one at a time (see the module docstring).
    ``split_layers`` (the same form) are built whole one at a time and handed to ``split`` each.
    Returns ``{module: module-relative keys read from its source}``.
    """
    read: dict[str, list[str]] = {}
    if plan.on_meta:
        skip = covered_submodules(model, covered_names(plan.sources, plan.aliases))
        if shard_layers:
            assert shard is not None, "sharded layers need the shard callback"
            for module, name, layer in shard_layers:
                keys = _build_sharded_layer(module, name, layer, shard, plan, device, seed, tied, skip)
                read.setdefault(module, []).extend(keys)
        if split_layers:
            assert split is not None, "split layers need the split callback"
            for module, name, layer in split_layers:
                keys = _build_whole_layer(module, name, layer, plan, device, seed, skip)
                split(module, layer)
                read.setdefault(module, []).extend(keys)
        was_meta = {id(t.local) for t in tied if t.local is not None and t.local.is_meta}
        materialize(model, seed, device=device, skip=skip)
        held = {id(m) for m in model.modules()}
        for tie in tied:
            if id(tie.local) in was_meta and id(tie.first_owner) not in held and tie.first_owner_name not in skip:
                with torch.no_grad():
                    tie.local.copy_(_first_owner_value(tie, seed, device))  # type: ignore[union-attr]
    for source in plan.sources:
        container = getattr(model, source.module)
        state = container.state_dict(keep_vars=True)
        built = [name for module, name, _ in (*shard_layers, *split_layers) if module == source.module]
        rest = {k: v for k, v in state.items() if not any(_within(k, name) for name in built)}
        read.setdefault(source.module, []).extend(
            load_pretrained_tensors(source, rest, plan.aliases.get(source.module, {}))
        )
        source.release()
    return read


def _within(key: str, layer_name: str) -> bool:
    """Whether state-dict ``key`` of a module belongs to its layer ``layer_name`` ("" = the whole module)."""
    return not layer_name or key.startswith(f"{layer_name}.")


def _first_owner_value(tie: TiedParameter, seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of a tied parameter from a throwaway copy of its first owner (dropped here)."""
    owner = copy.deepcopy(tie.first_owner)
    for key, t in list(owner.named_parameters(recurse=False)):
        if not t.is_meta:  # the copy holds the tied tensor for real: re-create it
            owner._parameters[key] = nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
    initialise_submodule(owner, tie.first_owner_name, seed, device)
    return getattr(owner, tie.attribute).detach()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a parameter sharded by ``shard``), any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _chunk_rows(length: int, index: int, count: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of chunk ``index`` when ``length`` rows are cut as ``torch.chunk`` does."""
    size = math.ceil(length / count) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def _build_sharded_layer(
    module: str,
    name: str,
    layer: nn.Module,
    shard: ShardLayer,
    plan: ConstructionPlan,
    device: torch.device,
    seed: int,
    tied: Sequence[TiedParameter],
    skip: set[str],
) -> list[str]:
    """Shard one meta layer, allocate its local shards and fill them; return the pretrained keys read."""
    prefix = f"{module}.{name}" if name else module
    params = {id(p): key for key, p in layer.named_parameters(remove_duplicate=False)}
    tie_of = {params[id(t.local)]: t for t in tied if t.local is not None and id(t.local) in params}
    # every submodule with tensors of its own, with a whole-size meta copy to initialise
    whole: list[tuple[str, str, nn.Module]] = []
    for sub, m in layer.named_modules():
        if any(True for _ in _own_meta(m)):
            whole.append((sub, f"{prefix}.{sub}" if sub else prefix, _meta_copy(m)))
    index, count = shard(layer)
    layer.to_empty(device=device)
    for key, tie in tie_of.items():  # the sharded parameter replaced the meta one
        tie.local = layer.get_parameter(key)
    state = layer.state_dict(keep_vars=True)
    own_names = {qualified for _, qualified, _ in whole}
    filled: set[int] = set()
    with torch.no_grad():
        for sub, qualified, template in whole:
            if qualified in skip:
                continue
            initialise_submodule(template, qualified, seed, device)
            for key, value in _own_tensors(template):
                full_key = f"{sub}.{key}" if sub else key
                tie = tie_of.get(full_key)
                if tie is not None and tie.first_owner_name != qualified:
                    continue  # filled below from its first owner, as in one process
                _fill(state[full_key], value, index, count, filled)
            del template
        for key, tie in tie_of.items():
            if tie.first_owner_name not in skip and tie.first_owner_name not in own_names:
                _fill(state[key], _first_owner_value(tie, seed, device), index, count, filled)
    read: list[str] = []
    for source in plan.sources:
        if source.module != module:
            continue
        tensors = {f"{name}.{k}" if name else k: v for k, v in state.items()}
        locals_ = {k: _local(v) for k, v in tensors.items()}
        rows = {k: _chunk_rows(v.shape[0], index, count) for k, v in tensors.items() if _local(v) is not v}
        read = load_pretrained_tensors(source, locals_, plan.aliases.get(module, {}), rows)
    return read


def _build_whole_layer(
    module: str, name: str, layer: nn.Module, plan: ConstructionPlan, device: torch.device, seed: int, skip: set[str]
) -> list[str]:
    """Allocate, initialise and load one meta layer of ``module`` whole; return the pretrained keys read."""
    materialize(layer, seed, device=device, skip=skip, prefix=f"{module}.{name}" if name else module)
    read: list[str] = []
    for source in plan.sources:
        if source.module == module:
            state = {f"{name}.{k}" if name else k: v for k, v in layer.state_dict(keep_vars=True).items()}
            read = load_pretrained_tensors(source, state, plan.aliases.get(module, {}))
    return read


def _own_meta(module: nn.Module):  # type: ignore[no-untyped-def]
    return ((k, t) for k, t in _own_tensors(module) if t is not None and t.is_meta)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with whole-size meta copies of its own tensors (children shared):
    what :func:`initialise_submodule` fills before the rank keeps its rows."""
    twin = copy.copy(module)
    twin._parameters = {k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                        for k, p in module._parameters.items()}
    twin._buffers = {k: None if b is None else torch.empty_like(b, device="meta") for k, b in module._buffers.items()}
    return twin


def _fill(dest: torch.Tensor, value: torch.Tensor, index: int, count: int, filled: set[int]) -> None:
    """Copy ``value`` (whole) into ``dest``: its rows of chunk ``index`` if ``dest`` is sharded."""
    if id(dest) in filled:  # a tensor shared inside the layer: its first owner filled it
        return
    filled.add(id(dest))
    local = _local(dest)
    if local is dest:
        dest.copy_(value)
        return
    start, stop = _chunk_rows(value.shape[0], index, count)
    assert local.shape[0] == stop - start, f"shard rows {tuple(local.shape)} vs chunk {start}:{stop} of {tuple(value.shape)}"
    local.copy_(value[start:stop])


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
