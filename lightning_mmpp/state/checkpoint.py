"""Distributed checkpoints for :class:`~lightning_mmpp.MultiModulePipelineStrategy`, as functions.

After setup each rank's LightningModule holds only the layers it owns, under their original
names, so a rank's state dict is already keyed by the names of the unpartitioned model. A
checkpoint stores every tensor under that name, once, so it can be resumed on any placement
(any pp / dp sizes, any world size) of the same model, and exported to one ordinary Lightning
``.ckpt`` file. The strategy's checkpoint hooks call the functions of this module.

On-disk layout (format 2)
-------------------------

A checkpoint is a directory (``ModelCheckpoint`` names it ``epoch=0-step=3.ckpt``; it is a
directory all the same)::

    <checkpoint>/
        .metadata          torch.distributed.checkpoint (DCP) index: every key, its shape, dtype
                           and the file holding it
        __<r>_0.distcp     DCP data written by rank r (empty when r writes nothing)
        meta.pt            torch.save, written by rank 0: the rest of Lightning's checkpoint dict
        rng_rank<r>.pt     torch.save, written by rank r: the RNG states of rank r
        manifest.json      JSON, written last by rank 0: {"format": 2, "checksum": "crc32",
                           "files": {<name>: {"size": <bytes>, "crc32": "<8 hex digits>"}}}
                           for every other file

DCP keys (a flat dict; ``<name>`` is the original parameter / buffer name, ``<i>`` the optimizer
index, ``<key>`` the optimizer's per-parameter state key)::

    model/<name>               a tensor of the LightningModule's state_dict   model/llm.3.lin.weight
    optim/<i>/<name>/<key>     per-parameter optimizer state                  optim/0/llm.3.lin.weight/exp_avg

Writers: the rank holding data-parallel replica 0 of a module's stage (its tp lead, with tp > 1)
writes that stage's model and optimizer entries; entries outside every module (top-level
buffers) are written by rank 0; DTensor entries (sharded or tensor-parallel modules) are handed
to DCP by every rank, which writes each shard once, so a checkpoint resumes on any tp.
Every tensor is stored exactly once, whatever the dp sizes. Names come from torch's
``get_model_state_dict`` / ``get_optimizer_state_dict`` (canonical parameter names). A tied
parameter (``head.weight = embed.weight``, one copy per owning stage) is stored once, model
entry and optimizer state, under its canonical name: the first in the unpartitioned model's
``named_parameters()`` order; its other names are listed in ``meta.pt`` (``"aliases"``) and
resolve to it on loading and exporting.

``meta.pt`` holds Lightning's checkpoint dict without ``state_dict`` (loops, callbacks, epoch,
global step, hyper-parameters, LR schedulers, precision plugin state, whatever
``on_save_checkpoint`` hooks add: these are identical on every rank, so rank 0's copy is saved),
where ``optimizer_states[i]`` is ``{"param_groups": [{<hyper-parameters>, "params": [names]}]}``:
each group's hyper-parameters and the names of all its parameters (over all ranks) in the order
of the model's parameters (``named_parameters()`` of the unpartitioned model, which is the
order ``self.parameters()`` gives a single-process optimizer); the per-parameter state is in
DCP. It also holds ``"mmpp"``: ``{"format": 2, "world_size": N, "placements": ...,
"topology": ..., "state_dict_keys": [...], "reordered_groups": [[i, g], ...],
"aliases": {name: canonical name}}``; ``reordered_groups`` lists groups whose parameters some
rank's optimizer holds in another order than the model's; optimizer groups list a tied
parameter once, by its canonical name.

``rng_rank<r>.pt``: ``{"torch": ByteTensor, "python": ..., "numpy": ..., "cuda": ...}`` of rank
r, restored on rank r when fitting resumes (a rank beyond the saved world size keeps its seed).

Writing: into a hidden sibling directory, published under the checkpoint's name by one atomic
rename only when every rank's files, ``meta.pt`` and the manifest are complete and flushed, so
a crash leaves the previous checkpoint of that name or the new one, never a mixture (see
:mod:`lightning_mmpp.model.checkpoint_files`).

Reading: every file read is first checked against the manifest (present, same size, same
CRC32). The DCP index is unpickled with an allow-list of its own plain classes, ``meta.pt``
and the DCP entries that are not tensors with ``torch.load(weights_only=True)`` unless the
caller passes ``weights_only=False``, the RNG files always with ``weights_only=True``: loading
a checkpoint never runs code stored in it by default. Names and shapes are checked against the
model before any tensor is read, on every rank together, so any problem raises the same
:class:`PipelineConfigError` everywhere instead of hanging.

Export: :func:`export_checkpoint` (or ``python -m lightning_mmpp.state.export CKPT_DIR OUT.ckpt``)
writes one ordinary Lightning checkpoint: the full ``state_dict`` and index-keyed optimizer
states, loadable with ``MyModule.load_from_checkpoint(OUT.ckpt)`` or a single-process
``Trainer.fit(ckpt_path=OUT.ckpt)``. :func:`read_checkpoint_tensors` reads named tensors of a
checkpoint on one process (pretrained weights).
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from lightning_mmpp.model.checkpoint_files import (
    FileRecord,
    dcp_load,
    file_record,
    interrupted_replacement,
    publish,
    read_dcp_metadata,
    read_manifest,
    remove_directory,
    safe_torch_load,
    staging_directory,
    torch_save_durably,
    verify_files,
    write_manifest,
)
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout

__all__ = [
    "export_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "load_optimizer_states",
    "model_state_dict",
    "optimizer_state_by_name",
    "read_checkpoint_tensors",
    "remove_checkpoint",
    "save_checkpoint",
]

FORMAT_VERSION = 2
META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"

PathLike = Union[str, "os.PathLike[str]"]


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _model_key(name: str) -> str:
    return MODEL_PREFIX + name


def _optim_key(index: int, name: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{index}/{name}/{key}"


def _parse_optim_key(fqn: str) -> tuple[int, str, str]:
    """``optim/<i>/<name>/<key>`` -> ``(i, name, key)`` (a name may itself contain '/')."""
    index, rest = fqn[len(OPTIM_PREFIX):].split("/", 1)
    name, key = rest.rsplit("/", 1)
    return int(index), name, key


def _group_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the torch one


# --- collectives (the default process group; one process without it) ---------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _raise_first(reports: Sequence[Optional[tuple[str, str]]], own: Optional[BaseException], rank: int) -> None:
    """Raise on every rank when any rank failed: the first failing rank's error."""
    failed = [(r, error) for r, error in enumerate(reports) if error is not None]
    if not failed:
        return
    first_rank, (kind, message) = failed[0]
    if own is not None and rank == first_rank:
        raise own
    cls = {"FileNotFoundError": FileNotFoundError, "PipelineConfigError": PipelineConfigError, "OSError": OSError}.get(
        kind
    )
    if cls is not None:
        raise cls(message) from own
    raise RuntimeError(f"rank {first_rank} failed: {kind}: {message}") from own


def _report(exc: Optional[BaseException]) -> Optional[tuple[str, str]]:
    """What a rank tells its peers about its failure: the kind (as ``_raise_first`` rebuilds it) and message."""
    if exc is None:
        return None
    if isinstance(exc, (FileNotFoundError, PipelineConfigError)):
        return type(exc).__name__, str(exc)
    return ("OSError" if isinstance(exc, OSError) else type(exc).__name__), str(exc)


# --- state by name -------------------------------------------------------------------------------


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's model state: the layers it owns, under their canonical original names."""
    return get_model_state_dict(model)


def optimizer_state_by_name(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name: ``{"state": {name: {key: value}},
    "param_groups": [{<hyper-parameters>, "params": [names]}]}`` (torch's ``get_optimizer_state_dict``).

    An optimizer that has not stepped yet has no state: torch's helper would create it with a
    zero-gradient step, which changes what the next real step does (Adam's step count), so the
    names are read without touching it.
    """
    opt = _unwrap(optimizer)
    if opt.state:
        return get_optimizer_state_dict(model, opt)
    names = {p: n for n, p in model.named_parameters()}
    groups = []
    for group in opt.param_groups:
        if any(p not in names for p in group["params"]):
            raise PipelineConfigError(
                "an optimizer holds a parameter that is not a parameter of the LightningModule; pipeline "
                "checkpoints key optimizer state by parameter name. Build the optimizer from self.parameters()."
            )
        groups.append({**_group_hyperparameters(group), "params": [names[p] for p in group["params"]]})
    return {"state": {}, "param_groups": groups}


def _local_optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Name-keyed state with live tensors to read a checkpoint into (torch initialises missing
    state with a zero step; the loaded state replaces it)."""
    return get_optimizer_state_dict(model, optimizer)


def _order_keys(model: nn.Module, layout: PipelineLayout, rank: int, names: Sequence[str]) -> dict[str, tuple]:
    """A key per name that sorts names of all ranks into the unpartitioned model's order.

    The model's own entries come first, then its child modules in attribute order; inside a
    pipelined module stage s precedes stage s+1 and a rank lists its own stage in order. A rank
    holding several chunks of a module (virtual stages) holds stages that are not adjacent: its
    layers are ordered by their index in the module (the name of a Sequential's or a
    ModuleList's layer), which interleaves them with the other ranks' chunks.
    """
    children = {name: i for i, name in enumerate(model._modules)}
    keys: dict[str, tuple] = {}
    position: dict[tuple[int, int], int] = {}
    for name in names:
        top = name.split(".", 1)[0]
        child = children.get(top, -1) if "." in name else -1
        slot = layout.slot(rank, top) if top in layout.placements else None
        layer = name.split(".")[1] if name.count(".") >= 2 else ""
        if slot is not None and layout.placements[top].virtual_stages > 1 and layer.isdigit():
            group = (child, int(layer))
        else:
            group = (child, slot.stage if slot is not None else 0)
        position[group] = position.get(group, -1) + 1
        keys[name] = (*group, position[group])
    return keys


def parameter_aliases(model: nn.Module, ties: Sequence[Any] = ()) -> dict[str, str]:
    """``{name: canonical name}`` for every parameter this rank knows under more than one name.

    A tied parameter (``head.weight = embed.weight``) is one tensor with several names; its
    canonical name is the first in the unpartitioned model's ``named_parameters()`` order, the
    name a single-process optimizer and ``state_dict`` loading know it by. ``ties`` are the ties
    across stages found before partitioning (``Partition.tied``: ``.names`` in that order);
    ties inside this rank's layers are found by identity.
    """
    aliases: dict[str, str] = {}
    for tie in ties:
        for name in tie.names[1:]:
            aliases[name] = tie.names[0]
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases.setdefault(name, aliases.get(canonical, canonical))
    return aliases


# --- saving --------------------------------------------------------------------------------------


def _is_local_path(path: str) -> bool:
    """A plain path or a ``file://`` URL (not ``s3://``, ``gs://``, ...)."""
    scheme, sep, _ = path.partition("://")
    return not sep or scheme in ("file", "local")


def optimizer_state_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move an optimizer's state tensors to ``device``; ``step`` counters stay where the
    optimizer keeps them (a CPU scalar unless ``capturable``)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, Tensor):
                state[key] = value.to(device)


def _local_path(path: PathLike) -> Path:
    text = os.fspath(path)
    if not _is_local_path(text):
        raise PipelineConfigError(
            f"checkpoint path {text!r}: MultiModulePipelineStrategy writes checkpoints with "
            "torch.distributed.checkpoint's FileSystemWriter, to a local or shared file system path; remote URLs "
            "are not supported. Save to a path every rank can reach and copy it afterwards."
        )
    return Path(text.removeprefix("file://"))


def _writes(layout: PipelineLayout, rank: int, name: str) -> bool:
    """Whether ``rank`` is the one rank that writes the (non-DTensor) entries of ``name``."""
    module = name.split(".", 1)[0]
    slot = layout.slot(rank, module) if module in layout.placements else None
    if slot is None:
        return rank == 0  # outside every module: identical everywhere
    return slot.replica == 0 and slot.tp_index == 0  # a tp group's replicated entries: its lead


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(value, DTensor)


def _rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, as plain data (loads with ``weights_only=True``)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch in practice
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached),
        }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _merge_in_order(per_rank: Sequence[Mapping[str, tuple]]) -> list[str]:
    keys: dict[str, tuple] = {}
    for ranked in per_rank:
        for name, key in ranked.items():
            keys.setdefault(name, key)
    return sorted(keys, key=lambda name: keys[name])


def _meta(
    checkpoint: Mapping[str, Any], gathered: Sequence[Mapping[str, Any]], layout: PipelineLayout
) -> dict[str, Any]:
    """Rank 0's ``meta.pt`` contents (see the module docstring)."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    order = {name: key for report in gathered for name, key in report["order"].items()}
    aliases = {alias: name for report in gathered for alias, name in report["aliases"].items()}
    reordered: list[list[int]] = []
    if checkpoint.get("optimizer_states") is not None:
        states = []
        for i, opt_state in enumerate(checkpoint["optimizer_states"]):
            groups = []
            for g, group in enumerate(opt_state["param_groups"]):
                # a tied parameter is one entry, under its canonical name (as in one process)
                names = list(dict.fromkeys(aliases.get(n, n) for report in gathered for n in report["groups"][i][g]))
                names.sort(key=lambda n: order.get(n, (len(order),)))
                for report in gathered:
                    local = list(dict.fromkeys(aliases.get(n, n) for n in report["groups"][i][g]))
                    if local != [n for n in names if n in set(local)]:
                        reordered.append([i, g])
                        break
                groups.append({**_group_hyperparameters(group), "params": names})
            states.append({"param_groups": groups})
        meta["optimizer_states"] = states
    meta["mmpp"] = {
        "format": FORMAT_VERSION,
        "world_size": len(gathered),
        "placements": {
            m: {"pp": p.pp, "dp": p.dp, "rank_offset": layout.offsets[m],
                "split_points": list(p.split_points) if p.split_points is not None else None,
                "shard": p.shard, "recompute": p.recompute, "virtual_stages": p.virtual_stages}
            for m, p in layout.placements.items()
        },
        "topology": {m: list(layout.topology.downstream(m)) for m in layout.modules},
        "state_dict_keys": _merge_in_order([report["order"] for report in gathered]),
        "reordered_groups": reordered,
        "aliases": aliases,
    }
    return meta


def save_checkpoint(
    checkpoint: Mapping[str, Any],
    filepath: PathLike,
    *,
    model: nn.Module,
    layout: PipelineLayout,
    rank: int,
    device: torch.device,
    ties: Sequence[Any] = (),
) -> None:
    """Write Lightning's ``checkpoint`` dict as a checkpoint directory at ``filepath``, crash-safely.

    Every rank must call this with its own ``checkpoint`` (``state_dict`` from
    :func:`model_state_dict`, ``optimizer_states`` from :func:`optimizer_state_by_name`).
    ``ties``: parameters tied across stages (see :func:`parameter_aliases`), stored once.
    A failure on any rank raises on every rank and leaves what was at ``filepath`` untouched.
    """
    final = _local_path(_broadcast(os.fspath(filepath)))  # one path for all ranks
    staging: Optional[Path] = None
    problem: Optional[str] = None
    if rank == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = staging_directory(final)
            staging.mkdir()
        except OSError as exc:
            problem = f"cannot write the checkpoint {str(final)!r}: {type(exc).__name__}: {exc}"
    staging, problem = _broadcast((staging, problem))
    if problem is not None:
        raise OSError(problem)
    assert staging is not None
    try:
        _write_files(checkpoint, staging, final, model=model, layout=layout, rank=rank, device=device, ties=ties)
    except BaseException:
        if rank == 0:
            remove_directory(staging)
        raise


def _write_files(
    checkpoint: Mapping[str, Any],
    staging: Path,
    final: Path,
    *,
    model: nn.Module,
    layout: PipelineLayout,
    rank: int,
    device: torch.device,
    ties: Sequence[Any],
) -> None:
    state_dict: Mapping[str, Any] = checkpoint.get("state_dict", {})
    optimizer_states: Optional[Sequence[Mapping[str, Any]]] = checkpoint.get("optimizer_states")
    aliases = parameter_aliases(model, ties)  # other names of a tied parameter: stored once, canonically
    flat: dict[str, Any] = {}
    for name, value in state_dict.items():
        if name not in aliases and (_is_dtensor(value) or _writes(layout, rank, name)):
            flat[_model_key(name)] = value
    for i, opt_state in enumerate(optimizer_states or []):
        for name, per_param in opt_state["state"].items():
            if name in aliases:
                continue
            for key, value in per_param.items():
                if _is_dtensor(value) or _writes(layout, rank, name):
                    flat[_optim_key(i, name, key)] = value

    # 1. data: DCP files (a collective; DCP reports any rank's failure on every rank), RNG file
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=not _distributed())
    error: Optional[BaseException] = None
    records: dict[str, FileRecord] = {}
    try:
        torch_save_durably(_rng_state(device), staging / _rng_file(rank))
        records = _records_of_rank(staging, rank)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    report = {
        "error": _report(error),
        "records": records,
        "order": _order_keys(model, layout, rank, list(state_dict)),
        "aliases": aliases,
        "groups": [[list(g["params"]) for g in s["param_groups"]] for s in optimizer_states or []],
    }
    # 2. every rank's files are complete and flushed
    gathered = _all_gather(report)
    _raise_first([r["error"] for r in gathered], error, rank)

    # 3. rank 0: meta.pt, manifest.json (the completion mark), one atomic rename
    problem: Optional[BaseException] = None
    if rank == 0:
        try:
            all_records = {name: rec for r in gathered for name, rec in r["records"].items()}
            _write_meta(_meta(checkpoint, gathered, layout), staging)
            for name in (DCP_METADATA_FILE, META_FILE):
                all_records[name] = file_record(staging / name)
            _write_manifest(staging, all_records)
            _publish(staging, final)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            problem = exc
    outcome = _broadcast(_report(problem))
    _raise_first([outcome], problem, rank)


def _records_of_rank(staging: Path, rank: int) -> dict[str, FileRecord]:
    """Sizes and checksums of the files ``rank`` wrote (its DCP files carry its rank as prefix)."""
    prefix = f"__{rank}_" if _distributed() else "__0_"
    names = [p.name for p in staging.iterdir() if p.name.startswith(prefix) and p.name.endswith(".distcp")]
    names.append(_rng_file(rank))
    return {name: file_record(staging / name) for name in sorted(names)}


# the three steps of rank 0's finish, as functions so that tests can interrupt a save between them
def _write_meta(meta: Mapping[str, Any], staging: Path) -> None:
    torch_save_durably(dict(meta), staging / META_FILE)


def _write_manifest(staging: Path, records: Mapping[str, FileRecord]) -> None:
    write_manifest(staging, records, FORMAT_VERSION)


def _publish(staging: Path, final: Path) -> None:
    publish(staging, final)


def remove_checkpoint(filepath: PathLike, *, rank: int) -> None:
    """Rank 0 removes the checkpoint (its name disappears at once), then every rank waits for it."""
    if rank == 0:
        remove_directory(Path(filepath))
    if _distributed():
        dist.barrier()


# --- loading -------------------------------------------------------------------------------------


def _open_checkpoint(path: Path, verify: bool = True) -> tuple[Optional[dict[str, FileRecord]], Metadata]:
    """Check the directory; verify (against the manifest) and read its index safely."""
    if not path.exists():
        aside = interrupted_replacement(path)
        hint = (
            f"; a save that was interrupted while replacing it left the previous checkpoint complete at "
            f"{str(aside)!r}: rename that directory to {path.name!r} to use it" if aside is not None else ""
        )
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist{hint}.")
    if not path.is_dir():
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} is a file; MultiModulePipelineStrategy resumes from the checkpoint "
            "directories it writes (a single-file checkpoint can be loaded with MyModule.load_from_checkpoint "
            "before fitting instead)."
        )
    manifest = read_manifest(path) if verify else None
    if manifest is not None:
        verify_files(path, manifest, [DCP_METADATA_FILE])
    return manifest, read_dcp_metadata(path)


def _read_meta(path: Path, manifest: Mapping[str, FileRecord], weights_only: bool) -> dict[str, Any]:
    """Verify and read ``meta.pt`` (plain data only unless ``weights_only=False``)."""
    verify_files(path, manifest, [META_FILE])
    meta = safe_torch_load(path / META_FILE, weights_only=weights_only, what="Lightning's state", checkpoint=path)
    info = meta.get("mmpp") if isinstance(meta, dict) else None
    if not isinstance(info, dict):
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} was not written by MultiModulePipelineStrategy (its {META_FILE} has no 'mmpp' "
            "entry); resume it with the strategy that wrote it."
        )
    if info.get("format") != FORMAT_VERSION:
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} has format {info.get('format')!r}; this version of lightning_mmpp reads "
            f"format {FORMAT_VERSION}."
        )
    return meta


def _files_holding(metadata: Metadata, fqns: Sequence[str]) -> dict[str, list[str]]:
    """``{file: [keys stored in it]}`` for the files holding any of ``fqns``."""
    wanted = set(fqns)
    holds: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in wanted:
            holds.setdefault(info.relative_path, []).append(index.fqn)
    return {name: sorted(set(keys)) for name, keys in holds.items()}


def _empty_like_stored(md: Any) -> Any:
    """A destination for DCP to load one stored entry into."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None  # bytes: DCP replaces the placeholder with the stored object


def _template(stored: Any, live: Any) -> Any:
    """Load into the live tensor (in place, sharded or not) when it fits, else a fresh one."""
    if isinstance(stored, TensorStorageMetadata) and isinstance(live, Tensor) and tuple(live.shape) == tuple(
        stored.size
    ):
        return live
    return _empty_like_stored(stored)


def _optim_index(metadata: Metadata) -> dict[tuple[int, str], list[tuple[str, str]]]:
    """``{(optimizer index, parameter name): [(state key, fqn), ...]}`` of the stored optimizer state."""
    index: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for fqn in metadata.state_dict_metadata:
        if fqn.startswith(OPTIM_PREFIX):
            i, name, key = _parse_optim_key(fqn)
            index.setdefault((i, name), []).append((key, fqn))
    return index


def _stored_name(name: str, stored: Mapping[str, Any], aliases: Mapping[str, str], prefix: str = MODEL_PREFIX) -> str:
    """The name ``name``'s tensor is stored under: itself, or the canonical name of a tied parameter."""
    return name if prefix + name in stored else aliases.get(name, name)


def _plan_model(
    path: Path, metadata: Metadata, local_state: Mapping[str, Any], strict: bool, aliases: Mapping[str, str]
) -> dict[str, str]:
    """Check this rank's names and shapes against the checkpoint; ``{local name: stored name}`` to read."""
    stored = metadata.state_dict_metadata
    names: dict[str, str] = {}
    for name, value in local_state.items():
        md = stored.get(_model_key(_stored_name(name, stored, aliases)))
        if md is None:
            if strict:
                raise PipelineConfigError(
                    f"checkpoint {str(path)!r} does not match the model: the model's {name!r} is not in the "
                    "checkpoint. Build the model the checkpoint was saved from, or set `strict_loading = False` "
                    "on the LightningModule."
                )
            continue
        if isinstance(value, Tensor) and not isinstance(md, TensorStorageMetadata):
            raise PipelineConfigError(
                f"checkpoint {str(path)!r} does not match the model: {name!r} is a tensor in the model but not "
                "in the checkpoint."
            )
        if isinstance(value, Tensor) and tuple(value.shape) != tuple(md.size):
            raise PipelineConfigError(
                f"checkpoint {str(path)!r} does not match the model: {name!r} has shape {tuple(md.size)} in the "
                f"checkpoint but {tuple(value.shape)} in the model."
            )
        names[name] = _stored_name(name, stored, aliases)
    return names


def _plan_optimizers(
    path: Path,
    metadata: Metadata,
    saved: Sequence[Mapping[str, Any]],
    templates: Sequence[Mapping[str, Any]],
    aliases: Mapping[str, str],
) -> list[dict[str, Any]]:
    """Per optimizer: which stored entries to read for which of its parameters, and its groups."""
    if len(saved) != len(templates):
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} holds {len(saved)} optimizer(s) but configure_optimizers returns "
            f"{len(templates)}; resume with the optimizers the checkpoint was saved with."
        )
    stored = _optim_index(metadata)
    plans = []
    for i, (template, saved_opt) in enumerate(zip(templates, saved)):
        saved_groups = saved_opt["param_groups"]
        if len(saved_groups) != len(template["param_groups"]):
            raise PipelineConfigError(
                f"checkpoint {str(path)!r}: optimizer {i} has {len(saved_groups)} parameter group(s) in the "
                f"checkpoint but {len(template['param_groups'])} now; resume with the same param groups."
            )
        entries: dict[str, list[tuple[str, str]]] = {}
        for g, (group, saved_group) in enumerate(zip(template["param_groups"], saved_groups)):
            members = set(saved_group["params"])
            for name in group["params"]:
                canonical = aliases.get(name, name)  # a tied parameter's copy: its canonical entry
                if name not in members and canonical not in members:
                    raise PipelineConfigError(
                        f"checkpoint {str(path)!r}: parameter {name!r} is in group {g} of optimizer {i} but not "
                        "in that group in the checkpoint; resume with the same param groups."
                    )
                for candidate in (name, canonical):
                    if (i, candidate) in stored:
                        entries[name] = stored[(i, candidate)]
                        break
        plans.append({"entries": entries, "saved_groups": saved_groups})
    return plans


def load_checkpoint(
    checkpoint_path: PathLike,
    *,
    model: nn.Module,
    optimizers: Sequence[Any],
    layout: PipelineLayout,
    rank: int,
    device: torch.device,
    fitting: bool,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    ties: Sequence[Any] = (),
) -> dict[str, Any]:
    """Read the parameters (and, when ``fitting``, optimizer state and RNG) this rank owns.

    Every rank must call this. The model's tensors are read in place; the returned Lightning
    checkpoint dict holds them as ``state_dict`` and, when fitting, ``optimizer_states`` keyed by
    name (for :func:`load_optimizer_states`). ``weights_only=None`` means ``True``: see the module
    docstring. Any problem raises the same error on every rank before any tensor is read.
    """
    path_text = _broadcast(os.fspath(checkpoint_path))  # one path for all ranks
    local_state = model_state_dict(model)
    opts = [_unwrap(o) for o in optimizers]
    unsafe = weights_only is False

    # 1. every check that can fail, before any tensor is read; all ranks agree on the outcome
    failure: Optional[BaseException] = None
    plan: Optional[_LoadPlan] = None
    try:
        plan = _plan_load(path_text, model, opts, local_state, rank, fitting, strict, unsafe, ties)
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        failure = exc
    canonical = [plan.model.get(k, k) for k in local_state] if plan is not None else []
    reports = _all_gather({"error": _report(failure), "keys": list(local_state) + canonical})
    _raise_first([r["error"] for r in reports], failure, rank)
    assert plan is not None
    if strict:
        _check_nothing_unexpected(plan, {k for r in reports for k in r["keys"]})

    # 2. read this rank's entries (a collective), into the live tensors where they fit
    flat = _read_planned(plan, local_state, unsafe)
    checkpoint = _checkpoint_dict(plan, flat)
    if plan.rng is not None:
        _set_rng_state(plan.rng, device)
    return checkpoint


@dataclass
class _LoadPlan:
    """What :func:`load_checkpoint` reads on this rank, all checked before any tensor is read."""

    path: Path
    metadata: Metadata
    meta: dict[str, Any]
    model: dict[str, str]  # {local name: stored name}
    templates: list[dict[str, Any]] = field(default_factory=list)  # local optimizer state templates
    optimizers: Optional[list[dict[str, Any]]] = None  # per optimizer: entries to read, saved groups
    rng: Optional[dict[str, Any]] = None  # this rank's saved RNG states


def _plan_load(
    path_text: str, model: nn.Module, opts: Sequence[torch.optim.Optimizer], local_state: Mapping[str, Any],
    rank: int, fitting: bool, strict: bool, unsafe: bool, ties: Sequence[Any],
) -> _LoadPlan:
    """Open and verify the checkpoint and match it against this rank's model and optimizers."""
    path = _local_path(path_text)
    manifest, metadata = _open_checkpoint(path)
    assert manifest is not None
    meta = _read_meta(path, manifest, weights_only=not unsafe)
    aliases = {**meta["mmpp"].get("aliases", {}), **parameter_aliases(model, ties)}
    plan = _LoadPlan(path, metadata, meta, _plan_model(path, metadata, local_state, strict, aliases))
    fqns = list(dict.fromkeys(_model_key(n) for n in plan.model.values()))
    if fitting and "optimizer_states" in meta:
        plan.templates = [_local_optimizer_template(model, opt) for opt in opts]
        plan.optimizers = _plan_optimizers(path, metadata, meta["optimizer_states"], plan.templates, aliases)
        fqns += [fqn for p in plan.optimizers for entries in p["entries"].values() for _, fqn in entries]
    holds = _files_holding(metadata, fqns)
    verify_files(path, manifest, list(holds), holds)
    if fitting and rank < int(meta["mmpp"].get("world_size", 0)):  # a rank beyond it keeps its seed
        verify_files(path, manifest, [_rng_file(rank)])
        plan.rng = safe_torch_load(path / _rng_file(rank), weights_only=True, what="RNG states", checkpoint=path)
    return plan


def _check_nothing_unexpected(plan: _LoadPlan, owned: set[str]) -> None:
    """Strict loading: every model entry of the checkpoint is some rank's (``owned``: every rank's names)."""
    unexpected = [
        fqn[len(MODEL_PREFIX):] for fqn in plan.metadata.state_dict_metadata
        if fqn.startswith(MODEL_PREFIX) and fqn[len(MODEL_PREFIX):] not in owned
    ]
    if unexpected:
        raise PipelineConfigError(
            f"checkpoint {str(plan.path)!r} does not match the model: it holds {unexpected[0]!r}, which the model "
            f"does not have ({len(unexpected)} such entries). Build the model the checkpoint was saved from, "
            "or set `strict_loading = False` on the LightningModule."
        )


def _read_planned(plan: _LoadPlan, local_state: Mapping[str, Any], unsafe: bool) -> dict[str, Any]:
    """Read the planned entries (a collective): ``{stored key: tensor}``, into live tensors where they fit."""
    stored = plan.metadata.state_dict_metadata
    flat: dict[str, Any] = {}
    for name, stored_name in plan.model.items():
        flat[_model_key(stored_name)] = _template(stored[_model_key(stored_name)], local_state[name])
    for i, opt_plan in enumerate(plan.optimizers or []):
        live = plan.templates[i]["state"]
        for name, entries in opt_plan["entries"].items():
            for key, fqn in entries:
                flat[fqn] = _template(stored[fqn], live.get(name, {}).get(key))
    dcp_load(flat, plan.path, distributed=_distributed(), weights_only=not unsafe)
    return flat


def _checkpoint_dict(plan: _LoadPlan, flat: Mapping[str, Any]) -> dict[str, Any]:
    """The Lightning checkpoint dict: the saved metadata, ``state_dict`` and name-keyed ``optimizer_states``."""
    checkpoint = dict(plan.meta)
    checkpoint["state_dict"] = {name: flat[_model_key(stored_name)] for name, stored_name in plan.model.items()}
    if plan.optimizers is not None:
        checkpoint["optimizer_states"] = [
            {
                "state": {name: {key: flat[fqn] for key, fqn in entries} for name, entries in p["entries"].items()},
                "param_groups": [
                    {**_group_hyperparameters(saved), "params": list(group["params"])}
                    for group, saved in zip(plan.templates[i]["param_groups"], p["saved_groups"])
                ],
            }
            for i, p in enumerate(plan.optimizers)
        ]
    return checkpoint


def load_model_state(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load a name-keyed state dict into this rank's part of the model."""
    set_model_state_dict(model, dict(state_dict), options=StateDictOptions(strict=strict))


def load_optimizer_states(
    model: nn.Module, optimizers: Sequence[Any], states: Sequence[Mapping[str, Any]], device: torch.device
) -> None:
    """Load name-keyed optimizer states (from :func:`load_checkpoint`) into this rank's optimizers.

    torch's ``set_optimizer_state_dict`` refuses optimizers with more than one empty parameter
    group, which partitioning creates (a rank holds none of a group's parameters), so the names
    are mapped to the optimizer's positions here and ``Optimizer.load_state_dict`` does the rest.
    """
    for optimizer, state in zip(optimizers, states):
        opt = _unwrap(optimizer)
        position: dict[str, int] = {}
        groups = []
        for group in state["param_groups"]:
            ids = []
            for name in group["params"]:
                position[name] = len(position)
                ids.append(position[name])
            groups.append({**_group_hyperparameters(group), "params": ids})
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
            raise PipelineConfigError(
                "the optimizer's parameter groups changed between loading the checkpoint and restoring it"
            )
        by_position = {position[name]: dict(s) for name, s in state["state"].items()}
        opt.load_state_dict({"state": by_position, "param_groups": groups})
        optimizer_state_to_device(opt, device)


# --- one process: tensors by name, export ----------------------------------------------------------


def read_checkpoint_tensors(
    checkpoint_dir: PathLike, names: Optional[Sequence[str]] = None, *, prefix: str = MODEL_PREFIX,
    weights_only: bool = True, verify: bool = True,
) -> dict[str, Any]:
    """Read entries of a checkpoint directory on one process (no process group), verified.

    Args:
        checkpoint_dir: a directory written by :class:`~lightning_mmpp.MultiModulePipelineStrategy`.
        names: the entries to read, without ``prefix`` (default: all under ``prefix``).
        prefix: ``"model/"`` for the model's state (parameter names as in ``model.state_dict()``),
            ``"optim/"`` for optimizer entries, ``""`` for raw DCP keys.
        weights_only: ``False`` also unpickles non-tensor entries holding arbitrary objects.
        verify: ``False`` reads a DCP directory without a manifest (one not written by this
            package); the index is still read safely.

    Returns:
        ``{name: tensor or value}``. Only the files holding these entries are read, after their
        size and CRC32 were checked against the manifest (``meta.pt`` is not read). Unknown
        names raise ``PipelineConfigError``.
    """
    path = _local_path(checkpoint_dir)
    manifest, metadata = _open_checkpoint(path, verify=verify)
    stored = metadata.state_dict_metadata
    wanted = [fqn[len(prefix):] for fqn in stored if fqn.startswith(prefix)] if names is None else list(names)
    missing = [n for n in wanted if prefix + n not in stored]
    if missing:
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} has no entry {prefix + missing[0]!r} ({len(missing)} requested names are "
            "missing)."
        )
    flat = _read_entries(path, manifest, metadata, [prefix + n for n in wanted], weights_only)
    return {n: flat[prefix + n] for n in wanted}


def _read_entries(
    path: Path, manifest: Optional[Mapping[str, FileRecord]], metadata: Metadata, fqns: Sequence[str],
    weights_only: bool,
) -> dict[str, Any]:
    """Verify the files holding ``fqns`` (with a manifest) and read them on this process alone."""
    if manifest is not None:
        holds = _files_holding(metadata, fqns)
        verify_files(path, manifest, list(holds), holds)
    flat = {fqn: _empty_like_stored(metadata.state_dict_metadata[fqn]) for fqn in fqns}
    dcp_load(flat, path, distributed=False, weights_only=weights_only)
    return flat


def export_checkpoint(checkpoint_dir: PathLike, out_path: PathLike, *, weights_only: Optional[bool] = None) -> Path:
    """Turn a pipeline checkpoint directory into one ordinary Lightning checkpoint file.

    The file holds the full ``state_dict`` (original names), the optimizer states index-keyed
    in the model's parameter order (see the module docstring), and everything else Lightning
    saved (loops, callbacks, hyper-parameters, LR schedulers). Load it with
    ``MyModule.load_from_checkpoint`` or resume from it with a single-process
    ``Trainer.fit(ckpt_path=...)``. Runs on one process; needs no process group.

    Args:
        checkpoint_dir: a directory written by :class:`~lightning_mmpp.MultiModulePipelineStrategy`.
        out_path: the file to write.
        weights_only: ``None``/``True``: read ``meta.pt`` and non-tensor entries as plain data
            only; ``False``: unpickle any object in them (runs code stored there: trusted
            checkpoints only).

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.
    """
    path = _local_path(checkpoint_dir)
    unsafe = weights_only is False
    manifest, metadata = _open_checkpoint(path)
    assert manifest is not None
    meta = _read_meta(path, manifest, weights_only=not unsafe)
    fqns = [fqn for fqn in metadata.state_dict_metadata if fqn.startswith((MODEL_PREFIX, OPTIM_PREFIX))]
    flat = _read_entries(path, manifest, metadata, fqns, not unsafe)

    info = meta.get("mmpp", {})
    checkpoint = {k: v for k, v in meta.items() if k != "mmpp"}
    order = list(dict.fromkeys(
        [*info.get("state_dict_keys", []), *(f[len(MODEL_PREFIX):] for f in flat if f.startswith(MODEL_PREFIX))]
    ))
    aliases = info.get("aliases", {})
    checkpoint["state_dict"] = {
        name: flat[_model_key(_stored_name(name, flat, aliases))]
        for name in order if _model_key(_stored_name(name, flat, aliases)) in flat
    }

    if "optimizer_states" in meta:
        for i, g in info.get("reordered_groups", []):
            warnings.warn(
                f"{str(path)!r}: some rank's optimizer {i} held group {g}'s parameters in another order than the "
                "model's; the exported optimizer state is indexed in the model's order (what self.parameters() "
                "gives). Build the single-process optimizer that way, or load only the weights.",
                stacklevel=2,
            )
        stored = _optim_index_of(flat)
        optimizer_states = []
        for i, saved in enumerate(meta["optimizer_states"]):
            names = [n for group in saved["param_groups"] for n in group["params"]]
            index = {n: j for j, n in enumerate(names)}
            state = {index[n]: {key: flat[fqn] for key, fqn in stored[(i, n)]} for n in names if (i, n) in stored}
            groups = [
                {**_group_hyperparameters(group), "params": [index[n] for n in group["params"]]}
                for group in saved["param_groups"]
            ]
            optimizer_states.append({"state": state, "param_groups": groups})
        checkpoint["optimizer_states"] = optimizer_states

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out)
    return out


def _optim_index_of(flat: Mapping[str, Any]) -> dict[tuple[int, str], list[tuple[str, str]]]:
    index: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for fqn in flat:
        if fqn.startswith(OPTIM_PREFIX):
            i, name, key = _parse_optim_key(fqn)
            index.setdefault((i, name), []).append((key, fqn))
    return index
