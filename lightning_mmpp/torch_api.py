"""torch's private API, touched here and nowhere else in the package.

torch 2.13 has no public pytree module, and payloads (any dict / list / tuple of tensors that
crosses a stage or module boundary) are pytrees, so the package takes the few pytree functions
it needs from ``torch.utils._pytree`` through this module. ``tests/test_torch_api.py`` pins the
behaviour relied on (flatten order of dicts, lists and tuples; round trips; key paths), so a torch
release that changes it fails there first. The supported range is pyproject.toml's ``torch`` pin.
"""

from __future__ import annotations

from torch.utils._pytree import (
    LeafSpec,
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
    treespec_leaf,
)

__all__ = [
    "LeafSpec",
    "TreeSpec",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "treespec_leaf",
]
