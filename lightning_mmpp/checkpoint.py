"""Distributed checkpoints for :class:`~lightning_mmpp.MultiModulePipelineStrategy`.

After setup each rank's LightningModule holds only the layers it owns, under their original
names, so a rank's ``state_dict()`` is already keyed by the names of the unpartitioned model.
A checkpoint stores every tensor under that name, once, so it can be resumed on any placement
(any pp / dp sizes, any world size) of the same model, and exported to one ordinary Lightning
``.ckpt`` file.

On-disk layout
--------------

A checkpoint is a directory (``ModelCheckpoint`` names it ``epoch=0-step=3.ckpt``; it is a
directory all the same)::

    <checkpoint>/
        .metadata          torch.distributed.checkpoint (DCP) index: every key, its shape, dtype
                           and the file holding it
        __<r>_0.distcp     DCP data written by rank r (empty when r writes nothing)
        meta.pt            torch.save, written by rank 0: the rest of Lightning's checkpoint dict
        rng_rank<r>.pt     torch.save, written by rank r: the RNG states of rank r

DCP keys (a flat dict; ``<name>`` is the original parameter / buffer name, ``<i>`` the optimizer
index, ``<key>`` the optimizer's per-parameter state key)::

    model/<name>               a tensor of the LightningModule's state_dict   model/llm.3.lin.weight
    optim/<i>/<name>/<key>     per-parameter optimizer state                  optim/0/llm.3.lin.weight/exp_avg

Writers: the rank holding data-parallel replica 0 of a module's stage writes that stage's model
and optimizer entries; entries outside every module (top-level buffers) are written by rank 0.
Every tensor is stored exactly once, whatever the dp sizes.

``meta.pt`` holds Lightning's checkpoint dict without ``state_dict`` (loops, callbacks, epoch,
global step, hyper-parameters, LR schedulers, precision plugin state, whatever
``on_save_checkpoint`` hooks add: these are identical on every rank, so rank 0's copy is saved),
where ``optimizer_states[i]`` is ``{"param_groups": [{<hyper-parameters>, "params": [names]}]}``:
each group's hyper-parameters and the names of all its parameters (over all ranks) in the order
of the unpartitioned optimizer; the per-parameter state is in DCP. It also holds ``"mmpp"``:
``{"format": 1, "world_size": N, "placements": ..., "topology": ..., "state_dict_keys": [...]}``.

``rng_rank<r>.pt``: ``{"torch": ByteTensor, "python": ..., "numpy": ..., "cuda": ...}`` of rank
r, restored on rank r when fitting resumes (a rank beyond the saved world size keeps its seed).

Everything in ``meta.pt`` and ``rng_rank<r>.pt`` is plain data (tensors, numbers, strings,
lists, dicts), so they load with ``torch.load(weights_only=True)`` unless user hooks add other
objects.

Resuming loads, on every rank, the entries of the parameters it owns, from whichever files hold
them. Names and shapes are checked against the model before any tensor is read, on every rank
together, so a mismatch raises the same :class:`PipelineConfigError` everywhere instead of
hanging.

Export: :func:`export_checkpoint` (or ``python -m lightning_mmpp.export CKPT_DIR OUT.ckpt``)
writes one ordinary Lightning checkpoint: the full ``state_dict`` and index-keyed optimizer
states, loadable with ``MyModule.load_from_checkpoint(OUT.ckpt)`` or a single-process
``Trainer.fit(ckpt_path=OUT.ckpt)``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["PipelineCheckpointMixin", "export_checkpoint", "is_pipeline_checkpoint"]

FORMAT_VERSION = 1
META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
_RNG_FILE_RE = re.compile(r"rng_rank\d+\.pt")
_DCP_FILE_RE = re.compile(r"__\d+_\d+\.distcp")

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


def is_pipeline_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory written by the pipeline strategy."""
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file() and (p / DCP_METADATA_FILE).is_file()


# --- reading the index ------------------------------------------------------------------------


def _read_metadata(path: Path) -> Metadata:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist.")
    if not path.is_dir():
        raise PipelineConfigError(
            f"checkpoint {str(path)!r} is a file; MultiModulePipelineStrategy resumes from the checkpoint "
            "directories it writes (a single-file checkpoint can be loaded with MyModule.load_from_checkpoint "
            "before fitting instead)."
        )
    for name in (DCP_METADATA_FILE, META_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} is missing {name!r} ({str(path / name)!r}); it was not written completely "
                "or is not a MultiModulePipelineStrategy checkpoint."
            )
    return dcp.FileSystemReader(str(path)).read_metadata()


def _check_files(path: Path, metadata: Metadata, fqns: Iterable[str]) -> None:
    """Raise ``FileNotFoundError`` naming the first data file that holds one of ``fqns`` and is missing."""
    wanted = set(fqns)
    files: dict[str, None] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in wanted:
            files.setdefault(info.relative_path, None)
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} is missing the shard file {name!r} ({str(path / name)!r}); "
                "copy the whole checkpoint directory."
            )


def _load_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
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


def _local_path(path: PathLike) -> Path:
    text = os.fspath(path)
    if "://" in text:
        raise PipelineConfigError(
            f"checkpoint path {text!r}: MultiModulePipelineStrategy writes checkpoints with "
            "torch.distributed.checkpoint's FileSystemWriter, to a local or shared file system path; remote URLs "
            "are not supported. Save to a path every rank can reach and copy it afterwards."
        )
    return Path(text)


def _empty_like_stored(md: Any) -> Any:
    """A destination for DCP to load one stored entry into."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None  # bytes: DCP replaces the placeholder with the stored object


def _optim_index(metadata: Metadata) -> dict[tuple[int, str], list[tuple[str, str]]]:
    """``{(optimizer index, parameter name): [(state key, fqn), ...]}`` of the stored optimizer state."""
    index: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for fqn in metadata.state_dict_metadata:
        if fqn.startswith(OPTIM_PREFIX):
            i, name, key = _parse_optim_key(fqn)
            index.setdefault((i, name), []).append((key, fqn))
    return index


def _dcp_load(flat: dict[str, Any], path: Path, no_dist: bool) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(path)), no_dist=no_dist)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# --- RNG states --------------------------------------------------------------------------------


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


# --- helpers on optimizers ---------------------------------------------------------------------


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _names_in_order(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """The names of the optimizer's parameters, in the order ``optimizer.state_dict()`` indexes them."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise PipelineConfigError(
                    "an optimizer holds a parameter that is not a parameter of the LightningModule; pipeline "
                    "checkpoints key optimizer state by parameter name. Build the optimizer from self.parameters()."
                )
            out.append(name)
    return out


def _merge_names(per_rank: Sequence[Sequence[str]], order: Optional[Sequence[str]]) -> list[str]:
    """The union of the ranks' name lists: in ``order`` where it knows them, then in rank order."""
    merged = list(dict.fromkeys(name for names in per_rank for name in names))
    if order:
        position = {name: i for i, name in enumerate(order)}
        merged.sort(key=lambda name: position.get(name, len(position)))  # stable: unknown names keep rank order
    return merged


def _group_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class PipelineCheckpointMixin:
    """Checkpoint hooks of :class:`~lightning_mmpp.MultiModulePipelineStrategy` (see the module docstring).

    Mixed in before ``ParallelStrategy``; uses the strategy's ``layout``, ``lightning_module``,
    ``optimizers``, ``global_rank``, ``root_device``, ``barrier`` and ``broadcast``.
    """

    layout: Any
    lightning_module: Any
    optimizers: list[Any]
    global_rank: int
    root_device: torch.device
    _partition: Any
    _unpartitioned_keys: Optional[list[str]]

    # --- what Lightning asks ---------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # the model is partitioned in ``setup``: a rank loads only what it owns, after that
        return True

    def connect(self, model: Any) -> None:
        super().connect(model)  # type: ignore[misc]
        if self._partition is None:
            # the unpartitioned order of the state dict, for exports (kept by the strategy: a
            # later Trainer call with the same, then partitioned, model still knows it)
            self._unpartitioned_keys = list(model.state_dict().keys())

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # type: ignore[misc]
        lm = self.lightning_module
        self._mmpp_group_names: Optional[list[list[list[str]]]] = None
        if self._partition is None:
            # before partitioning every rank's optimizers hold every parameter: record each
            # group's names in the user's order, the index order of a single-process optimizer
            names = {id(p): n for n, p in lm.named_parameters()}
            try:
                self._mmpp_group_names = [
                    [[names[id(p)] for p in group["params"]] for group in _unwrap(opt).param_groups]
                    for opt in self.optimizers
                ]
            except KeyError:
                self._mmpp_group_names = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's state dict: the layers it owns, under their original names."""
        return self.lightning_module.state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state dict keyed by parameter name instead of index.

        ``{"state": {name: {key: value}}, "param_groups": [{<hyper-parameters>, "params": [names]}]}``
        """
        opt = _unwrap(optimizer)
        names = _names_in_order(opt, {id(p): n for n, p in self.lightning_module.named_parameters()})
        sd = opt.state_dict()
        return {
            "state": {names[i]: dict(s) for i, s in sd["state"].items()},
            "param_groups": [
                {**_group_hyperparameters(g), "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
        }

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        """Write a distributed checkpoint directory at ``filepath``; every rank must call this."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: the checkpoint is "
                "written with torch.distributed.checkpoint, not the CheckpointIO plugin."
            )
        path = _local_path(self.broadcast(os.fspath(filepath)))  # one path for all ranks
        rank = self.global_rank
        problem = None
        if rank == 0:
            try:
                _prepare_directory(path)
            except OSError as exc:
                problem = f"{type(exc).__name__}: {exc}"
        problem = self.broadcast(problem)  # also the barrier before anyone writes
        if problem is not None:
            raise OSError(f"cannot write the checkpoint directory {str(path)!r}: {problem}")

        state_dict: Mapping[str, Any] = checkpoint.get("state_dict", {})
        optimizer_states: Optional[list[dict[str, Any]]] = checkpoint.get("optimizer_states")
        flat: dict[str, Any] = {}
        for name, value in state_dict.items():
            if self._writes(name):
                flat[_model_key(name)] = value
        for i, opt_state in enumerate(optimizer_states or []):
            for name, per_param in opt_state["state"].items():
                if self._writes(name):
                    for key, value in per_param.items():
                        flat[_optim_key(i, name, key)] = value

        local = {
            "state_dict_keys": list(state_dict),
            "groups": [[g["params"] for g in s["param_groups"]] for s in optimizer_states or []],
        }
        gathered = self._mmpp_all_gather(local)

        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=not _distributed())
        torch.save(_rng_state(self.root_device), path / _rng_file(rank))

        if rank == 0:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            if optimizer_states is not None:
                meta["optimizer_states"] = self._meta_optimizer_states(optimizer_states, gathered)
            meta["mmpp"] = {
                "format": FORMAT_VERSION,
                "world_size": len(gathered),
                "placements": {
                    m: {"pp": p.pp, "dp": p.dp, "rank_offset": self.layout.offsets[m],
                        "split_points": list(p.split_points) if p.split_points is not None else None}
                    for m, p in self.layout.placements.items()
                },
                "topology": {m: list(self.layout.topology.downstream(m)) for m in self.layout.modules},
                "state_dict_keys": _merge_names(
                    [g["state_dict_keys"] for g in gathered],
                    self._unpartitioned_keys,
                ),
            }
            tmp = path / (META_FILE + ".tmp")
            torch.save(meta, tmp)
            os.replace(tmp, path / META_FILE)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read the parameters and optimizer state this rank owns; every rank must call this.

        Returns a Lightning checkpoint dict whose ``state_dict`` and ``optimizer_states`` are this
        rank's (``optimizer_states`` index-keyed for the rank's optimizers, ready for
        ``optimizer.load_state_dict``). Restores this rank's RNG states when fitting.
        """
        path_text = self.broadcast(os.fspath(checkpoint_path))  # one path for all ranks
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        strict = bool(getattr(lm, "strict_loading", True))
        local_state = lm.state_dict()

        # 1. every check that can fail, before any tensor is read; all ranks agree on the outcome
        failure: Optional[BaseException] = None
        plan: dict[str, Any] = {}
        try:
            path = _local_path(path_text)
            metadata = _read_metadata(path)
            meta = _load_meta(path, weights_only)
            plan = self._plan_load(path, metadata, meta, local_state, strict, fitting)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            failure = exc
        reports = self._mmpp_all_gather({
            "error": None if failure is None else (type(failure).__name__, str(failure)),
            "keys": list(local_state),
        })
        _raise_first(reports, failure, self.global_rank)
        if strict:
            owned = {k for r in reports for k in r["keys"]}
            unexpected = [
                fqn[len(MODEL_PREFIX):] for fqn in metadata.state_dict_metadata
                if fqn.startswith(MODEL_PREFIX) and fqn[len(MODEL_PREFIX):] not in owned
            ]
            if unexpected:
                raise PipelineConfigError(
                    f"checkpoint {str(path)!r} does not match the model: it holds {unexpected[0]!r}, which the model "
                    f"does not have ({len(unexpected)} such entries). Build the model the checkpoint was saved from, "
                    "or set `strict_loading = False` on the LightningModule."
                )

        # 2. read this rank's tensors (a collective)
        flat = {fqn: _empty_like_stored(metadata.state_dict_metadata[fqn]) for fqn in plan["fqns"]}
        _dcp_load(flat, path, no_dist=not _distributed())

        checkpoint = dict(meta)
        checkpoint["state_dict"] = {name: flat[_model_key(name)] for name in plan["model"]}
        if plan["optimizers"] is not None:
            checkpoint["optimizer_states"] = [
                {
                    "state": {
                        idx: {key: flat[fqn] for key, fqn in entries} for idx, entries in opt_plan["state"].items()
                    },
                    "param_groups": opt_plan["param_groups"],
                }
                for opt_plan in plan["optimizers"]
            ]
        if fitting and plan["rng"] is not None:
            _set_rng_state(plan["rng"], self.root_device)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt = _unwrap(optimizer)
            opt.load_state_dict(state)
            _optimizer_to_device(opt, self.root_device)

    def remove_checkpoint(self, filepath: PathLike) -> None:
        """Rank 0 removes the checkpoint (directory or file), then every rank waits for it."""
        if self.global_rank == 0:
            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        self.barrier()

    # --- internals -------------------------------------------------------------------------

    def _writes(self, name: str) -> bool:
        """Whether this rank is the one rank that writes the entries of ``name``."""
        module = name.split(".", 1)[0]
        slot = self.layout.slot(self.global_rank, module) if module in self.layout.placements else None
        if slot is None:
            return self.global_rank == 0  # outside every module: identical everywhere
        return slot.replica == 0

    def _mmpp_all_gather(self, obj: Any) -> list[Any]:
        if not _distributed():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _meta_optimizer_states(
        self, optimizer_states: Sequence[Mapping[str, Any]], gathered: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """Each group's hyper-parameters and the names of all its parameters over all ranks."""
        recorded = getattr(self, "_mmpp_group_names", None)
        out = []
        for i, opt_state in enumerate(optimizer_states):
            groups = []
            for g, group in enumerate(opt_state["param_groups"]):
                order = None
                if recorded is not None and i < len(recorded) and g < len(recorded[i]):
                    order = recorded[i][g]
                names = _merge_names([r["groups"][i][g] for r in gathered], order)
                groups.append({**_group_hyperparameters(group), "params": names})
            out.append({"param_groups": groups})
        return out

    def _plan_load(
        self,
        path: Path,
        metadata: Metadata,
        meta: Mapping[str, Any],
        local_state: Mapping[str, Any],
        strict: bool,
        fitting: bool,
    ) -> dict[str, Any]:
        """Check this rank's names and shapes against the checkpoint; say what to read."""
        stored = metadata.state_dict_metadata
        fqns: list[str] = []
        model: list[str] = []
        for name, value in local_state.items():
            md = stored.get(_model_key(name))
            if md is None:
                if strict:
                    raise PipelineConfigError(
                        f"checkpoint {str(path)!r} does not match the model: the model's {name!r} is not in the "
                        "checkpoint. Build the model the checkpoint was saved from, or set `strict_loading = False` "
                        "on the LightningModule."
                    )
                continue
            if isinstance(value, Tensor) and isinstance(md, TensorStorageMetadata) and tuple(value.shape) != tuple(
                md.size
            ):
                raise PipelineConfigError(
                    f"checkpoint {str(path)!r} does not match the model: {name!r} has shape {tuple(md.size)} in the "
                    f"checkpoint but {tuple(value.shape)} in the model."
                )
            if isinstance(value, Tensor) and not isinstance(md, TensorStorageMetadata):
                raise PipelineConfigError(
                    f"checkpoint {str(path)!r} does not match the model: {name!r} is a tensor in the model but not "
                    "in the checkpoint."
                )
            fqns.append(_model_key(name))
            model.append(name)

        optimizers = None
        if fitting and "optimizer_states" in meta:
            optimizers = self._plan_optimizers(path, metadata, meta["optimizer_states"])
            fqns += [fqn for opt_plan in optimizers for entries in opt_plan["state"].values() for _, fqn in entries]

        rng = None
        if fitting:
            saved_world = int(meta["mmpp"].get("world_size", 0))
            if self.global_rank < saved_world:
                rng_file = path / _rng_file(self.global_rank)
                if not rng_file.is_file():
                    raise FileNotFoundError(
                        f"checkpoint {str(path)!r} is missing the RNG file {rng_file.name!r} of rank "
                        f"{self.global_rank} ({str(rng_file)!r}); copy the whole checkpoint directory."
                    )
                rng = torch.load(rng_file, weights_only=True)
        _check_files(path, metadata, fqns)
        return {"fqns": fqns, "model": model, "optimizers": optimizers, "rng": rng}

    def _plan_optimizers(
        self, path: Path, metadata: Metadata, saved: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        if len(saved) != len(self.optimizers):
            raise PipelineConfigError(
                f"checkpoint {str(path)!r} holds {len(saved)} optimizer(s) but configure_optimizers returns "
                f"{len(self.optimizers)}; resume with the optimizers the checkpoint was saved with."
            )
        stored = _optim_index(metadata)
        names_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        plans = []
        for i, (optimizer, saved_opt) in enumerate(zip(self.optimizers, saved)):
            opt = _unwrap(optimizer)
            saved_groups = saved_opt["param_groups"]
            if len(saved_groups) != len(opt.param_groups):
                raise PipelineConfigError(
                    f"checkpoint {str(path)!r}: optimizer {i} has {len(saved_groups)} parameter group(s) in the "
                    f"checkpoint but {len(opt.param_groups)} now; resume with the same param groups."
                )
            state: dict[int, list[tuple[str, str]]] = {}
            groups = []
            idx = 0
            for g, (group, saved_group) in enumerate(zip(opt.param_groups, saved_groups)):
                members = set(saved_group["params"])
                indices = []
                for p in group["params"]:
                    name = names_of.get(id(p))
                    if name is None:
                        raise PipelineConfigError(
                            f"optimizer {i} holds a parameter that is not a parameter of the LightningModule; "
                            "pipeline checkpoints key optimizer state by parameter name."
                        )
                    if name not in members:
                        raise PipelineConfigError(
                            f"checkpoint {str(path)!r}: parameter {name!r} is in group {g} of optimizer {i} but not "
                            "in that group in the checkpoint; resume with the same param groups."
                        )
                    if (i, name) in stored:
                        state[idx] = stored[(i, name)]
                    indices.append(idx)
                    idx += 1
                groups.append({**_group_hyperparameters(saved_group), "params": indices})
            plans.append({"state": state, "param_groups": groups})
        return plans


def _raise_first(reports: Sequence[Mapping[str, Any]], own: Optional[BaseException], rank: int) -> None:
    """Raise on every rank when any rank failed: the first failing rank's error."""
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
    if not failed:
        return
    first_rank, (kind, message) = failed[0]
    if own is not None and rank == first_rank:
        raise own
    cls = {"FileNotFoundError": FileNotFoundError, "PipelineConfigError": PipelineConfigError}.get(kind)
    if cls is not None:
        raise cls(message) from own
    raise RuntimeError(f"loading the checkpoint failed on rank {first_rank}: {kind}: {message}") from own


def _prepare_directory(path: Path) -> None:
    """Make ``path`` an empty-of-checkpoint-files directory (other files in it are left alone)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        if entry.is_file() and (
            entry.name in (META_FILE, DCP_METADATA_FILE, META_FILE + ".tmp")
            or _DCP_FILE_RE.fullmatch(entry.name)
            or _RNG_FILE_RE.fullmatch(entry.name)
        ):
            entry.unlink()


# --- export ------------------------------------------------------------------------------------


def export_checkpoint(
    checkpoint_dir: PathLike, out_path: PathLike, *, weights_only: Optional[bool] = None
) -> Path:
    """Turn a pipeline checkpoint directory into one ordinary Lightning checkpoint file.

    The file holds the full ``state_dict`` (original names), the optimizer states index-keyed
    as the unpartitioned optimizer would have them, and everything else Lightning saved (loops,
    callbacks, hyper-parameters, LR schedulers). Load it with ``MyModule.load_from_checkpoint``
    or resume from it with a single-process ``Trainer.fit(ckpt_path=...)``. Runs on one
    process; needs no process group.

    Args:
        checkpoint_dir: a directory written by :class:`~lightning_mmpp.MultiModulePipelineStrategy`.
        out_path: the file to write.
        weights_only: passed to ``torch.load`` for ``meta.pt`` (``None``: torch's default).

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.
    """
    path = _local_path(checkpoint_dir)
    metadata = _read_metadata(path)
    meta = _load_meta(path, weights_only)
    fqns = [fqn for fqn in metadata.state_dict_metadata if fqn.startswith((MODEL_PREFIX, OPTIM_PREFIX))]
    _check_files(path, metadata, fqns)
    flat = {fqn: _empty_like_stored(metadata.state_dict_metadata[fqn]) for fqn in fqns}
    _dcp_load(flat, path, no_dist=True)

    info = meta.get("mmpp", {})
    checkpoint = {k: v for k, v in meta.items() if k != "mmpp"}
    stored_names = [fqn[len(MODEL_PREFIX):] for fqn in fqns if fqn.startswith(MODEL_PREFIX)]
    order = _merge_names([info.get("state_dict_keys", []), stored_names], None)
    checkpoint["state_dict"] = {name: flat[_model_key(name)] for name in order if _model_key(name) in flat}

    if "optimizer_states" in meta:
        stored = _optim_index(metadata)
        optimizer_states = []
        for i, saved in enumerate(meta["optimizer_states"]):
            names = [n for group in saved["param_groups"] for n in group["params"]]
            index = {n: j for j, n in enumerate(names)}
            state = {
                index[n]: {key: flat[fqn] for key, fqn in stored[(i, n)]} for n in names if (i, n) in stored
            }
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
