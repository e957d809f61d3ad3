"""The installed torch and Lightning are inside the ranges pyproject.toml declares.

The package uses private Lightning APIs (the automatic-optimisation loop, launchers,
``_update_dataloader``, ``_init_dist_connection``), so the Lightning range is bounded above;
README.md says which versions the suite was run with.
"""

from __future__ import annotations

import os
import tomllib
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared() -> dict[str, Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return {Requirement(text).name: Requirement(text) for text in project["dependencies"]}


def test_lightning_is_bounded_above():
    spec = _declared()["lightning"].specifier
    assert any(s.operator in ("<", "<=", "~=", "==") for s in spec), f"lightning{spec} needs an upper bound"


@pytest.mark.parametrize("package", ["lightning", "torch"])
def test_installed_version_is_declared(package):
    requirement = _declared()[package]
    installed = version(package)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{package} {installed} is outside the declared {requirement}; run the suite on it and widen the range "
        "(README: tested versions) or install a declared version."
    )
