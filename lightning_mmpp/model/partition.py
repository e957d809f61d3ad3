"""Split each module's layers into pipeline stages and keep only what a rank owns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_mmpp.core.balance import balanced_split  # noqa: F401  (re-exported: the partitioner's split)
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout


def stage_ranges(layers: Sequence[nn.Module], pp: int, split_points: Sequence[int] | None, module: str) -> list[range]:
    """Layer index ranges of the ``pp`` stages of ``module`` (give ``pp * virtual_stages`` for a
    module with virtual stages: one range per chunk)."""
    n = len(layers)
    if n < pp:
        raise PipelineConfigError(
            f"module {module!r} has {n} layer(s) but pp={pp}; give it at least {pp} layers or lower pp."
        )
    if split_points is not None:
        if split_points[-1:] and split_points[-1] >= n:
            raise PipelineConfigError(
                f"module {module!r}: split_points {list(split_points)} must be < its {n} layers."
            )
        bounds = [0, *split_points, n]
        return [range(bounds[i], bounds[i + 1]) for i in range(pp)]
    weights = [max(1, sum(p.numel() for p in layer.parameters())) for layer in layers]
    return balanced_split(weights, pp)


class StageRunner:
    """The layers of one (module, stage) a rank owns; calling it applies them in order.

    The output of layer i is the single argument of layer i+1, any pytree of tensors.
    """

    def __init__(self, module: str, stage: int, layers: Sequence[nn.Module], layer_names: Sequence[str],
                 first_layer: int = 0) -> None:
        self.module = module
        self.stage = stage
        self.layers = list(layers)
        self.layer_names = list(layer_names)
        self.first_layer = first_layer  # the index of layers[0] in the whole module

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.parameters()]

    def __repr__(self) -> str:
        return f"StageRunner({self.module!r}, stage={self.stage}, layers={self.layer_names})"


@dataclass
class TiedParameter:
    """A parameter shared by layers of several stages or modules (``head.weight = embed.weight``).

    Every owning stage keeps a copy; the copies start equal (initialised by ``first_owner``, the
    first submodule holding it in ``named_modules()`` order, as in one process), their
    gradients are summed over the owners every step, so they stay equal.
    """

    names: list[str]  # qualified parameter names, in named_parameters(remove_duplicate=False) order
    owners: list[tuple[str, int]]  # (module, stage) holding it, in order of first appearance
    first_owner_name: str  # qualified name of the submodule that initialises it
    first_owner: nn.Module  # that submodule (kept even when this rank dropped it)
    attribute: str  # the parameter's name inside first_owner
    requires_grad: bool
    local: Optional[nn.Parameter] = None  # this rank's copy, when it holds an owner stage


@dataclass
class Partition:
    """What a rank keeps: one runner per module it holds, and the ids of its parameters.

    ``runners[module]`` holds every layer of the module this rank owns (what dp sync, sharding,
    tied weights, optimizers and checkpoints see: one rank position of the module);
    ``chunks[(module, chunk)]`` holds the layers of each of its stages, the units the runtime
    computes. Without virtual stages a module has one chunk, the same runner.
    """

    runners: dict[str, StageRunner]
    owned_parameter_ids: set[int]
    frozen_modules: frozenset[str]  # modules none of whose parameters (on any rank) require grad
    tied: list[TiedParameter] = field(default_factory=list)  # shared across stages or modules
    chunks: dict[tuple[str, int], StageRunner] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = {(module, 0): runner for module, runner in self.runners.items()}


def find_tied_parameters(model: nn.Module, layout: PipelineLayout) -> list[TiedParameter]:
    """Parameters held by layers of more than one (module, stage), found by identity."""
    stage_of_layer: dict[tuple[str, str], int] = {}
    for module in layout.modules:
        placement = layout.placements[module]
        names, layers = named_layers(_layer_container(model, module, placement.pp))
        for stage, span in enumerate(stage_ranges(layers, placement.num_stages, placement.split_points, module)):
            for i in span:
                stage_of_layer[(module, names[i])] = stage
    found: dict[int, TiedParameter] = {}
    for qualified, submodule in model.named_modules():
        parts = qualified.split(".")
        if (parts[0], "") in stage_of_layer:  # a plain nn.Module placed as one layer
            owner = (parts[0], 0)
        elif len(parts) >= 2 and (parts[0], parts[1]) in stage_of_layer:
            owner = (parts[0], stage_of_layer[(parts[0], parts[1])])
        else:
            continue
        for attribute, param in submodule._parameters.items():
            if param is None:
                continue
            tie = found.get(id(param))
            if tie is None:
                found[id(param)] = TiedParameter([], [owner], qualified, submodule, attribute, param.requires_grad)
            elif owner not in tie.owners:
                tie.owners.append(owner)
    tied = {pid: t for pid, t in found.items() if len(t.owners) > 1}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in tied:
            tied[id(param)].names.append(name)
    return list(tied.values())


def _layer_container(model: nn.Module, module: str, pp: int) -> nn.Module:
    container = getattr(model, module, None)
    if isinstance(container, (nn.Sequential, nn.ModuleList)) or (isinstance(container, nn.Module) and pp == 1):
        return container
    found = type(container).__name__ if container is not None else "nothing"
    raise PipelineConfigError(
        f"{type(model).__name__}.{module} is {found}; the placement {module!r} needs an attribute "
        f"`self.{module}` that is an nn.Sequential or nn.ModuleList of the layers to split into stages "
        "(with pp=1 any nn.Module, run as one layer)."
    )


def named_layers(container: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The layers of a module: the children of a Sequential/ModuleList, else the module itself."""
    if isinstance(container, (nn.Sequential, nn.ModuleList)):
        names = list(container._modules)
        return names, [container._modules[n] for n in names]  # type: ignore[misc]
    return [""], [container]


def check_model(model: nn.Module, layout: PipelineLayout) -> None:
    """Raise if the model lacks a module's layers or has parameters outside every module."""
    inside: set[int] = set()
    for module in layout.modules:
        container = _layer_container(model, module, layout.placements[module].pp)
        inside.update(id(p) for p in container.parameters())
        stage_ranges(named_layers(container)[1], layout.placements[module].num_stages,
                     layout.placements[module].split_points, module)
    outside = [name for name, p in model.named_parameters() if id(p) not in inside]
    if outside:
        raise PipelineConfigError(
            f"parameters {outside[:5]} are not inside any pipelined module ({list(layout.modules)}); every "
            "parameter must belong to one module's layers. Move them into a layer of one module (or register "
            "constants as buffers)."
        )
    for hook in ("pipeline_inputs", "pipeline_loss"):
        if not callable(getattr(model, hook, None)):
            raise PipelineConfigError(
                f"{type(model).__name__} has no `{hook}` method; the pipeline needs "
                "`pipeline_inputs(self, module, batch, upstream)` and `pipeline_loss(self, module, output, batch)`."
            )


def partition_model(model: nn.Module, layout: PipelineLayout, rank: int) -> Partition:
    """Keep only the layers ``rank`` owns, in place, under their original names: every chunk
    (stage) of every module it holds."""
    check_model(model, layout)
    tied = find_tied_parameters(model, layout)
    runners: dict[str, StageRunner] = {}
    chunks: dict[tuple[str, int], StageRunner] = {}
    owned: set[int] = set()
    frozen: set[str] = set()
    for module in layout.modules:
        placement = layout.placements[module]
        container = _layer_container(model, module, placement.pp)
        names, layers = named_layers(container)
        if not any(p.requires_grad for p in container.parameters()):
            frozen.add(module)
        ranges = stage_ranges(layers, placement.num_stages, placement.split_points, module)
        slots = layout.chunk_slots(rank, module)
        keep = sorted(i for slot in slots for i in ranges[slot.stage])
        if names == [""]:  # a plain module is one layer: a rank that does not hold it keeps none of it
            if not keep:
                model._modules[module] = nn.Sequential()
        else:
            for i, name in enumerate(names):
                if i not in keep:
                    del container._modules[name]
        for slot in slots:
            span = ranges[slot.stage]
            chunks[(module, slot.chunk)] = StageRunner(
                module, slot.stage, [layers[i] for i in span], [names[i] for i in span], span[0] if span else 0
            )
        if slots:
            first = chunks[(module, 0)]
            runner = (first if len(slots) == 1 else
                      StageRunner(module, first.stage, [layers[i] for i in keep], [names[i] for i in keep], keep[0]))
            runners[module] = runner
            owned.update(id(p) for p in runner.parameters())
    held = {id(p): p for runner in runners.values() for p in runner.parameters()}
    for tie in tied:
        tie.local = held.get(id(getattr(tie.first_owner, tie.attribute)))
    return Partition(runners=runners, owned_parameter_ids=owned, frozen_modules=frozenset(frozen), tied=tied,
                     chunks=chunks)
