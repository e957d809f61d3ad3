"""The model a command line names, ``path/to/script.py:ModelClass``: its class, a sample batch
and a picklable factory (:class:`ScriptModel`) for measuring processes started fresh."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["ScriptModel", "load_target"]


# scripts loaded in this process, by absolute path (a spawned measuring process loads its own)
_SCRIPTS: dict[str, Any] = {}


def _load_script(path: str) -> Any:
    if not os.path.isfile(path):
        raise PipelineConfigError(f"{path!r} is not a file; give path/to/script.py:ModelClass.")
    path = os.path.abspath(path)
    if path in _SCRIPTS:
        return _SCRIPTS[path]
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("_mmpp_plan_target", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    _SCRIPTS[path] = module
    return module


@dataclass(frozen=True)
class ScriptModel:
    """``make_model`` for ``script.py:ModelClass``: builds the class, loading the script once per
    process. It pickles as the path and the name, so a measuring process that is spawned rather
    than forked (see :func:`~lightning_mmpp.plan.launch.start_method`) can rebuild it, where the
    class itself (of a module loaded from a file path) would not unpickle."""

    path: str
    class_name: str

    def __call__(self) -> Any:
        return getattr(_load_script(self.path), self.class_name)()


def _sample_batch(script: Any, batch_size: int) -> Any:
    if callable(getattr(script, "sample_batch", None)):
        return script.sample_batch(batch_size)
    from torch.utils.data import Dataset, default_collate

    for value in vars(script).values():
        if inspect.isclass(value) and issubclass(value, Dataset) and value.__module__ == script.__name__:
            try:
                dataset = value(batch_size)
            except TypeError:
                continue
            return default_collate([dataset[i] for i in range(batch_size)])
    raise PipelineConfigError(
        f"{script.__file__}: found no way to make a sample batch; define sample_batch(batch_size) in the script "
        "(returning one collated batch), or a Dataset class whose constructor takes the dataset size."
    )


def load_target(target: str, batch_size: int) -> tuple[Any, Any, Any]:
    """``(model class, sample batch, topology)`` of ``script.py:ModelClass`` (see :mod:`lightning_mmpp.plan.__main__`)."""
    path, sep, cls_name = target.rpartition(":")
    if not sep:
        raise PipelineConfigError(f"{target!r}: give path/to/script.py:ModelClass (or --profile profile.json).")
    script = _load_script(path)
    cls = getattr(script, cls_name, None)
    if cls is None:
        raise PipelineConfigError(f"{path} defines no {cls_name!r}.")
    topology = getattr(cls, "pipeline_topology", None) or getattr(script, "TOPOLOGY", None)
    return cls, _sample_batch(script, batch_size), topology
