"""Per-module pretrained weights: check every key against the model, read only what a rank holds.

A source is one of

- a ``.safetensors`` file (needs the optional ``safetensors`` package:
  ``pip install safetensors``, or ``pip install -e ".[safetensors]"`` in a clone), read tensor by tensor;
- a torch state-dict file (``torch.save``; loaded with ``weights_only=True, mmap=True``, so
  only the bytes of the tensors used are read). A Lightning checkpoint file (a dict with a
  ``"state_dict"``, such as this project's export) counts as one, keyed by full model names;
- a torch.distributed.checkpoint directory; this project's checkpoints (tensors stored as
  ``model/<name>``) are keyed by full model names;
- :class:`PretrainedWeights` around any of these, to rename (or drop) keys.

Keys are relative to the module attribute (``model.llm.state_dict()`` names, e.g.
``"0.self_attn.q_proj.weight"``). Sources keyed by full model names (the project's checkpoints and
Lightning checkpoint files) contribute their ``"<module>."`` entries with that prefix removed.

Loading is a function of (the module's tensors a rank holds, the source): :func:`check_pretrained`
compares the source's metadata with every key of the module (on the meta device no tensor is
read), identically on every rank, and :func:`load_pretrained_tensors` copies only the given
tensors from the source.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_mmpp.errors import PipelineConfigError

__all__ = [
    "PretrainedWeights",
    "PretrainedSource",
    "check_pretrained",
    "load_pretrained_tensors",
    "module_tensor_specs",
    "open_source",
]

PathLike = Union[str, os.PathLike]
KeyMap = Callable[[str], Optional[str]]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MODEL_PREFIX = "model/"  # this project's DCP checkpoints (lightning_mmpp.state.checkpoint)


@dataclass(frozen=True)
class PretrainedWeights:
    """A weight source with renamed keys.

    Args:
        path: a ``.safetensors`` file, a torch state-dict file or a DCP directory.
        key_map: source key -> key relative to the module (``None`` drops the key), e.g. a
            Hugging Face name ``"model.layers.3.mlp.up_proj.weight"`` -> ``"3.mlp.up_proj.weight"``.
        strict: every key of the module must be loaded and every kept source key must exist in
            the module. With ``strict=False`` missing keys keep their random initialisation and
            unexpected keys are ignored.
    """

    path: PathLike
    key_map: Optional[KeyMap] = None
    strict: bool = True


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PretrainedSource:
    """An opened source: metadata of every tensor, keyed by module-relative key."""

    module: str
    path: Path
    kind: str  # "safetensors", "torch" or "dcp"
    specs: dict[str, TensorSpec]  # module-relative key -> stored shape/dtype
    stored_keys: dict[str, str]  # module-relative key -> key in the file
    strict: bool = True
    _torch_state: Optional[Mapping[str, Tensor]] = field(default=None, repr=False)

    def read(self, wanted: Mapping[str, Tensor], rows: Mapping[str, tuple[int, int]] = {}) -> None:
        """Copy the source's values into ``wanted`` (module-relative key -> destination tensor).

        ``rows`` (key -> ``(start, stop)``) asks for only those rows (dim 0) of a stored tensor: the
        local shard of a parameter sharded while it is built. Safetensors files read just those
        rows (``get_slice``), memory-mapped torch files touch just their pages; a DCP directory
        stages the one whole tensor and copies the rows out.
        """
        if not wanted:
            return
        with torch.no_grad():
            if self.kind == "safetensors":
                safe_open = _safetensors().safe_open
                with safe_open(str(self.path), framework="pt") as f:
                    for key, dest in wanted.items():
                        if key in rows:
                            dest.copy_(f.get_slice(self.stored_keys[key])[rows[key][0]:rows[key][1]])
                        else:
                            dest.copy_(f.get_tensor(self.stored_keys[key]))
            elif self.kind == "torch":
                state = self._torch_state if self._torch_state is not None else _torch_load(self.path)
                for key, dest in wanted.items():
                    stored = state[self.stored_keys[key]]
                    dest.copy_(stored[rows[key][0]:rows[key][1]] if key in rows else stored)
            else:
                from lightning_mmpp.model.checkpoint_files import dcp_load  # never unpickles objects

                same = {self.stored_keys[k]: d for k, d in wanted.items()
                        if d.dtype == self.specs[k].dtype and k not in rows}
                cast = {k: d for k, d in wanted.items() if d.dtype != self.specs[k].dtype or k in rows}
                staged = {
                    self.stored_keys[k]: torch.empty(self.specs[k].shape, dtype=self.specs[k].dtype, device=d.device)
                    for k, d in cast.items()
                }
                with warnings.catch_warnings():  # no_dist=True is the point: each rank reads on its own
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp_load({**same, **staged}, self.path, distributed=False)
                for key, dest in cast.items():
                    whole = staged.pop(self.stored_keys[key])
                    dest.copy_(whole[rows[key][0]:rows[key][1]] if key in rows else whole)
                    del whole

    def release(self) -> None:
        """Drop the memory map of a torch file."""
        self._torch_state = None


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError as err:
        raise PipelineConfigError(
            "reading .safetensors weights needs the optional package 'safetensors': "
            "pip install safetensors (in a clone of lightning_mmpp: pip install -e '.[safetensors]')."
        ) from err
    return safetensors


def _torch_load(path: Path) -> Mapping[str, Any]:
    return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)


def open_source(module: str, source: Union[PathLike, PretrainedWeights]) -> PretrainedSource:
    """Open ``source`` for ``module``: read its metadata (not its tensors) and map its keys."""
    weights = source if isinstance(source, PretrainedWeights) else PretrainedWeights(source)
    path = Path(weights.path)
    if not path.exists():
        raise PipelineConfigError(f"pretrained weights for module {module!r}: {str(path)!r} does not exist.")
    torch_state = None
    full_names = False
    if path.is_dir():
        from lightning_mmpp.model.checkpoint_files import read_dcp_metadata  # an allow-list unpickler

        try:
            metadata = read_dcp_metadata(path)
        except Exception as err:
            raise PipelineConfigError(
                f"pretrained weights for module {module!r}: {str(path)!r} is a directory but not a "
                f"torch.distributed.checkpoint ({err})."
            ) from err
        kind = "dcp"
        raw: dict[str, TensorSpec] = {}
        for key, md in metadata.state_dict_metadata.items():
            if hasattr(md, "size") and hasattr(md, "properties"):
                raw[key] = TensorSpec(tuple(md.size), md.properties.dtype)
        if any(k.startswith(_MODEL_PREFIX) for k in raw):
            full_names = True
            raw = {k: v for k, v in raw.items() if k.startswith(_MODEL_PREFIX)}
            stored = {k[len(_MODEL_PREFIX):]: k for k in raw}
        else:
            stored = {k: k for k in raw}
        specs_by_stored = raw
    elif path.suffix == ".safetensors":
        kind = "safetensors"
        safe_open = _safetensors().safe_open
        specs_by_stored = {}
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                specs_by_stored[key] = TensorSpec(tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
        stored = {k: k for k in specs_by_stored}
    else:
        kind = "torch"
        try:
            loaded = _torch_load(path)
        except Exception as err:
            raise PipelineConfigError(
                f"pretrained weights for module {module!r}: cannot read {str(path)!r} as a torch state-dict file "
                f"with torch.load(weights_only=True, mmap=True) ({type(err).__name__}: {err})."
            ) from err
        if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
            loaded, full_names = loaded["state_dict"], True
        if not isinstance(loaded, Mapping):
            raise PipelineConfigError(
                f"pretrained weights for module {module!r}: {str(path)!r} holds a {type(loaded).__name__}, not a "
                "state dict (a mapping of names to tensors)."
            )
        torch_state = {k: v for k, v in loaded.items() if isinstance(v, Tensor)}
        specs_by_stored = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in torch_state.items()}
        stored = {k: k for k in specs_by_stored}
    if full_names:  # keyed by full model names: keep this module's entries, relative to it
        prefix = f"{module}."
        stored = {name[len(prefix):]: key for name, key in stored.items() if name.startswith(prefix)}
    specs: dict[str, TensorSpec] = {}
    stored_keys: dict[str, str] = {}
    for name, key in stored.items():
        target = weights.key_map(name) if weights.key_map is not None else name
        if target is None:
            continue
        if target in stored_keys:
            raise PipelineConfigError(
                f"pretrained weights for module {module!r} ({path}): key_map sends both {stored_keys[target]!r} and "
                f"{key!r} to {target!r}; each module key may come from one source key only."
            )
        specs[target] = specs_by_stored[key]
        stored_keys[target] = key
    return PretrainedSource(module, path, kind, specs, stored_keys, weights.strict, torch_state)


def module_tensor_specs(container: nn.Module) -> dict[str, TensorSpec]:
    """Shape and dtype of every state-dict entry of a module (works on the meta device)."""
    return {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in container.state_dict(keep_vars=True).items()
            if isinstance(v, Tensor)}


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def check_pretrained(
    source: PretrainedSource, expected: Mapping[str, TensorSpec], aliases: Mapping[str, Sequence[str]] = {}
) -> list[str]:
    """Keys of the module to load; raise one error listing every mismatch.

    ``expected`` holds every state-dict entry of the whole module (all stages), so every rank
    reaches the same verdict. ``aliases`` names the other keys of a tied tensor: one of them in
    the source is enough (a Hugging Face checkpoint with tied embeddings stores only one).
    """
    problems = []
    where = f"module {source.module!r}, file {str(source.path)!r}"

    def stored(key: str) -> str:
        return "" if source.stored_keys[key] == key else f" (stored as {source.stored_keys[key]!r})"

    for key, spec in expected.items():
        found = source.specs.get(key)
        if found is None:
            found = next((source.specs[a] for a in aliases.get(key, ()) if a in source.specs), None)
        if found is None:
            if source.strict:
                problems.append(f"missing key {key!r}: expected shape {list(spec.shape)} {spec.dtype}, found nothing")
        elif found.shape != spec.shape:
            problems.append(
                f"key {key!r}{stored(key)}: expected shape {list(spec.shape)}, found shape {list(found.shape)}"
            )
        elif not _castable(found.dtype, spec.dtype):
            problems.append(f"key {key!r}{stored(key)}: expected dtype {spec.dtype}, found {found.dtype} (cannot cast)")
    if source.strict:
        for key in source.specs:
            if key not in expected:
                problems.append(
                    f"unexpected key {key!r}{stored(key)}: found shape {list(source.specs[key].shape)}, the module has "
                    "no such entry"
                )
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise PipelineConfigError(
            f"pretrained weights do not fit ({where}):\n  {shown}{more}\nRename keys with "
            "PretrainedWeights(path, key_map=...) (return None to drop a key), or pass strict=False to load only "
            "the keys both sides have."
        )
    return [key for key in expected if key in source.specs]


def load_pretrained_tensors(
    source: PretrainedSource,
    tensors: Mapping[str, Tensor],
    aliases: Mapping[str, Sequence[str]] = {},
    rows: Mapping[str, tuple[int, int]] = {},
) -> list[str]:
    """Copy the source values of ``tensors`` (module-relative key -> the tensor a rank holds).

    A key the source lacks is read under one of its ``aliases`` (tied tensors); keys found under
    no name are skipped (``check_pretrained`` already decided whether that is allowed). Each
    tensor is read once. ``rows`` (key -> ``(start, stop)``) reads only those rows of a key
    (the rank's shard). Returns the source keys read.
    """
    wanted: dict[str, Tensor] = {}
    wanted_rows: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    for key, tensor in tensors.items():
        name = key if key in source.specs else next((a for a in aliases.get(key, ()) if a in source.specs), None)
        if name is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        wanted[name] = tensor.detach()
        if key in rows:
            wanted_rows[name] = rows[key]
    source.read(wanted, wanted_rows)
    return list(wanted)


def covered_names(
    sources: Iterable[PretrainedSource], aliases: Mapping[str, Mapping[str, Sequence[str]]] = {}
) -> set[str]:
    """Fully qualified names (``"llm.0.lin.weight"``) that pretrained sources fill (tied aliases too)."""
    names = set()
    for s in sources:
        for key in s.specs:
            names.add(f"{s.module}.{key}")
            names.update(f"{s.module}.{a}" for a in aliases.get(s.module, {}).get(key, ()))
    return names
