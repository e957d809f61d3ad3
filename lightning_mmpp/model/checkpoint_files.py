"""The files of a checkpoint directory: crash-safe publication, a manifest, safe reading.

Three concerns that do not depend on what a checkpoint holds (see :mod:`lightning_mmpp.state.checkpoint`
for that):

* **Publication.** A checkpoint is written into a hidden sibling directory
  (``.<name>.partial-<token>``) and moved to its final name only when every file is complete,
  with one atomic step: ``rename`` when the name is free; when it is taken (``last.ckpt``
  rewritten by ``ModelCheckpoint(save_last=True)``), Linux's ``renameat2(RENAME_EXCHANGE)``
  swaps the two directories atomically, then the previous one is deleted. Where the exchange
  is not available (macOS, Windows, some network file systems) the previous checkpoint is
  first renamed to ``.<name>.replaced-<token>`` and the new one renamed into place: a crash
  between the two renames leaves no directory under the name, but the previous checkpoint
  complete under the ``replaced`` name, which loading points to.
* **Manifest.** ``manifest.json`` (plain JSON, written last) lists every file with its size and
  CRC32; loading checks the files it reads against it, before any of them is parsed.
* **Safe reading.** torch.distributed.checkpoint (checked in torch 2.13, which has no safe
  option for either) reads its index (``.metadata``) with plain ``pickle.load`` in
  ``FileSystemReader.read_metadata`` and non-tensor entries with ``torch.load(weights_only=False)``
  in ``DefaultLoadPlanner.load_bytes``: both can run code stored in a crafted file (tensor data
  is already read with ``weights_only=True``). :class:`SafeFileSystemReader` unpickles the index
  with an allow-list of the few plain classes the format uses (its dataclasses, ``torch.Size``,
  dtypes, layouts, ``pathlib`` paths), and :func:`dcp_load` reads non-tensor entries with
  ``weights_only=True`` unless the caller opts out. Use them for any DCP directory, ours or not.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import pickle
import secrets
import shutil
import sys
import warnings
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mmpp.errors import PipelineConfigError

__all__ = [
    "MANIFEST_FILE",
    "FileRecord",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "dcp_load",
    "file_record",
    "publish",
    "read_dcp_metadata",
    "read_manifest",
    "remove_directory",
    "safe_torch_load",
    "staging_directory",
    "verify_files",
    "write_manifest",
]

MANIFEST_FILE = "manifest.json"
_CHUNK = 4 << 20
_PARTIAL = ".partial-"
_REPLACED = ".replaced-"
_REMOVING = ".removing-"


# --- sizes and checksums -----------------------------------------------------------------------


@dataclass(frozen=True)
class FileRecord:
    """What the manifest remembers of one file."""

    size: int
    crc32: int


def file_record(path: Path) -> FileRecord:
    """Size and CRC32 of ``path`` (read in 4 MiB chunks; CRC32 is the fastest check in the
    standard library: ~2 GB/s, see benchmarks/README.md)."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return FileRecord(size=size, crc32=crc)


def write_manifest(directory: Path, records: Mapping[str, FileRecord], format_version: int) -> None:
    """Write ``manifest.json`` (durably) listing ``records``."""
    body = {
        "format": format_version,
        "checksum": "crc32",
        "files": {name: {"size": r.size, "crc32": f"{r.crc32:08x}"} for name, r in sorted(records.items())},
    }
    write_durably(directory / MANIFEST_FILE, json.dumps(body, indent=1).encode())


def read_manifest(checkpoint: Path) -> dict[str, FileRecord]:
    """The file records of ``checkpoint``'s manifest; a clear error when it is absent or unreadable."""
    path = checkpoint / MANIFEST_FILE
    if not path.is_file():
        raise PipelineConfigError(
            f"checkpoint {str(checkpoint)!r} has no {MANIFEST_FILE}: it is not a complete checkpoint written by "
            "this version of MultiModulePipelineStrategy (a save that was interrupted, a partial copy, or another "
            "format). Use a complete copy of the checkpoint directory."
        )
    try:
        body = json.loads(path.read_bytes())
        return {
            name: FileRecord(size=int(entry["size"]), crc32=int(entry["crc32"], 16))
            for name, entry in body["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PipelineConfigError(
            f"checkpoint {str(checkpoint)!r}: {MANIFEST_FILE} is corrupt ({type(exc).__name__}: {exc}); the "
            "checkpoint cannot be verified. Use an intact copy."
        ) from exc


def verify_files(
    checkpoint: Path,
    manifest: Mapping[str, FileRecord],
    names: Iterable[str],
    holds: Optional[Mapping[str, list[str]]] = None,
) -> None:
    """Raise :class:`PipelineConfigError` naming the first of ``names`` that is missing, of the
    wrong size, or whose CRC32 differs from the manifest. ``holds`` maps a file to the entries
    stored in it, for the message."""
    for name in dict.fromkeys(names):
        path = checkpoint / name
        what = ""
        if holds and holds.get(name):
            entries = holds[name]
            more = f" and {len(entries) - 1} more entries" if len(entries) > 1 else ""
            what = f" (it holds {entries[0]!r}{more})"
        record = manifest.get(name)
        where = f"checkpoint {str(checkpoint)!r}: file {name!r}{what}"
        if record is None:
            raise PipelineConfigError(
                f"{where} is not listed in its {MANIFEST_FILE}: the directory mixes files of different "
                "checkpoints. Use a complete, unmodified copy of the checkpoint directory."
            )
        if not path.is_file():
            raise PipelineConfigError(
                f"{where} is missing ({str(path)!r}). Copy the whole checkpoint directory."
            )
        size = path.stat().st_size
        if size != record.size:
            state = "truncated" if size < record.size else "longer than written"
            raise PipelineConfigError(
                f"{where} is {state}: {size} bytes on disk, {record.size} bytes when it was saved (an interrupted "
                "copy or a full disk?). Use a complete copy of the checkpoint directory."
            )
        found = file_record(path)
        if found.crc32 != record.crc32:
            raise PipelineConfigError(
                f"{where} is corrupt: its CRC32 is {found.crc32:08x} but was {record.crc32:08x} when it was saved "
                "(the bytes changed on disk or in transfer, or the file comes from another checkpoint). Use an "
                "intact copy of the checkpoint directory."
            )


# --- writing and publishing --------------------------------------------------------------------


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to stable storage."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_save_durably(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_durably(path, buffer.getvalue())


def fsync_directory(path: Path) -> None:
    """Make renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def staging_directory(final: Path) -> Path:
    """A fresh hidden sibling of ``final`` to write a checkpoint into (its name does not end in
    ``.ckpt``, so ``ModelCheckpoint`` never mistakes it for a checkpoint)."""
    return final.parent / f".{final.name}{_PARTIAL}{secrets.token_hex(4)}"


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc < 2.28, musl
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _move_aside(final: Path) -> Path:
    """Rename the previous checkpoint out of the way (fallback path of :func:`publish`)."""
    aside = final.parent / f".{final.name}{_REPLACED}{secrets.token_hex(4)}"
    os.rename(final, aside)
    return aside


def publish(staging: Path, final: Path) -> None:
    """Move the complete checkpoint ``staging`` to ``final`` in one atomic step (see the module
    docstring), delete the checkpoint it replaces and leftovers of interrupted saves of ``final``."""
    fsync_directory(staging)
    if not final.exists() and not final.is_symlink():
        os.rename(staging, final)
        previous: Optional[Path] = None
    elif _exchange(staging, final):
        previous = staging  # the exchange left the previous checkpoint under the staging name
    else:
        previous = _move_aside(final)  # between these two renames ``final`` is absent
        os.rename(staging, final)
    fsync_directory(final.parent)
    # the new checkpoint is in place: failing to delete old files is worth a warning, not an error
    leftovers = tuple(f".{final.name}{kind}" for kind in (_PARTIAL, _REPLACED, _REMOVING))
    doomed = [previous] if previous is not None else []
    doomed += [p for p in final.parent.glob(f".{_glob_escape(final.name)}.*") if p.name.startswith(leftovers)]
    for path in doomed:
        try:
            remove_directory(path)
        except OSError as exc:
            warnings.warn(f"the checkpoint {str(final)!r} was saved, but {str(path)!r} could not be deleted: {exc}")


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove_directory(path: Path) -> None:
    """Delete a checkpoint (directory, file or link) so that its name disappears at once: a
    directory is first renamed to a hidden sibling, then deleted."""
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    doomed = path
    if not path.name.startswith("."):
        doomed = path.parent / f".{path.name}{_REMOVING}{secrets.token_hex(4)}"
        os.rename(path, doomed)
    shutil.rmtree(doomed)


def interrupted_replacement(final: Path) -> Optional[Path]:
    """The complete previous checkpoint an interrupted fallback :func:`publish` of ``final`` left aside."""
    for candidate in sorted(final.parent.glob(f".{_glob_escape(final.name)}{_REPLACED}*")):
        if (candidate / MANIFEST_FILE).is_file():
            return candidate
    return None


# --- safe reading ------------------------------------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, resolving only the plain classes the format is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_dcp_metadata(checkpoint: Path) -> Metadata:
    """Read ``checkpoint/.metadata`` without running code from it."""
    path = checkpoint / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse the index is the same user problem
        raise PipelineConfigError(
            f"checkpoint {str(checkpoint)!r}: its index '.metadata' cannot be read safely ({type(exc).__name__}: "
            f"{exc}). It is corrupt or was crafted to run code when unpickled; nothing from it was executed. Use an "
            "intact checkpoint from a trusted source."
        ) from exc
    if not isinstance(metadata, Metadata):
        raise PipelineConfigError(
            f"checkpoint {str(checkpoint)!r}: its index '.metadata' holds a {type(metadata).__name__}, not a "
            "torch.distributed.checkpoint Metadata."
        )
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose index is unpickled with an allow-list (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank index files: never written by this package
            raise PipelineConfigError("per-rank DCP index files are not supported")
        metadata = read_dcp_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (no flattening) that reads non-tensor entries with
    ``torch.load(weights_only=...)`` instead of DCP's ``False``; pair it with :class:`SafeFileSystemReader`."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=self._weights_only)


def dcp_load(flat: dict[str, Any], checkpoint: Path, *, distributed: bool, weights_only: bool = True) -> None:
    """``dcp.load`` of a flat dict from ``checkpoint`` with the safe reader (in place).

    With ``distributed=False`` no process group is used (each process reads on its own)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(
                flat, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=SafeLoadPlanner(weights_only),
                no_dist=not distributed,
            )
        except CheckpointException as exc:  # DCP gathers every rank's failures: all ranks see the same
            for failure, _ in exc.failures.values():
                if isinstance(failure, PipelineConfigError):
                    raise PipelineConfigError(str(failure)) from exc
                if isinstance(failure, pickle.UnpicklingError):
                    where = "a non-tensor entry of the DCP data"
                    raise PipelineConfigError(_unsafe_entry_message(checkpoint, where, failure)) from exc
            raise


def safe_torch_load(path: Path, *, weights_only: bool, what: str, checkpoint: Path) -> Any:
    """``torch.load`` of a checkpoint file with ``weights_only`` (True: plain data only), with an
    error naming the checkpoint and the file when it holds objects that cannot be loaded safely."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise PipelineConfigError(_unsafe_entry_message(checkpoint, f"{path.name!r} ({what})", exc)) from exc


def _unsafe_entry_message(checkpoint: Path, where: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"checkpoint {str(checkpoint)!r}: {where} holds objects other than tensors and plain Python data, which "
        f"are not loaded by default because unpickling them can run code ({first}). Nothing from it was executed. "
        "If you wrote this checkpoint yourself (an on_save_checkpoint hook or hyper-parameter that stores such "
        "objects), load it with weights_only=False (Trainer.fit(..., weights_only=False), or "
        "`python -m lightning_mmpp.state.export --unsafe-load`)."
    )
