"""The layer rules (DESIGN.md section 4): `lint-imports` over pyproject.toml's contracts, and no
private torch or Lightning API outside the two adapter modules."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_mmpp"
ADAPTERS = {PACKAGE / "torch_api.py": "torch", PACKAGE / "lightning" / "lightning_api.py": "lightning"}


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not os.path.exists(exe):
        pytest.fail("lint-imports is missing: install the test extra (bash scripts/install.sh test)")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Names bound to torch or one of its modules (``import torch.distributed as dist``, ...)."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _private_uses(path: Path) -> list[str]:
    """Imports of a private torch/Lightning module or name, and private attributes reached from
    torch or an alias of one of its modules (``torch._C``, ``dist.distributed_c10d._x``)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    torch_names = _torch_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts) or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.name}:{node.lineno} from {node.module} import {[a.name for a in node.names]}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("torch", "lightning") and any(
                    p.startswith("_") for p in alias.name.split(".")
                ):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = node
            while isinstance(chain, ast.Attribute):
                chain = chain.value
            if isinstance(chain, ast.Name) and chain.id in torch_names:
                found.append(f"{path.name}:{node.lineno} {chain.id}...{node.attr}")
    return found


def test_private_torch_and_lightning_api_only_in_the_adapters():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in ADAPTERS:
            offenders += _private_uses(path)
    assert not offenders, "private API outside torch_api.py / lightning/lightning_api.py:\n" + "\n".join(offenders)


def test_lightning_internal_attributes_only_in_the_adapter():
    """Trainer internals reached by attribute (``trainer._x``) stay in lightning_api.py."""
    internals = ("_data_source", "_accelerator_connector", "_signal_connector", "_sigterm_notifier_fn",
                 "_slurm_sigusr_handler_fn", "_call_callbacks")
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py")) if path not in ADAPTERS
        for name in internals if name in path.read_text()
    ]
    assert not offenders, offenders


def test_the_checker_sees_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\nfrom torch.utils import _pytree\n"
                      "from lightning.x import _y\nn = torch._C._foo\ns = dist.distributed_c10d._get_default_store()\n"
                      "ok = dist.get_rank() + self._private\n")
    # the import, the name, torch._C and ._foo, dist...._get_default_store; not self._private
    assert len(_private_uses(sample)) == 5, _private_uses(sample)
