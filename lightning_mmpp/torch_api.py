"""torch's private API, touched here and nowhere else in the package.

torch 2.13 has no public pytree module, and payloads (any dict / list / tuple of tensors that
crosses a stage or module boundary) are pytrees, so the package takes the few pytree functions
it needs from ``torch.utils._pytree`` through this module; and the failure board
(:mod:`lightning_mmpp.engine.failures`) reads the default process group's store, which torch
exposes only as a private function; and a tp rank that drops a layer output it does not send
waits for the functional collective behind it (:func:`wait_collective`), which torch's
``AsyncCollectiveTensor`` does only when the tensor is used; and the communicator posts its
point-to-point transfers on a backend that does not coalesce them (gloo) straight on the process
group (:func:`direct_p2p`), without the per-call wrappers of ``dist.isend`` and
``batch_isend_irecv``. ``tests/test_torch_api.py`` pins the
behaviour relied on (flatten order of dicts, lists and tuples; round trips; key paths), so a torch
release that changes it fails there first. The supported range is pyproject.toml's ``torch`` pin.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.utils._pytree import (
    GetAttrKey,
    LeafSpec,
    MappingKey,
    SequenceKey,
    TreeSpec,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
    treespec_leaf,
)

__all__ = [
    "GetAttrKey",
    "LeafSpec",
    "MappingKey",
    "SequenceKey",
    "TreeSpec",
    "default_store",
    "direct_p2p",
    "wait_collective",
    "keystr",
    "register_pytree_node",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "treespec_leaf",
]


def default_store() -> Optional[Any]:
    """The default process group's key-value store, or ``None`` (no process group, or a backend
    without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a backend without a store
        return None


def wait_collective(tensor: Any) -> None:
    """Wait for the functional collective that produces ``tensor``, if any (an
    ``AsyncCollectiveTensor``, what DTensor's ``to_local`` returns after a redistribution);
    otherwise do nothing. A result that is never used is otherwise never waited for, and the
    process group warns at exit about every such call."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(tensor, AsyncCollectiveTensor):
        tensor.wait()


def direct_p2p(group: Optional[Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(send, recv)``: post one tensor to / from a *global* rank on ``group`` (``None``: the
    default group) with a tag (default 0; gloo matches a pair's sends and receives per tag, in
    order), returning the backend's work.

    Exactly what ``dist.batch_isend_irecv`` does per op on a backend that does not coalesce
    (gloo: ``group.send([tensor], group_peer, tag)``), without the per-call argument checks,
    group lookups and ``P2POp`` objects (about 30 us per op on a 2-core VM). Only for such a
    backend: NCCL batches must go through ``batch_isend_irecv``.
    """
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    group_ranks: dict[int, int] = {}

    def group_rank(peer: int) -> int:
        local = group_ranks.get(peer)
        if local is None:
            local = peer if group is None else dist.get_group_rank(group, peer)
            group_ranks[peer] = local
        return local

    def send(tensor: Any, peer: int, tag: int = 0) -> Any:
        return pg.send([tensor], group_rank(peer), tag)

    def recv(tensor: Any, peer: int, tag: int = 0) -> Any:
        return pg.recv([tensor], group_rank(peer), tag)

    return send, recv
