"""Allocate and initialise a model built on the meta device, independently of the layout.

A model built under ``torch.device("meta")`` (the strategy's ``tensor_init_context``: Lightning's
``configure_model()`` hook or ``trainer.init_module(empty_init=True)``) has shapes but no storage.
After partitioning, each rank holds only its own stages, still on meta; :func:`materialize`
allocates them on the rank's device and initialises them.

The rule: every submodule that holds parameters or buffers of its own on the meta device is
visited in ``named_modules()`` order; its meta tensors are allocated (parameters keep their
identity, so optimizers built on the meta model stay valid) and its ``reset_parameters()`` runs
under an RNG seeded from ``(seed, qualified name)``. A submodule's initial values therefore
depend only on the seed and its name, never on which other submodules a process holds: a layer
is bitwise the same on every layout and in one process (for the same device type).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Iterator
from typing import Optional, Union

import torch
from torch import nn

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["check_materializable", "covered_submodules", "has_meta_tensors", "init_seed", "initialise_submodule",
           "materialize", "meta_submodules", "release", "uninitialisable_submodules"]


def init_seed(seed: int, name: str) -> int:
    """The RNG seed of submodule ``name`` (a qualified name such as ``"llm.3.lin"``)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def meta_submodules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, submodule)`` of every submodule with meta tensors of its own, in order."""
    return [(name, m) for name, m in model.named_modules() if any(t.is_meta for _, t in _own_tensors(m))]


def uninitialisable_submodules(model: nn.Module, covered: Collection[str] = ()) -> list[str]:
    """Meta submodules that :func:`materialize` cannot initialise.

    A submodule needs ``reset_parameters()``, unless ``covered`` (fully qualified state-dict
    names with pretrained values) holds every one of its own tensors; a non-persistent buffer is
    never in a state dict, so only ``reset_parameters()`` can fill it.
    """
    done = covered_submodules(model, covered)
    return [f"{name or '<root>'} ({type(m).__name__})" for name, m in meta_submodules(model)
            if name not in done and not callable(getattr(m, "reset_parameters", None))]


def covered_submodules(model: nn.Module, covered: Collection[str]) -> set[str]:
    """Meta submodules whose own tensors all come from ``covered`` (pretrained) names: they
    need no random initialisation."""
    covered = set(covered)
    out = set()
    for name, m in meta_submodules(model):
        prefix = f"{name}." if name else ""
        transient = set(getattr(m, "_non_persistent_buffers_set", ()))
        if all(t not in transient and f"{prefix}{t}" in covered for t, _ in _own_tensors(m)):
            out.add(name)
    return out


def check_materializable(model: nn.Module, covered: Collection[str] = ()) -> None:
    """Raise :class:`PipelineConfigError` if :func:`materialize` (with the ``covered`` names
    loaded from pretrained weights) could not initialise every meta tensor of ``model``."""
    bad = uninitialisable_submodules(model, covered)
    if bad:
        _raise_uninitialisable(bad)


def _raise_uninitialisable(bad: list[str]) -> None:
    raise PipelineConfigError(
        f"submodule(s) {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} were built on the meta device and "
        "have no reset_parameters(), so they cannot be initialised. Give the class a reset_parameters() that "
        "fills every parameter and buffer it owns, or load pretrained weights for them (pretrained=...)."
    )


def release(params: Iterable[nn.Parameter]) -> None:
    """Put ``params`` back on the meta device, keeping their identity: their storage is freed
    even while an optimizer or a caller still references them (replaced parameters)."""
    for param in params:
        if not param.is_meta:
            torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device="meta"),
                                                          requires_grad=param.requires_grad))


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Give the module's own meta tensors storage on ``device``; parameters keep their identity."""
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
    for name, buf in list(module.named_buffers(recurse=False)):
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty_like(buf, device=device)


def materialize(
    model: nn.Module,
    seed: Optional[int] = None,
    *,
    device: Union[torch.device, str, None] = None,
    skip: Collection[str] = (),
    prefix: str = "",
) -> nn.Module:
    """Allocate and initialise every meta tensor of ``model`` in place (see the module docstring).

    Args:
        model: a module (usually the LightningModule) built wholly or partly on the meta device.
            Submodules already holding real tensors are left as they are.
        seed: the base seed; ``None`` means ``torch.initial_seed()`` (what ``seed_everything``
            set). Every rank of a run must use the same seed.
        device: where to allocate; default CPU.
        skip: qualified names of submodules to allocate without ``reset_parameters()`` (their
            values come from elsewhere, e.g. pretrained weights).
        prefix: ``model``'s own qualified name when it is a part of a larger model (a layer
            ``"llm.3"``): submodule names, seeds and ``skip`` are the larger model's.

    Returns:
        ``model``.

    Raises:
        PipelineConfigError: a meta submodule without ``reset_parameters()`` that is not skipped.
    """
    device = torch.device(device if device is not None else "cpu")
    base = torch.initial_seed() if seed is None else int(seed)
    skip = set(skip)
    todo = [(_join(prefix, name), m) for name, m in meta_submodules(model)]
    bad = [f"{name or '<root>'} ({type(m).__name__})" for name, m in todo
           if name not in skip and not callable(getattr(m, "reset_parameters", None))]
    if bad:
        _raise_uninitialisable(bad)
    for name, module in todo:
        if name in skip:
            _allocate(module, device)
        else:
            initialise_submodule(module, name, base, device)
    return model


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def initialise_submodule(module: nn.Module, name: str, seed: int, device: torch.device) -> None:
    """Allocate ``module``'s own meta tensors and run its ``reset_parameters()`` under the RNG of
    ``(seed, name)``. Tensors it already held for real (a parameter shared with a submodule
    initialised earlier) keep their values: a shared tensor is initialised by its first owner."""
    kept = {key: t.detach().clone() for key, t in _own_tensors(module) if t is not None and not t.is_meta}
    _allocate(module, device)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=device.type if rng_devices else "cuda"):
        torch.manual_seed(init_seed(seed, name))
        with torch.no_grad():
            module.reset_parameters()  # type: ignore[operator]
            for key, t in _own_tensors(module):
                if key in kept:
                    t.copy_(kept[key])
