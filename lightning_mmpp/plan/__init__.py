"""Placement planner: from a short profile of the real model to the fastest layout that fits.

* :func:`profile_model` (torch) measures every layer of every module in one process and
  returns a :class:`ModelProfile` (saved as JSON with :meth:`ModelProfile.to_json`);
* :func:`plan_placements` (pure Python) searches pp, dp, colocation, split points,
  shard / recompute and microbatch counts, scores each candidate with the project's schedule
  simulator and returns the best :class:`Plan` s, each with its predicted step time, peak
  memory per rank and bubble, ready for ``MultiModulePipelineStrategy``;
* :func:`calibrate` (torch, Lightning) measures this machine's framework, link and collective
  costs with a few real steps on local processes; a :class:`Calibration` given to
  ``profile_model`` or ``plan_placements`` makes the predictions hold on this machine;
* ``python -m lightning_mmpp.plan`` does all of it from the command line (``--calibrate``,
  ``--calibration FILE``, ``--validate K``).

``profile_model`` and ``calibrate`` load on first use, so ``costs`` and ``search`` import without torch.
"""

from typing import Any

from lightning_mmpp.plan.calibration import Calibration
from lightning_mmpp.plan.costs import LayerProfile, ModelProfile, ModuleProfile
from lightning_mmpp.plan.search import Plan, chain_profile, plan_placements, plans_table

__all__ = ["Calibration", "LayerProfile", "ModelProfile", "ModuleProfile", "Plan", "chain_profile", "plan_placements",
           "plans_table", "calibrate", "profile_model"]


def __getattr__(name: str) -> Any:
    if name == "profile_model":
        from lightning_mmpp.plan.profile import profile_model

        return profile_model
    if name == "calibrate":
        from lightning_mmpp.plan.measure import calibrate

        return calibrate
    raise AttributeError(f"module 'lightning_mmpp.plan' has no attribute {name!r}")
